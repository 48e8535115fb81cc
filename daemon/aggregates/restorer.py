"""SnapshotRestorer: the aggregate runtime's `Restorer` hook, backed by the latest usable snapshots.

Offset note: `restore(partition, low, end)` returns the usable snapshot states and `Selection.start` (the lowest
covered offset, or `low` when a full replay is needed); the runtime then folds the tail from there, skipping
events whose version its aggregate already has — which is every event a snapshot covers.
"""

from __future__ import annotations

from typing import Any

from kafold import protect
from kafold.config import AggregateConfig, KafkaConfig
from kafold.daemon.aggregates.recovery import Base
from kafold.domain import AggregateDomain
from kafold.snapshot import kafka_io
from kafold.snapshot.partition import select_partition
from kafold.snapshot.select import Identity


class SnapshotRestorer:
    """`AggregateRuntime(..., restorer=SnapshotRestorer(kafka, agg, domain))`."""

    def __init__(self, kafka: KafkaConfig, agg: AggregateConfig, domain: AggregateDomain) -> None:
        self.kafka, self.agg, self.domain = kafka, agg, domain
        self.identity = Identity(agg.name, domain.fingerprint, agg.state_schema_version,
                                 protect.state_sealer(domain.protector, agg.name))  # sealed states opened

    def restore(self, partition: int, low: int, end: int) -> Base:
        consumer: Any = kafka_io.reader(self.kafka)
        try:
            sel = select_partition(consumer, self.agg, self.identity, partition, low, end)
        finally:
            consumer.close()
        states = {key.decode(): (self.domain.state_from_json(s.state), s.version) for key, s in sel.bases.items()}
        windows = {key.decode(): [c for c in s.commands if c[0]] for key, s in sel.bases.items() if s.commands}
        # a snapshot whose window was too big to carry whole says from when it carries it (MAX_SNAPSHOT_COMMANDS)
        partial = {key.decode(): c[1] for key, s in sel.bases.items() for c in s.commands if not c[0]}
        return Base(start=sel.start, states=states,
                    snapshot_version=sel.marker.offset if sel.marker is not None else None, windows=windows,
                    partial=partial)
