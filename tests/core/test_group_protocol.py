"""[kafka] group_protocol: which librdkafka keys each protocol sends, the commit errors retried, and (on a real
broker) the consumer protocol's incremental assignment through kafold's own rebalance helpers and an idle member
as the stuck-join guard sees it."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTP

from kafold import config, kafka_clients
from kafold.config import GroupProtocol, KafkaConfig
from kafold.errors import ConfigError
from kafold.testing import create_topic

CONSUMER = KafkaConfig(bootstrap_servers="b:9092", group_protocol=GroupProtocol.CONSUMER)


def test_classic_is_the_default_and_sends_the_group_timeouts() -> None:
    kafka = KafkaConfig(bootstrap_servers="b:9092", session_timeout_ms=6000, heartbeat_interval_ms=1000,
                        rebalance_timeout_ms=7000)
    assert kafka.group_protocol is GroupProtocol.CLASSIC
    assert kafka_clients.group_settings(kafka) == {
        "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000, "max.poll.interval.ms": 7000}


def test_the_consumer_protocol_leaves_out_what_librdkafka_refuses_with_it() -> None:
    kafka = dataclasses.replace(CONSUMER, session_timeout_ms=6000, heartbeat_interval_ms=1000,
                                rebalance_timeout_ms=7000)
    assert kafka_clients.group_settings(kafka) == {"group.protocol": "consumer", "max.poll.interval.ms": 7000}
    conf = kafka_clients.librdkafka(kafka, **{"group.id": "g", **kafka_clients.group_settings(kafka)})
    assert not kafka_clients.CLASSIC_ONLY & set(conf)


def test_the_remote_assignor_is_sent_when_set() -> None:
    kafka = dataclasses.replace(CONSUMER, group_remote_assignor="range")
    assert kafka_clients.group_settings(kafka)["group.remote.assignor"] == "range"


@pytest.mark.parametrize("key,value", [("session.timeout.ms", 6000), ("heartbeat.interval.ms", 1000),
                                       ("partition.assignment.strategy", "range"),
                                       ("group.protocol.type", "consumer")])
def test_librdkafka_refuses_each_classic_only_key_with_the_consumer_protocol(key: str, value: Any) -> None:
    """Why CLASSIC_ONLY holds what it holds: librdkafka refuses to create such a consumer."""
    assert key in kafka_clients.CLASSIC_ONLY
    with pytest.raises(KafkaException, match=r"not supported for `group\.protocol=consumer`"):
        Consumer({"bootstrap.servers": "b:9092", "group.id": "g", "group.protocol": "consumer", key: value})


@pytest.mark.parametrize("protocol", list(GroupProtocol))
def test_librdkafka_accepts_kafolds_consumer_settings_in_either_protocol(protocol: GroupProtocol) -> None:
    kafka = dataclasses.replace(CONSUMER, group_protocol=protocol,
                                group_remote_assignor="uniform" if protocol is GroupProtocol.CONSUMER else None)
    kafka_clients.consumer(kafka, "g", **{"isolation.level": "read_committed"}).close()


def test_the_toml_setting_and_its_environment_override(tmp_path: Path) -> None:
    path = tmp_path / "kafold.toml"
    loaded = config.parse('[kafka]\ngroup_protocol = "consumer"\ngroup_remote_assignor = "uniform"\n', path, {})
    assert loaded.config.kafka.group_protocol is GroupProtocol.CONSUMER
    env = {"KAFOLD_KAFKA__GROUP_PROTOCOL": "consumer"}
    assert config.parse("", path, env).config.kafka.group_protocol is GroupProtocol.CONSUMER
    assert config.parse("", path, {}).config.kafka.group_protocol is GroupProtocol.CLASSIC


@pytest.mark.parametrize("text,key,says", [
    ('[kafka]\ngroup_protocol = "cooperative"\n', "kafka.group_protocol", "consumer"),
    ('[kafka]\ngroup_remote_assignor = "uniform"\n', "kafka.group_remote_assignor", "consumer"),
    ('[kafka]\ngroup_protocol = "consumer"\ngroup_remote_assignor = "sticky"\n', "kafka.group_remote_assignor",
     "uniform"),
])
def test_a_bad_group_protocol_setting_is_named(text: str, key: str, says: str, tmp_path: Path) -> None:
    path = tmp_path / "kafold.toml"
    with pytest.raises(ConfigError) as info:
        config.parse(text, path, {})
    assert any(p.startswith(f"{path}: {key}") and says in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("code,retried", [
    (KafkaError.STALE_MEMBER_EPOCH, True), (KafkaError.UNKNOWN_MEMBER_ID, True), (KafkaError.NOT_COORDINATOR, False),
    (KafkaError._TRANSPORT, False), (KafkaError.ILLEGAL_GENERATION, False),
    (KafkaError.GROUP_AUTHORIZATION_FAILED, False), (KafkaError.OFFSET_METADATA_TOO_LARGE, False)])
def test_commit_errors_retried_at_once_are_the_moving_member_epoch_only(code: int, retried: bool) -> None:
    assert kafka_clients.commit_retriable(KafkaError(code)) is retried


def test_the_member_epoch_codes_stay_out_of_coordinator_changing() -> None:
    """Other group requests (the test helpers', the bench's) do not wait out a member epoch: only commits do."""
    assert not kafka_clients.coordinator_changing(KafkaError(KafkaError.STALE_MEMBER_EPOCH))


class _Committer:
    """Answers commits with the given errors, then succeeds; records every offsets list it was sent."""

    def __init__(self, *errors: int) -> None:
        self.errors = list(errors)
        self.sent: list[list[Any]] = []

    def commit(self, offsets: list[Any], asynchronous: bool) -> None:
        assert asynchronous is False
        self.sent.append(offsets)
        if self.errors:
            raise KafkaException(KafkaError(self.errors.pop(0)))


def test_a_commit_met_by_a_stale_member_epoch_is_sent_again_with_the_same_offsets() -> None:
    made = _Committer(KafkaError.STALE_MEMBER_EPOCH, KafkaError.UNKNOWN_MEMBER_ID)
    offsets = [KafkaTP("t", 0, 42)]
    kafka_clients.commit(made, offsets)  # type: ignore[arg-type]
    assert made.sent == [offsets] * 3


def test_a_commit_refused_for_good_is_raised_at_once() -> None:
    made = _Committer(KafkaError.ILLEGAL_GENERATION)
    with pytest.raises(KafkaException):
        kafka_clients.commit(made, [KafkaTP("t", 0, 1)])  # type: ignore[arg-type]
    assert len(made.sent) == 1


def test_a_stale_epoch_that_outlasts_the_budget_is_raised() -> None:
    made = _Committer(*[KafkaError.STALE_MEMBER_EPOCH] * 100)
    with pytest.raises(KafkaException):
        kafka_clients.commit(made, [KafkaTP("t", 0, 1)], within_s=0.3)  # type: ignore[arg-type]
    assert 2 <= len(made.sent) < 100


# ---- on Apache Kafka ----------------------------------------------------------------------------------------
class _Member:
    """A group member whose callbacks do what the sink runner's and the aggregate runtime's do: assign through
    `rebalance_assign`, leave the unassign to confluent-kafka, commit through `kafka_clients.commit`."""

    def __init__(self, kafka: KafkaConfig, group: str, topic: str) -> None:
        self.kafka = kafka
        self.held: set[int] = set()
        self.revoked: list[set[int]] = []
        self.assigned: list[set[int]] = []
        self.consumer = kafka_clients.consumer(kafka, group)
        self.consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_revoke)

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        kafka_clients.rebalance_assign(self.kafka, consumer, partitions)
        self.assigned.append({p.partition for p in partitions})
        self.held |= {p.partition for p in partitions}

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        gone = {p.partition for p in partitions}
        if gone:  # as the runner does on a revoke: commit what it handled of them, while it still owns them
            kafka_clients.commit(consumer, [KafkaTP(p.topic, p.partition, 1) for p in partitions])
        self.revoked.append(gone)
        self.held -= gone

    def poll(self) -> None:
        self.consumer.consume(100, 0.2)


def _until(members: list[_Member], done: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, [m.held for m in members]
        for m in members:
            m.poll()


@pytest.mark.parametrize("protocol", list(GroupProtocol))
def test_a_second_member_takes_half_and_the_first_keeps_the_rest(protocol: GroupProtocol,
                                                                  kafka_config: KafkaConfig, broker_kind: str,
                                                                  unique: str) -> None:
    """With either protocol the callbacks' assign goes through; with the consumer protocol the first member gives
    up only the partitions that move (no stop-the-world revoke of all four), and commits on its revoke succeed."""
    if broker_kind != "kafka":
        pytest.skip("two members in one group: tansu stalls such a rebalance (docs/brokers.md), and the consumer "
                    "group protocol (KIP-848) needs Apache Kafka 4.0+ (KAFOLD_TEST_BROKER=kafka)")
    kafka = dataclasses.replace(kafka_config, group_protocol=protocol)
    topic = f"{unique}.t"
    create_topic(kafka, topic, partitions=4)
    producer = kafka_clients.producer(kafka)
    for n in range(4):  # a record in each partition: the offset 1 committed on a revoke is a real one
        kafka_clients.produce(producer, topic, b"x", partition=n)
    assert kafka_clients.close_producer(producer, 10) == 0
    first = _Member(kafka, f"{unique}.g", topic)
    try:
        _until([first], lambda: first.held == {0, 1, 2, 3})
        second = _Member(kafka, f"{unique}.g", topic)
        try:
            _until([first, second], lambda: len(first.held) == 2 and len(second.held) == 2
                   and not first.held & second.held)
            committed = first.consumer.committed([KafkaTP(topic, p) for p in range(4)], timeout=10)
            on_revoke = {tp.partition for tp in committed if tp.offset == 1}  # by the member still owning them
            if protocol is GroupProtocol.CONSUMER:
                assert set().union(*first.revoked) == on_revoke == second.held  # only what moved was revoked
                assert [got for got in first.assigned if got] == [{0, 1, 2, 3}]  # an empty one follows a revoke
            else:
                assert {0, 1, 2, 3} in first.revoked  # eager: everything revoked, the rest assigned again
                assert on_revoke == {0, 1, 2, 3}
        finally:
            second.consumer.close()
    finally:
        first.consumer.close()


@pytest.mark.parametrize("protocol", list(GroupProtocol))
def test_a_member_assigned_nothing_is_steady_for_the_stuck_join_guard(protocol: GroupProtocol,
                                                                      kafka_config: KafkaConfig, broker_kind: str,
                                                                      unique: str) -> None:
    """Two members, one partition: the idle one must not look like a pending join to the sink runner's GroupWatch
    (it would leave and join again, over and over). The consumer protocol shows it in join state "init"."""
    if broker_kind != "kafka":
        pytest.skip("two members in one group: tansu stalls such a rebalance (docs/brokers.md), and the consumer "
                    "group protocol (KIP-848) needs Apache Kafka 4.0+ (KAFOLD_TEST_BROKER=kafka)")
    from kafold.daemon.liveness import GroupState, GroupWatch

    kafka = dataclasses.replace(kafka_config, group_protocol=protocol)
    topic = f"{unique}.t"
    create_topic(kafka, topic, partitions=1)
    watches = {n: GroupWatch.for_kafka(kafka) for n in (0, 1)}

    def feed(n: int) -> Any:
        def on_stats(stats: str) -> None:
            if (state := GroupState.from_stats(stats)) is not None:
                watches[n].update(state)
        return on_stats

    members = [kafka_clients.consumer(kafka, f"{unique}.g", **{"statistics.interval.ms": 500, "stats_cb": feed(n)})
               for n in (0, 1)]
    try:
        for n, m in enumerate(members):
            watches[n].reset()
            m.subscribe([topic], on_assign=lambda c, ps: kafka_clients.rebalance_assign(kafka, c, ps))
        deadline = time.monotonic() + 60
        # A report is up to 500 ms old: the first member's last one may still show the partition it held (steady)
        # before the second joined, so wait until each watch's report agrees with its member's assignment.
        while not (all(w.current is not None and w.pending_s() == 0
                       and w.current.assignment_size == len(members[n].assignment()) for n, w in watches.items())
                   and sum(len(m.assignment()) for m in members) == 1):
            assert time.monotonic() < deadline, {n: w.fields() for n, w in watches.items()}
            for m in members:
                m.consume(10, 0.2)
        idle = next(n for n, m in enumerate(members) if not m.assignment())
        assert watches[idle].current is not None and watches[idle].current.assignment_size == 0
        assert not watches[idle].wedged(time.monotonic() + 3600)
    finally:
        for m in members:
            m.close()
