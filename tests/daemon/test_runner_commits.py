"""The sink runner's handling of an asynchronous commit's answer (built, never run: no broker is reached)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError
from confluent_kafka import TopicPartition as KafkaTP

from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig
from kafold.connectors import registry
from kafold.connectors.api import SinkTask, TopicPartition
from kafold.daemon.commits import CAUGHT_UP_POLL_S, CAUGHT_UP_WINDOW_S, InFlight, Offered
from kafold.daemon.runner import SinkRunner
from tests.daemon.test_runner import RECORDING

A, B = TopicPartition("t", 0), TopicPartition("t", 1)


def runner_in_flight(offsets: dict[TopicPartition, int]) -> SinkRunner:
    settings = ConnectorConfig(name="commits", connector_class=RECORDING, topics=["t"], config={})
    connector = registry.instantiate(settings, Path("."))
    runner = SinkRunner(connector, connector.task_configs(1)[0], kafka=KafkaConfig(bootstrap_servers="127.0.0.1:1"),
                        daemon=DaemonConfig(group_prefix="kt"))
    runner.commits.in_flight = InFlight(dict(offsets), time.monotonic())
    return runner


def answer(offsets: dict[TopicPartition, int]) -> list[KafkaTP]:
    return [KafkaTP(tp.topic, tp.partition, off) for tp, off in offsets.items()]


def test_a_confirmed_commit_is_what_counts_as_committed() -> None:
    runner = runner_in_flight({A: 5, B: 7})
    runner._on_commit(None, answer({A: 5, B: 7}))
    assert runner.commits.committed == {A: 5, B: 7} and runner.commits.in_flight is None and not runner.dirty


def test_a_refused_commit_leaves_committed_and_is_offered_again() -> None:
    runner = runner_in_flight({A: 5})
    runner.commits.committed = {A: 2}
    runner._on_commit(KafkaError(KafkaError.REBALANCE_IN_PROGRESS), answer({A: 5}))
    assert runner.commits.committed == {A: 2} and runner.commits.in_flight is None and runner.dirty


def test_an_error_answered_without_partitions_ends_the_commit_in_flight() -> None:
    runner = runner_in_flight({A: 5})
    runner._on_commit(KafkaError(KafkaError._WAIT_COORD), None)  # type: ignore[arg-type]
    assert runner.commits.committed == {} and runner.commits.in_flight is None and runner.dirty


def test_the_late_answer_of_a_commit_given_up_is_ignored() -> None:
    runner = runner_in_flight({A: 9})  # sent after an earlier commit of offset 5 was given up
    runner._on_commit(None, answer({A: 5}))
    commits = runner.commits
    assert commits.committed == {} and commits.in_flight is not None and commits.in_flight.offsets == {A: 9}


def test_a_flush_while_a_commit_is_in_flight_is_put_off_not_dropped() -> None:
    runner = runner_in_flight({A: 5})
    runner.assigned, runner.positions, runner.dirty = {A}, {A: 8}, True
    runner.context.commit_requested = True
    flush_at = runner.commits.next_flush
    assert runner._commit({A}) == {}
    # nothing was offered to the task, and the request and the timer are left for the flush after the answer
    assert runner.context.commit_requested and runner.dirty and runner.commits.next_flush == flush_at


class StoringTask(SinkTask):
    """A task that stores its own offsets (as the projection does), with nothing stored yet: its pre_commit returns
    no offset, and it remembers what it was offered."""

    stores_offsets = True

    def __init__(self) -> None:
        self.offered: list[dict[TopicPartition, int]] = []

    def start(self, task_config: Any, context: Any) -> None:
        pass

    def put(self, records: Any) -> None:
        pass

    def stop(self) -> None:
        pass

    def pre_commit(self, offsets: Any) -> dict[TopicPartition, int]:
        self.offered.append(dict(offsets))
        return {}


def storing_runner() -> tuple[SinkRunner, StoringTask]:
    runner = runner_in_flight({})
    runner.commits.in_flight = None
    task = StoringTask()
    runner.task = task
    runner.assigned, runner.positions, runner.dirty = {A}, {A: 8}, True
    return runner, task


def test_a_store_with_nothing_new_is_asked_again_at_the_next_batch_not_an_interval_later() -> None:
    runner, task = storing_runner()
    offer = Offered(runner.positions, runner.assigned, True, False)
    assert runner.commits.commit(None, task, offer, {A}) == ({}, False)  # no consumer call: nothing to send
    assert task.offered == [{A: 8}] and runner.commits.due()  # the interval starts from a commit sent


def test_a_store_caught_up_is_offered_its_offsets_at_once_then_on_the_timer_again() -> None:
    runner, task = storing_runner()
    runner.commits.next_flush = time.monotonic() + 60  # the timer is far off
    runner.on_idle()  # the first idle poll since the last batch: caught up
    assert task.offered == [{A: 8}]
    assert runner.dirty and runner.before_poll() == CAUGHT_UP_POLL_S  # not all stored yet: asked again shortly
    # idle for the whole window: a store still failing is left to the timer
    runner.commits.caught_up_at = time.monotonic() - CAUGHT_UP_WINDOW_S
    runner.on_idle()
    assert task.offered == [{A: 8}] and runner.before_poll() is None
