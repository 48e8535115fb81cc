"""The contract every sink connector must pass, and helpers for a plugin's own tests (needs kafold[daemon]).

A plugin's test suite subclasses `SinkTaskContract` once per connector (set `connector_ref` to its entry point name
or `module:Class`, and `config` to a valid configuration); the inherited tests check the config declaration, the
task life cycle, idempotent `put` and, against a real broker, that the runner drives it and commits to the end.
The broker comes from the fixtures in `kafold.tools.dev.fixtures` (`pytest_plugins = ["kafold.tools.dev.fixtures"]` in
the plugin's conftest.py): `KAFOLD_TEST_BOOTSTRAP` names one, else a private `kafold dev` stack is started.
See docs/connectors.md.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka import TopicPartition as KafkaTP
from confluent_kafka.admin import NewTopic

from kafold import kafka_clients
from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig
from kafold.connectors.api import (
    Connector,
    ErrantRecordReporter,
    SinkRecord,
    SinkTask,
    SinkTaskContext,
    TaskConfig,
    TopicPartition,
)
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner
from kafold.envelope import Event, encode
from kafold.schema import Problems, is_missing, load

__all__ = ["LocalContext", "SinkTaskContract", "committed", "create_topic", "free_port", "make_event", "new_producer",
           "produce", "wait_for"]


class LocalContext(SinkTaskContext):
    """A SinkTaskContext without a consumer, for driving a task directly; records what the task asked."""

    def __init__(self, name: str = "contract", reporter: ErrantRecordReporter | None = None) -> None:
        self.connector_name, self.task_id = name, 0
        self.assigned: set[TopicPartition] = set()
        self.paused: set[TopicPartition] = set()
        self.seeks: dict[TopicPartition, int] = {}
        self.commit_requested = False
        self.reporter = reporter
        self.committed: dict[TopicPartition, int] = {}  # what "the runner" committed: set by the test

    def assignment(self) -> frozenset[TopicPartition]:
        return frozenset(self.assigned)

    def pause(self, *partitions: TopicPartition) -> None:
        self.paused.update(partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        self.paused.difference_update(partitions)

    def offset(self, tp: TopicPartition, offset: int) -> None:
        self.seeks[tp] = offset

    def request_commit(self) -> None:
        self.commit_requested = True

    def errant_record_reporter(self) -> ErrantRecordReporter | None:
        return self.reporter

    def committed_offsets(self) -> dict[TopicPartition, int]:
        return dict(self.committed)


def make_event(aggregate_id: str, version: int, type_: str = "ThingHappened", **payload: Any) -> Event:
    """An event of aggregate type "thing" (payload {"n": version} unless given)."""
    return Event.new(type_, "thing", aggregate_id, version, payload or {"n": version})


def create_topic(kafka: KafkaConfig, name: str, partitions: int = 1, configs: dict[str, str] | None = None) -> None:
    """Create `name` (replication factor 1) and wait for it."""
    admin = kafka_clients.admin(kafka)
    for fut in admin.create_topics([NewTopic(name, partitions, 1, config=configs or {})]).values():
        fut.result(15)


def new_producer(kafka: KafkaConfig) -> Producer:
    """An idempotent producer for `produce` (one per call unless a long-lived one is handed in)."""
    return Producer(kafka_clients.librdkafka(kafka, **{"enable.idempotence": True, "linger.ms": 5}))


def produce(kafka: KafkaConfig, topic: str, items: Sequence[tuple[int, bytes | None, bytes | None, Any]],
            producer: Producer | None = None, flush_s: float = 15) -> list[tuple[int, int]]:
    """Produce (partition, key, value, headers) in order; returns each record's (partition, offset)."""
    owned = producer is None
    producer = producer or new_producer(kafka)
    coords: list[tuple[int, int] | None] = [None] * len(items)

    def on_delivery(i: int) -> Callable[[Any, Any], None]:
        def cb(err: Any, msg: Any) -> None:
            assert err is None, err
            coords[i] = (msg.partition(), msg.offset())
        return cb

    for i, (partition, key, value, headers) in enumerate(items):
        producer.produce(topic, value=value, key=key, headers=headers, partition=partition,
                         on_delivery=on_delivery(i))
    left = kafka_clients.close_producer(producer, flush_s) if owned else producer.flush(flush_s)
    assert left == 0, f"{left} record(s) of {len(items)} not acknowledged by {topic!r} within {flush_s} s"
    return [c for c in coords if c is not None]


def committed(kafka: KafkaConfig, group: str, topic: str, partitions: int, within_s: float = 30.0) -> dict[int, int]:
    """The group's committed offsets (next offset to read) of the topic's partitions. A retriable error (the group
    coordinator moving or still loading, NOT_COORDINATOR on a fresh broker) is asked again for up to `within_s`."""
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": group}))
    deadline = time.monotonic() + within_s
    try:
        while True:
            try:
                got = consumer.committed([KafkaTP(topic, p) for p in range(partitions)], timeout=10)
                return {tp.partition: tp.offset for tp in got}
            except KafkaException as e:
                if not kafka_clients.coordinator_changing(e.args[0]) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        consumer.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a test's HTTP receiver or daemon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll `condition` every 0.2 s; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


class SinkTaskContract:
    """Behaviours every sink connector promises. Set `connector_ref` (registry name) and `config`."""

    connector_ref: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}

    def settings(self, name: str = "contract",
                 topics: tuple[str, ...] = ("contract.topic",)) -> ConnectorConfig:
        return ConnectorConfig(name=name, connector_class=self.connector_ref, topics=list(topics),
                               config=dict(self.config))

    def connector(self, settings: ConnectorConfig | None = None) -> Connector[Any]:
        return instantiate(settings or self.settings(), Path("."))

    def services(self) -> dict[str, Any]:
        """The services the host gives a task (`TaskConfig.with_services`: `kafka`, `postgres`), for the tests
        that drive it without a runner: none by default; a connector whose task needs them to start (an effect
        connector: its dead-letter producer and its ledger) returns them, e.g. from the session's fixtures."""
        return {}

    def task_config(self, connector: Connector[Any]) -> TaskConfig[Any]:
        """The first task's configuration with `services` filled in, as the host would hand it over."""
        return connector.task_configs(1)[0].with_services(**self.services())

    def started_task(self, context: LocalContext | None = None) -> tuple[SinkTask, LocalContext]:
        connector = self.connector()
        task = connector.task_class()
        assert isinstance(task, SinkTask)
        ctx = context or LocalContext()
        task.start(self.task_config(connector), ctx)
        return task, ctx

    def records(self, tp: TopicPartition, first: int, count: int) -> list[SinkRecord]:
        return [SinkRecord(tp.topic, tp.partition, first + i, f"agg-{i % 3}",
                           make_event(f"agg-{i % 3}", i + 1),
                           1_700_000_000_000 + i) for i in range(count)]

    def test_config_is_declared_once_as_a_frozen_documented_dataclass(self) -> None:
        cls = self.connector().config_class
        assert dataclasses.is_dataclass(cls)
        assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert all(f.metadata.get("doc") for f in dataclasses.fields(cls))

    def test_unknown_config_keys_are_reported_by_name(self) -> None:
        problems = Problems("kafold.toml")
        load(self.connector().config_class, {**self.config, "no_such_key": 1}, "config", problems, Path("."))
        assert any("config.no_such_key" in p for p in problems.items)

    def test_configured_values_load(self) -> None:
        problems = Problems("kafold.toml")
        assert not is_missing(load(self.connector().config_class, self.config, "c", problems, Path(".")))
        assert problems.items == []

    def test_task_configs_respect_max_tasks(self) -> None:
        for n in (1, 3):
            assert 1 <= len(self.connector().task_configs(n)) <= n

    def test_lifecycle_open_put_precommit_close_stop(self) -> None:
        task, ctx = self.started_task()
        tp = TopicPartition("contract.topic", 0)
        ctx.assigned.add(tp)
        task.open([tp])
        task.put(self.records(tp, 0, 5))
        offsets = dict(task.pre_commit({tp: 5}))
        assert set(offsets) <= {tp} and all(0 <= off <= 5 for off in offsets.values())
        task.close([tp])
        task.stop()

    def test_empty_put_is_accepted(self) -> None:
        task, _ = self.started_task()
        task.put([])
        task.stop()

    def test_put_of_the_same_batch_twice_is_accepted(self) -> None:
        """At-least-once delivery re-offers batches after a crash: put must be idempotent."""
        task, ctx = self.started_task()
        tp = TopicPartition("contract.topic", 1)
        ctx.assigned.add(tp)
        task.open([tp])
        batch = self.records(tp, 10, 4)
        task.put(batch)
        task.put(batch)
        task.pre_commit({tp: 14})
        task.close([tp])
        task.stop()

    def test_runs_under_the_runner_and_commits_to_the_end(self, kafka_config: KafkaConfig,
                                                          unique: str) -> None:
        topic = f"{unique}.events"
        create_topic(kafka_config, topic, partitions=2)
        items = [(i % 2, *encode(make_event(f"a{i % 2}", i // 2 + 1))) for i in range(20)]
        coords = produce(kafka_config, topic, items)
        ends = {p: max(o for pp, o in coords if pp == p) + 1 for p in (0, 1)}
        settings = self.settings(unique, (topic,))
        daemon = DaemonConfig(group_prefix="contract", batch_max_records=7, shutdown_grace_s=5)
        stop = threading.Event()
        connector = instantiate(settings, Path("."))
        runner = SinkRunner(connector, self.task_config(connector), kafka=kafka_config, daemon=daemon, stop=stop)
        thread = threading.Thread(target=runner.run)
        thread.start()
        try:
            group = runner.group_id
            wait_for(lambda: committed(kafka_config, group, topic, 2) == ends, "offsets committed to the end")
        finally:
            stop.set()
            thread.join(30)
        assert not thread.is_alive() and runner.error is None
