"""Helpers for snapshot tests: bank-domain aggregates on real topics and generated histories."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafold import kafka_clients, topics
from kafold.config import AggregateConfig, KafkaConfig, TopicSpec
from kafold.envelope import Event, encode
from kafold.snapshot import Domain, kafka_io, record, restore
from kafold.snapshot import folder as new_folder
from tests.support import EXAMPLES

BANK = str(EXAMPLES / "bank")


def bank_aggregate(name: str, partitions: int = 2, fingerprint: str = "test-v1") -> AggregateConfig:
    return AggregateConfig(name=name, initial="bank_domain:initial", evolve="bank_domain:evolve",
                           decide="bank_domain:decide", partitions=partitions, fingerprint=fingerprint)


def bank_domain(agg: AggregateConfig) -> Domain:
    return Domain.load(agg, [BANK])


def generate(rng: random.Random, accounts: int, n: int, versions: dict[str, int]) -> list[tuple[str, int, str, dict]]:
    """n valid bank events (aggregate id, version, type, payload) over `accounts` accounts, continuing `versions`."""
    out = []
    for _ in range(n):
        aid = f"acc-{rng.randrange(accounts):04d}"
        v = versions[aid] = versions.get(aid, 0) + 1
        if v == 1:
            out.append((aid, v, "AccountOpened", {"owner": f"owner {aid}", "currency": "EUR"}))
        elif rng.random() < 0.6:
            out.append((aid, v, "MoneyDeposited", {"amount": rng.randint(1, 50) * 100}))
        else:
            out.append((aid, v, "MoneyWithdrawn", {"amount": rng.randint(1, 30) * 100}))
    return out


def partition_of(aid: str, partitions: int) -> int:
    return int(aid.rsplit("-", 1)[1]) % partitions


@dataclass
class Bank:
    """A bank aggregate with its topics created; `produce(n)` appends generated events."""

    kafka: KafkaConfig
    agg: AggregateConfig
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    versions: dict[str, int] = field(default_factory=dict)
    accounts: int = 40
    produced: int = 0

    def __post_init__(self) -> None:
        self.producer = kafka_clients.producer(self.kafka, **{"enable.idempotence": True, "linger.ms": 5})
        self.domain = bank_domain(self.agg)

    def produce(self, n: int) -> None:
        for aid, v, kind, payload in generate(self.rng, self.accounts, n, self.versions):
            self.send(aid, v, kind, payload)
        self.producer.flush(30)
        self.produced += n

    def send(self, aid: str, v: int, kind: str, payload: Any, value: bytes | None = None) -> None:
        key, val, headers = encode(Event.new(kind, self.agg.name, aid, v, payload))
        self.producer.produce(self.agg.topic("events"), value=val if value is None else value, key=key,
                              headers=headers, partition=partition_of(aid, self.agg.partitions))

    def partitions(self) -> list[int]:
        return list(range(self.agg.partitions))


def make_bank(kafka: KafkaConfig, name: str, snapshot_config: dict[str, str] | None = None) -> Bank:
    """A bank aggregate `name` with its events topic and compacted snapshot topic created."""
    agg = bank_aggregate(name)
    topics.ensure(kafka, [TopicSpec(agg.topic("events"), agg.partitions, 1, {}),
                          TopicSpec(agg.topic("snapshot"), agg.partitions, 1,
                                    snapshot_config or {"cleanup.policy": "compact"})])
    return Bank(kafka, agg)


def snapshot_partition(bank: Bank, p: int, limit: int | None = None) -> int:
    """What a snapshot run does for partition `p`, folding from scratch (a snapshot for every aggregate, then the
    marker), without Spark; returns the end offset. `limit` writes only that many snapshots and no marker."""

    from kafold.snapshot.partition import fold_partition, write_marker

    consumer = kafka_io.reader(bank.kafka)
    folded = fold_partition(consumer, bank.agg, bank.domain, p, use_snapshots=False)
    consumer.close()
    producer = kafka_io.writer(bank.kafka)
    end = folded.selection.end
    snaps = list(folded.folder.held.snapshots(p, end))
    kafka_io.write(producer, bank.agg.topic("snapshot"), p, snaps if limit is None else snaps[:limit])
    if limit is None:  # otherwise: a run killed between its snapshot writes and its marker
        write_marker(producer, bank.agg, bank.domain.identity, p, end)
    return int(end)


def write_raw(bank: Bank, p: int, key: bytes, value: bytes) -> None:
    bank.producer.produce(bank.agg.topic("snapshot"), value=value, key=key, partition=p)
    bank.producer.flush(30)


def snapshot_records(bank: Bank, p: int) -> list[tuple[bytes | None, bytes | None, int]]:
    consumer = kafka_io.reader(bank.kafka)
    try:
        return list(kafka_io.records(consumer, bank.agg.topic("snapshot"), p))
    finally:
        consumer.close()


def assert_restore_equals_full_replay(bank: Bank) -> None:
    for p in bank.partitions():
        fast = restore(bank.kafka, bank.agg, bank.domain, p)
        full = restore(bank.kafka, bank.agg, bank.domain, p, use_snapshots=False)
        assert fast.states == full.states, p
        for aid, (_, version) in full.states.items():
            assert version == bank.versions[aid]  # every event folded exactly once


def assert_every_snapshot_true_at_its_offset(bank: Bank) -> None:
    """Each snapshot on the topic equals the full replay of its aggregate's events below its offset."""
    consumer = kafka_io.reader(bank.kafka)
    for p in bank.partitions():
        events = [b for b in kafka_io.read_range(consumer, bank.agg.topic("events"), p, 0, None)]
        for key, value, _ in snapshot_records(bank, p):
            if record.is_marker(key):
                continue
            snap = record.decode(key, value)
            folder = new_folder(bank.domain)
            for offsets, keys, values in events:
                picked = [i for i, (o, k) in enumerate(zip(offsets, keys, strict=True))
                          if k == key and o < snap.offset]
                folder.fold([offsets[i] for i in picked], [keys[i] for i in picked], [values[i] for i in picked])
            state, version = folder.held.states()[snap.aggregate_id]
            assert (bank.domain.to_json(state), version) == (snap.state, snap.version), snap.aggregate_id
    consumer.close()


def write_config(bank: Bank, where: Path) -> Path:
    """A kafold.toml for the bank aggregate on the bank's broker (for the CLI)."""
    toml = where / "kafold.toml"
    agg = bank.agg
    toml.write_text(f'[kafka]\nbootstrap_servers = "{bank.kafka.bootstrap_servers}"\n'
                    f'[daemon]\npython_path = ["{BANK}"]\n'
                    f'[[aggregates]]\nname = "{agg.name}"\ninitial = "{agg.initial}"\nevolve = "{agg.evolve}"\n'
                    f'decide = "{agg.decide}"\npartitions = {agg.partitions}\nfingerprint = "{agg.fingerprint}"\n')
    return toml
