"""The aggregate runtime: catch-up gate, exactly-once command processing and request/reply results."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kafold import protect
from kafold.config import AggregateConfig, KafoldConfig
from kafold.daemon.aggregates.recovery import Base, FullReplay, Restorer
from kafold.daemon.aggregates.restorer import SnapshotRestorer
from kafold.daemon.aggregates.runtime import AggregateRuntime, dlq_topic
from kafold.daemon.aggregates.workers import AggregateWorkers
from kafold.domain import AggregateDomain
from kafold.messages import ACCEPTED, REJECTED, Command, Result

__all__ = ["ACCEPTED", "REJECTED", "AggregateRuntime", "AggregateWorkers", "Base", "Command", "FullReplay", "Restorer",
           "Result", "build_runtime", "dlq_topic", "instance_id"]


def instance_id(cfg: KafoldConfig) -> str:
    """This process's stable identity in transactional ids: `$KAFOLD_INSTANCE_ID`, else host name and HTTP port.

    A restarted instance must reuse it, so that its first `init_transactions` aborts what a crash left open.
    """
    return os.environ.get("KAFOLD_INSTANCE_ID") or f"{socket.gethostname()}-{cfg.daemon.http_port}"


def build_runtime(cfg: KafoldConfig, agg: AggregateConfig, base: Path,
                  protector: protect.Protector | None) -> AggregateRuntime | AggregateWorkers:
    """The runtime the daemon hosts for one `[[aggregates]]` entry: in its own process, or in
    `daemon.aggregate_processes` worker processes (workers.py). `protector`: the host's (kafold.protect.build of
    `cfg`, None when nothing is protected); each worker process builds its own from its Setup."""
    if cfg.daemon.aggregate_processes > 1:
        return AggregateWorkers(cfg.kafka, cfg.daemon, agg, base, instance_id=instance_id(cfg),
                                tracing_config=cfg.tracing, protected=protect.sent(protector))
    domain = AggregateDomain.load(agg, cfg.daemon.python_path, base).protected(protector)
    return AggregateRuntime(cfg.kafka, cfg.daemon, agg, domain, instance_id=instance_id(cfg),
                            restorer=_restorer(cfg, agg, domain))


def _restorer(cfg: KafoldConfig, agg: AggregateConfig, domain: AggregateDomain) -> Restorer:
    """Latest usable snapshots + tail (kafold.snapshot)."""
    return SnapshotRestorer(cfg.kafka, agg, domain)
