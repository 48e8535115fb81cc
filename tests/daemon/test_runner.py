"""SinkRunner end to end on a real broker: put once in order, bad records dead-lettered, commit after put."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException
from structlog.testing import capture_logs

from kafold import kafka_clients
from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig
from kafold.connectors import registry
from kafold.connectors.api import Connector, SinkRecord, SinkTask, SinkTaskContext, TaskConfig, TopicPartition
from kafold.daemon import tasks
from kafold.daemon.liveness import GroupWatch
from kafold.daemon.runner import SinkRunner
from kafold.envelope import encode
from kafold.errors import FatalError, RetriableError
from kafold.schema import setting
from tests.support import committed, create_topic, make_event, produce, wait_for


@dataclass(frozen=True)
class RecordingConfig:
    fail_on_type: str = setting("", doc="put raises FatalError on a batch holding this event type.")
    retriable_failures: int = setting(0, doc="put raises RetriableError this many times first.", minimum=0)
    put_delay_s: float = setting(0.0, doc="put sleeps this long first (a slow sink).", minimum=0.0)
    pause_and_block_s: float = setting(0.0, doc="The first put pauses the assignment (as flow control does), then "
                                       "blocks this long; close forgets the pause with the partitions.", minimum=0.0)


@dataclass(frozen=True)
class Recording:
    """What a recording task gets: the settings, and the connector's lists it records into."""

    settings: RecordingConfig
    received: list[SinkRecord]
    yield_points: list[int]
    puts_started: list[float]  # CLOCK_MONOTONIC at the start of every put


class RecordingTask(SinkTask):
    """Remembers every record of every successful put."""

    def start(self, task_config: TaskConfig[Recording], context: SinkTaskContext) -> None:
        self.config = task_config.config.settings
        self.received = task_config.config.received
        self.yield_points = task_config.config.yield_points
        self.puts_started = task_config.config.puts_started
        self.failures = 0
        self.context = context
        self.paused: set[Any] = set()

    def yield_point(self) -> None:
        self.yield_points.append(len(self.received))

    def put(self, records: Any) -> None:
        self.puts_started.append(time.monotonic())
        if self.config.put_delay_s:
            time.sleep(self.config.put_delay_s)
        if self.config.pause_and_block_s and not self.received:
            self.paused = set(self.context.assignment())
            self.context.pause(*self.paused)
            time.sleep(self.config.pause_and_block_s)
        if self.failures < self.config.retriable_failures:
            self.failures += 1
            raise RetriableError("sink unavailable (test)")
        if any(r.event.type == self.config.fail_on_type for r in records):
            raise FatalError("poison batch (test)")
        self.received.extend(records)

    def close(self, partitions: Any) -> None:
        self.paused -= set(partitions)  # the reason for the pause went with the partitions

    def stop(self) -> None:
        pass


class RecordingConnector(Connector[RecordingConfig]):
    config_class = RecordingConfig
    task_class = RecordingTask

    def __init__(self, settings: ConnectorConfig, config: RecordingConfig) -> None:
        super().__init__(settings, config)
        self.received: list[SinkRecord] = []
        self.yield_points: list[int] = []
        self.puts_started: list[float] = []

    def task_configs(self, max_tasks: int) -> list[TaskConfig[Any]]:
        return [TaskConfig(0, Recording(self.config, self.received, self.yield_points, self.puts_started))]


RECORDING = "tests.daemon.test_runner:RecordingConnector"  # as a configuration names it: its module and class


@dataclass
class Run:
    runner: SinkRunner
    connector: RecordingConnector
    stop: threading.Event
    thread: threading.Thread


def start(kafka: KafkaConfig, name: str, topic: str, **config: Any) -> Run:
    settings = ConnectorConfig(name=name, connector_class=RECORDING, topics=[topic],
                               config=config)
    connector = registry.instantiate(settings, Path("."))
    assert isinstance(connector, RecordingConnector)
    stop = threading.Event()
    daemon = DaemonConfig(group_prefix="kt", batch_max_records=10, batch_max_wait_ms=100, shutdown_grace_s=5)
    runner = SinkRunner(connector, connector.task_configs(1)[0], kafka=kafka, daemon=daemon, stop=stop)
    thread = threading.Thread(target=runner.run)
    thread.start()
    return Run(runner, connector, stop, thread)


def finish(run: Run) -> None:
    run.stop.set()
    run.thread.join(30)
    assert not run.thread.is_alive()


def valid(aggregate_id: str, version: int, type_: str = "ThingHappened") -> tuple[bytes, bytes, Any]:
    return encode(make_event(aggregate_id, version, type_, secret=f"SECRET-{version}"))


@pytest.fixture(scope="module")
def scenario(kafka_config: KafkaConfig) -> Iterator[dict[str, Any]]:
    """60 valid events over 2 partitions with 4 malformed records among them, consumed by one runner."""
    name = f"kt.runner.{uuid.uuid4().hex[:8]}"
    topic, dlq = f"{name}.events", f"kafold.dlq.{name}"
    create_topic(kafka_config, topic, 2)
    create_topic(kafka_config, dlq, 1)
    items: list[tuple[int, bytes | None, bytes | None, Any]] = []
    bad_at: list[int] = []
    for i in range(64):
        p = i % 2
        if i in (5, 18, 33, 62):
            bad = [(b"a0", b"{broken", None), (b"a1", b'{"type": "X"}', valid("a1", 1)[2]),
                   (b"a2", valid("a1", 1)[1], valid("a1", 1)[2]), (None, None, None)][len(bad_at)]
            bad_at.append(i)
            items.append((p, *bad))
        else:
            items.append((p, *valid(f"a{p}", i + 1)))
    with capture_logs() as logs:
        coords = produce(kafka_config, topic, items)
        run = start(kafka_config, name, topic)
        ends = {p: max(o for pp, o in coords if pp == p) + 1 for p in (0, 1)}
        try:
            wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 2) == ends,
                     "commit to the end")
        finally:
            finish(run)
    yield {"coords": coords, "bad_at": bad_at, "received": run.connector.received, "logs": logs, "ends": ends,
           "dlq": dlq, "topic": topic, "name": name, "run": run}


def test_every_valid_event_is_put_exactly_once_in_partition_order(scenario: dict[str, Any]) -> None:
    coords, bad_at = scenario["coords"], scenario["bad_at"]
    expected = {p: [o for i, (pp, o) in enumerate(coords) if pp == p and i not in bad_at] for p in (0, 1)}
    got = {p: [r.offset for r in scenario["received"] if r.partition == p] for p in (0, 1)}
    assert got == expected
    assert all(r.event.payload["secret"].startswith("SECRET-") for r in scenario["received"])


def test_the_decode_loop_offers_the_task_a_yield_point_in_each_batch(scenario: dict[str, Any]) -> None:
    # Batches of <= 10 records here: one yield point each (every 256 records), before any of its records is put.
    run = scenario["run"]
    points = run.connector.yield_points
    assert len(points) == run.runner.counts["batches"] > 0
    assert points == sorted(points) and points[-1] <= len(scenario["received"])


def test_malformed_records_land_in_the_dlq_with_their_coordinates(
        scenario: dict[str, Any], kafka_config: KafkaConfig) -> None:
    consumer = Consumer(kafka_clients.librdkafka(kafka_config, **{
        "group.id": f"{scenario['name']}.reader", "auto.offset.reset": "earliest"}))
    consumer.subscribe([scenario["dlq"]])
    letters: list[Any] = []
    try:
        wait_for(lambda: bool(letters.extend(m for m in consumer.consume(10, 0.5) if not m.error()))
                 or len(letters) >= 4, "dead letters")
    finally:
        consumer.close()
    got = sorted((int(h["kafold-dlq-partition"]), int(h["kafold-dlq-offset"]), h["kafold-dlq-topic"].decode(),
                  h["kafold-dlq-connector"].decode(), h["kafold-dlq-error-class"].decode())
                 for h in ({k: v for k, v in m.headers()} for m in letters))
    expected = sorted((*scenario["coords"][i], scenario["topic"], scenario["name"],
                       "kafold.errors.DecodeError") for i in scenario["bad_at"])
    assert got == expected
    first = next(m for m in letters if dict(m.headers())["kafold-dlq-offset"] == str(
        scenario["coords"][5][1]).encode() and dict(m.headers())["kafold-dlq-partition"] == b"1")
    assert first.value() == b"{broken" and first.key() == b"a0"


def test_committed_offsets_equal_the_end_of_each_partition(
        scenario: dict[str, Any], kafka_config: KafkaConfig) -> None:
    assert committed(kafka_config, scenario["run"].runner.group_id, scenario["topic"], 2) == scenario["ends"]


def test_one_batch_line_per_batch_with_counts_and_offsets_but_no_payload(scenario: dict[str, Any]) -> None:
    batches = [e for e in scenario["logs"] if e["event"] == "runner.batch"]
    assert batches and sum(b["records"] for b in batches) == 64
    assert sum(b["dead_lettered"] for b in batches) == 4
    required = {"connector", "records", "dead_lettered", "duration_ms", "committed"}
    assert all(required <= set(b) for b in batches)
    assert "SECRET-" not in repr(scenario["logs"])


def test_a_fatal_put_leaves_the_committed_offset_before_its_batch(kafka_config: KafkaConfig,
                                                                  unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    produce(kafka_config, topic, [(0, *valid("a", v)) for v in range(1, 11)])
    run = start(kafka_config, unique, topic, fail_on_type="Poison")
    try:
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 1) == {0: 10}, "first batch")
        produce(kafka_config, topic, [(0, *valid("a", v, "Poison" if v == 11 else "ThingHappened"))
                                      for v in range(11, 21)])
        run.thread.join(60)
        assert not run.thread.is_alive(), "a FatalError must stop the task"
    finally:
        finish(run)
    assert isinstance(run.runner.error, FatalError)
    assert committed(kafka_config, run.runner.group_id, topic, 1) == {0: 10}
    assert [r.offset for r in run.connector.received] == list(range(10))


def test_the_loop_keeps_polling_while_a_commit_awaits_its_answer(
        request: pytest.FixtureRequest, kafka_config: KafkaConfig, unique: str) -> None:
    """A batch's commit is sent asynchronously: while the broker (paused) does not answer it, the runner goes on
    polling (heartbeats, rebalance callbacks, fetching); what the runner records as committed is the answer, once
    the broker is back. A synchronous commit held the runner's thread for as long as the answer took (forever,
    once, in CI: confluent-kafka-python#1801)."""
    if os.environ.get("KAFOLD_TEST_BOOTSTRAP"):
        pytest.skip("pauses the dev stack's broker; an external broker is not ours to pause")
    broker = request.getfixturevalue("dev_stack").broker
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    produce(kafka_config, topic, [(0, *valid("a", v)) for v in range(1, 11)])
    run = start(kafka_config, unique, topic, put_delay_s=1.5)  # the 10 records are one batch (batch_max_records)
    tp = TopicPartition(topic, 0)
    try:
        wait_for(lambda: bool(run.connector.puts_started), "a put to start")
        os.kill(broker.pid, signal.SIGSTOP)  # for less than the session timeout: no rebalance
        try:
            # the put ends; its batch's commit goes to the paused broker
            wait_for(lambda: bool(run.connector.received), "the put to end", timeout=10)
            polls = run.runner.counts["polls"]
            time.sleep(2.0)
            assert run.runner.counts["polls"] > polls + 10, "the loop stopped polling while its commit was unanswered"
            assert run.runner.commits.committed.get(tp) is None, "an unanswered commit counts as committed"
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        wait_for(lambda: run.runner.commits.committed.get(tp) == 10, "the commit's answer")
        assert committed(kafka_config, run.runner.group_id, topic, 1) == {0: 10}
        assert [r.offset for r in run.connector.received] == list(range(10))
    finally:
        finish(run)


def test_a_retriable_put_is_retried_until_it_succeeds(kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    produce(kafka_config, topic, [(0, *valid("a", v)) for v in range(1, 6)])
    run = start(kafka_config, unique, topic, retriable_failures=2)
    try:
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 1) == {0: 5},
                 "commit after retries")
    finally:
        finish(run)
    assert run.runner.error is None
    assert [r.offset for r in run.connector.received] == [0, 1, 2, 3, 4]


def test_a_put_still_failing_at_stop_is_abandoned_within_the_grace_and_nothing_is_committed(
        kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    produce(kafka_config, topic, [(0, *valid("a", v)) for v in range(1, 6)])
    with capture_logs() as logs:
        run = start(kafka_config, unique, topic, retriable_failures=1_000_000)
        try:
            wait_for(lambda: sum(e["event"] == "runner.put_retrying" for e in logs) >= 2,
                     "the put retried")
        finally:
            finish(run)  # the grace is 5 s: the thread has ended well within finish's join
    abandoned = [e for e in logs if e["event"] == "runner.batch_abandoned"]
    assert len(abandoned) == 1 and abandoned[0]["error"] == "put still failing: sink unavailable (test)", abandoned
    assert run.runner.failed and run.runner.error is None
    assert run.connector.received == []
    assert committed(kafka_config, run.runner.group_id, topic, 1)[0] < 0  # no offset: delivered again on restart


@pytest.mark.apache_kafka
def test_a_partition_paused_when_the_loop_outlived_max_poll_interval_is_fetched_once_assigned_again(
        kafka_config: KafkaConfig, unique: str) -> None:
    """A put blocked past max.poll.interval.ms with the partitions paused: librdkafka leaves the group, the
    partitions are lost and assigned again; librdkafka would keep them paused, the runner lifts the pause."""
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    produce(kafka_config, topic, [(p, *valid(f"a{p}", v)) for v in range(1, 21) for p in (0, 1)])
    block_s = kafka_config.rebalance_timeout_ms / 1000 + 3  # the rebalance timeout is max.poll.interval.ms
    run = start(kafka_config, unique, topic, pause_and_block_s=block_s)
    def all_committed() -> bool:
        try:
            return committed(kafka_config, run.runner.group_id, topic, 2) == {0: 20, 1: 20}
        except KafkaException:  # the group's coordinator still loading on a fresh broker
            return False

    try:
        wait_for(all_committed, "every record put and committed after the partitions were lost and assigned again",
                 timeout=90)
    finally:
        finish(run)
    assert run.runner.error is None and run.runner.counts["assignments"] >= 2, run.runner.counts
    assert {(r.partition, r.offset) for r in run.connector.received} == {(p, o) for p in (0, 1) for o in range(20)}


def test_sink_record_fast_constructor_equals_the_dataclass() -> None:
    from kafold.connectors.api import SinkRecord, sink_record
    from kafold.envelope import Event

    event = Event.new("Opened", "account", "a-1", 1, {})
    fast = sink_record("t", 3, 42, "a-1", event, 1700)
    assert fast == SinkRecord("t", 3, 42, "a-1", event, 1700)
    assert fast.tp.partition == 3 and hash(fast.tp) == hash(SinkRecord("t", 3, 0, "k", event).tp)
    with pytest.raises(AttributeError):
        fast.offset = 1  # type: ignore[misc]  # still frozen


def test_the_consumer_reports_its_group_steady_with_its_assignment(kafka_config: KafkaConfig, unique: str) -> None:
    """librdkafka's statistics reach the runner: once assigned, the group is steady with both partitions."""
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    run = start(kafka_config, unique, topic)
    try:
        wait_for(lambda: bool(run.runner.assigned) and run.runner.group_watch.current is not None
                 and run.runner.group_watch.current.steady, "a steady group report", timeout=30)
        state = run.runner.group_watch.current
        assert state is not None and state.assignment_size == 2 and state.rebalances >= 1
        assert run.runner.group_watch.pending_s() == 0.0
    finally:
        finish(run)


class _WedgeOnce(GroupWatch):
    """A watch that calls the join wedged once (a coordinator that never answers cannot be made on demand)."""

    fire = False

    def wedged(self, now: float | None = None) -> bool:
        fired, self.fire = self.fire, False
        return fired


def test_a_wedged_join_leaves_the_group_and_joins_again_losing_nothing(kafka_config: KafkaConfig,
                                                                        unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    produce(kafka_config, topic, [(v % 2, *valid(f"a{v % 2}", v)) for v in range(1, 21)])
    with capture_logs() as logs:
        run = start(kafka_config, unique, topic)
        try:
            wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 2) == {0: 10, 1: 10}, "first 20")
            watch = run.runner.group_watch = _WedgeOnce(60.0, 6.0)
            for _ in range(20):  # a statistics report in between may call the group steady again: inject anew
                watch.fire, watch.unsteady_since = True, time.monotonic()
                time.sleep(0.5)
                if run.runner.counts["rejoins"]:
                    break
            assert run.runner.counts["rejoins"] == 1
            produce(kafka_config, topic, [(v % 2, *valid(f"a{v % 2}", v)) for v in range(21, 41)])
            wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 2) == {0: 20, 1: 20},
                     "the events after the rejoin")
        finally:
            finish(run)
    assert run.runner.error is None and run.runner.counts["assignments"] >= 2
    assert sorted({(r.partition, r.offset) for r in run.connector.received}) == [
        (p, o) for p in (0, 1) for o in range(20)]
    rejoined = [e for e in logs if e["event"] == "runner.group_rejoining"]
    assert len(rejoined) == 1 and rejoined[0]["group"] == run.runner.group_id


def test_a_task_stuck_in_put_is_logged_with_its_stack(kafka_config: KafkaConfig, unique: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "POLL_STALL_WARN_S", 0.5)
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    produce(kafka_config, topic, [(0, *valid("a", v)) for v in range(1, 4)])
    settings = ConnectorConfig(name=unique, connector_class=RECORDING, topics=[topic],
                               config={"put_delay_s": 4.0})
    connector = registry.instantiate(settings, Path("."))
    daemon = DaemonConfig(group_prefix="kt", batch_max_records=10, batch_max_wait_ms=100, shutdown_grace_s=5)
    slot = tasks.TaskSlot(connector, connector.task_configs(1)[0], kafka_config, daemon)
    assert not slot.check_polling()  # not started
    with capture_logs() as logs:
        def stalls() -> list[dict[str, Any]]:
            return [e for e in logs if e["event"] == "task.not_polling"]

        def stalled_in_put() -> bool:
            # On a loaded machine the loop may also be seen stalled elsewhere first (a slow ListOffsets call):
            # each such sighting is logged too; wait for the one in `put`.
            slot.check_polling()
            return any("in put" in e["stack"] for e in stalls())

        slot.start()
        try:
            wait_for(stalled_in_put, "the stall in put to be seen", timeout=30)
            seen = len(stalls())
            slot.check_polling()  # within the period: not logged again
            assert len(stalls()) == seen
        finally:
            slot.stop()
            assert slot.join(30)
    assert all(e["task"] == f"{unique}[0]" for e in stalls())
    in_put = next(e for e in stalls() if "in put" in e["stack"])
    assert "time.sleep" in in_put["stack"]
