"""kafold.consumer_loop: the hooks' order, counts, fatal errors, failures and the one shutdown call, on a fake
consumer (pure logic: no broker)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError

from kafold.consumer_loop import SKIP_POLL, ConsumerLoop, LoopHandler, SkipPoll, raise_fatal
from kafold.errors import FatalError


class _Msg:
    def __init__(self, offset: int, error: KafkaError | None = None) -> None:
        self._offset, self._error = offset, error

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset


class _Consumer:
    """Hands out `batches` one poll at a time (then nothing); assigns partition 0 on the first poll."""

    def __init__(self, batches: list[list[_Msg]]) -> None:
        self.batches, self.polls, self.seeks, self.closed = batches, [], [], 0
        self.callbacks: dict[str, Any] = {}

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.callbacks = callbacks

    def consume(self, n: int, timeout: float) -> list[_Msg]:
        self.polls.append((n, timeout))
        if len(self.polls) == 1 and self.callbacks:
            self.callbacks["on_assign"](self, ["t[0]"])
        return self.batches.pop(0) if self.batches else []

    def seek(self, tp: Any) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def close(self) -> None:
        self.closed += 1


class _Handler(LoopHandler):
    def __init__(self, consumer: _Consumer, polls: int, *, handled: bool = True) -> None:
        self.stop = threading.Event()
        self.counts: dict[str, int] = {"batches": 0}
        self.loop = ConsumerLoop(self, stop=self.stop, max_records=10, wait_s=0.5, counts=self.counts,
                                 fatal=lambda err: f"test consumer: {err.str()}")
        self.consumer = consumer
        self.until, self.handled = polls, handled
        self.calls: list[str] = []
        self.failures: list[Exception] = []

    def loop_started(self) -> None:
        self.calls.append("started")
        self.loop.subscribe(["t"], lambda c, p: self.calls.append("assigned"), lambda c, p: None,
                            lambda c, p: None)

    def before_poll(self) -> float | None:
        self.calls.append("before")
        return 0.0 if len(self.calls) < 3 else None  # the first poll does not wait (as a recovering runtime)

    def handle_batch(self, msgs: list[Any]) -> None:
        self.calls.append(f"batch:{len(msgs)}")
        for m in msgs:
            if m.error() is not None:
                self.loop.consumer_error(m.error())
        self.counts["batches"] += 1

    def on_idle(self) -> None:
        self.calls.append("idle")

    def after_poll(self) -> None:
        self.calls.append("after")
        if self.counts["polls"] >= self.until:
            self.stop.set()

    def on_failure(self, error: Exception) -> bool:
        self.failures.append(error)
        return self.handled

    def loop_stopped(self) -> None:
        self.calls.append("stopped")


def test_the_loop_polls_with_the_handlers_wait_and_calls_each_hook_in_order() -> None:
    consumer = _Consumer([[_Msg(0), _Msg(1)]])
    h = _Handler(consumer, polls=2)
    h.loop.run()
    assert h.calls == ["started", "before", "assigned", "batch:2", "after", "before", "idle", "after", "stopped"]
    assert consumer.polls == [(10, 0.0), (10, 0.5)]
    assert h.counts == {"batches": 1, "polls": 2, "assignments": 1} and h.failures == []
    assert h.last_poll == h.loop.last_poll


def test_a_fatal_consumer_error_ends_the_run_through_on_failure_and_shutdown_is_called_once() -> None:
    fatal = KafkaError(KafkaError._FATAL, "fenced", fatal=True)
    consumer = _Consumer([[_Msg(0, KafkaError(KafkaError._TRANSPORT, "blip"))], [_Msg(1), _Msg(2, fatal)]])
    h = _Handler(consumer, polls=10)
    h.loop.run()
    assert [str(e) for e in h.failures] == ["test consumer: fenced"] and isinstance(h.failures[0], FatalError)
    assert h.calls.count("stopped") == 1 and h.calls[-1] == "stopped"
    assert h.counts["batches"] == 1  # the transient error was skipped; the fatal one ended its batch


def test_an_unhandled_failure_is_raised_from_run_after_the_shutdown() -> None:
    fatal = KafkaError(KafkaError._FATAL, "fenced", fatal=True)
    h = _Handler(_Consumer([[_Msg(0, fatal)]]), polls=10, handled=False)
    with pytest.raises(FatalError, match="fenced"):
        h.loop.run()
    assert h.calls[-1] == "stopped"


def test_raise_fatal_returns_for_a_transient_error() -> None:
    raise_fatal(KafkaError(KafkaError._TRANSPORT, "blip"), str)
    with pytest.raises(FatalError):
        raise_fatal(KafkaError(KafkaError._FATAL, "x", fatal=True), str)


def test_a_back_off_serves_the_consumer_and_seeks_back_to_what_it_fetched() -> None:
    consumer = _Consumer([[_Msg(7)], [_Msg(8, KafkaError(KafkaError._TRANSPORT, "blip"))]])
    h = _Handler(consumer, polls=1)
    h.loop.back_off(0.05)
    assert consumer.seeks == [("t", 0, 7)] and all(timeout <= 0.05 for _, timeout in consumer.polls)


def test_resubscribe_closes_the_old_consumer_and_subscribes_a_new_one_the_same_way() -> None:
    old, new = _Consumer([]), _Consumer([])
    h = _Handler(old, polls=1)
    h.loop_started()
    h.loop.resubscribe(lambda: new, lambda e: None)
    assert old.closed == 1 and h.consumer is new and set(new.callbacks) == {"on_assign", "on_revoke", "on_lost"}


class _Assigning(_Handler):
    """A handler without a group (as the rebuild's catch-up): it holds read-ahead records, skips the poll when they
    are its batch, and finishes the run itself once it has taken `records` records."""

    def __init__(self, consumer: _Consumer, records: int, polls: int = 100) -> None:
        super().__init__(consumer, polls, handled=False)
        self.records, self.held, self.taken, self.runs = records, [_Msg(0)], 0, 0

    def loop_started(self) -> None:
        self.runs += 1
        self.calls.append("started")

    def before_poll(self) -> float | SkipPoll | None:
        if self.taken >= self.records:
            self.calls.append("finish")
            self.loop.finish()
            return None  # not polled: the run ends as the hook returns
        return SKIP_POLL if self.held else None

    def handle_batch(self, msgs: list[Any]) -> None:
        batch, self.held = self.held + msgs, []
        self.calls.append(f"batch:{len(batch)}")
        self.taken += len(batch)


def test_a_skipped_poll_hands_the_handler_an_empty_batch_and_is_not_counted() -> None:
    consumer = _Consumer([[_Msg(1), _Msg(2)]])
    h = _Assigning(consumer, records=3)
    h.loop.run()
    assert h.calls == ["started", "batch:1", "after", "batch:2", "after", "finish", "stopped"]
    assert len(consumer.polls) == 1 and h.counts["polls"] == 1  # the read-ahead's round consumed nothing


def test_a_run_finished_by_its_handler_leaves_stop_unset_and_the_loop_runs_again_over_the_same_consumer() -> None:
    consumer = _Consumer([[_Msg(1)], [_Msg(2)]])
    h = _Assigning(consumer, records=2)
    h.loop.run()
    assert not h.stop.is_set() and h.taken == 2
    h.records = 3
    h.loop.run()  # a finished run does not end the next one
    assert h.runs == 2 and h.taken == 3 and h.consumer is consumer and h.failures == []
    assert h.calls == ["started", "batch:1", "after", "batch:1", "after", "finish", "stopped",
                       "started", "batch:1", "after", "finish", "stopped"]


def test_stop_ends_a_run_the_handler_has_not_finished() -> None:
    h = _Assigning(_Consumer([]), records=100, polls=2)
    h.held = []
    h.loop.run()
    assert h.counts["polls"] == 2 and h.calls == ["started", "idle", "after", "idle", "after", "stopped"]
