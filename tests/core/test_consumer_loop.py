"""kafold.consumer_loop: the hooks' order, counts, fatal errors, failures and the one shutdown call, on a fake
consumer (pure logic: no broker)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError

from kafold.consumer_loop import IDLE_SLICE_S, SKIP_POLL, ConsumerLoop, LoopHandler, SkipPoll, raise_fatal, take
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
    """librdkafka's fetch queue, simplified: the first of `batches` is fetched already; each later one arrives while
    the caller waits (a poll, or a consume with a timeout). Every call is recorded in `polls`; partition 0 is
    assigned on the first."""

    def __init__(self, batches: list[list[_Msg]]) -> None:
        self.batches, self.polls, self.seeks, self.closed = batches, [], [], 0
        self.queued: list[_Msg] = self.batches.pop(0) if self.batches else []
        self.callbacks: dict[str, Any] = {}

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.callbacks = callbacks

    def _called(self, call: tuple[Any, ...]) -> None:
        self.polls.append(call)
        if len(self.polls) == 1 and self.callbacks:
            self.callbacks["on_assign"](self, ["t[0]"])

    def _arrive(self, timeout: float) -> None:
        if self.batches:
            self.queued += self.batches.pop(0)
        elif not self.queued:
            time.sleep(timeout)  # nothing comes: the wait runs out

    def consume(self, n: int, timeout: float) -> list[_Msg]:
        self._called(("consume", n, timeout))
        if timeout > 0 and not self.queued:
            self._arrive(timeout)
        taken, self.queued = self.queued[:n], self.queued[n:]
        return taken

    def poll(self, timeout: float) -> _Msg | None:
        self._called(("poll", timeout))
        if not self.queued:
            self._arrive(timeout)
        return self.queued.pop(0) if self.queued else None

    def seek(self, tp: Any) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def close(self) -> None:
        self.closed += 1


class _Handler(LoopHandler):
    def __init__(self, consumer: _Consumer, polls: int, *, handled: bool = True) -> None:
        self.stop = threading.Event()
        self.counts: dict[str, int] = {"batches": 0}
        self.loop = ConsumerLoop(self, stop=self.stop, max_records=10, wait_s=0.05, counts=self.counts,
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
    # the first poll holds what was fetched (no wait); the second waits (the default wait) and nothing comes
    assert consumer.polls[:2] == [("consume", 10, 0), ("consume", 10, 0)]
    assert {c[0] for c in consumer.polls[2:]} == {"poll"} and all(0 < c[1] <= 0.05 for c in consumer.polls[2:])
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
    assert consumer.seeks == [("t", 0, 7)] and all(timeout <= 0.05 for _, _, timeout in consumer.polls)


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
    assert consumer.polls == [("consume", 10, 0)] and h.counts["polls"] == 1  # the read-ahead's round: no poll


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


# ---- natural batching (`take`) ----------------------------------------------------------------------------------
def test_what_is_fetched_is_handed_over_at_once_without_waiting_for_the_batch_to_fill() -> None:
    consumer = _Consumer([[_Msg(1), _Msg(2), _Msg(3)], [_Msg(4)]])
    assert [m.offset() for m in take(consumer, 10, 60.0)] == [1, 2, 3]
    assert consumer.polls == [("consume", 10, 0)]  # no wait: the batch of 10 never filled and nobody waited for it


def test_a_batch_holds_at_most_max_records_and_the_rest_is_the_next_batch() -> None:
    consumer = _Consumer([[_Msg(i) for i in range(15)]])
    assert len(take(consumer, 10, 60.0)) == 10 and [m.offset() for m in take(consumer, 10, 60.0)] == list(
        range(10, 15))
    assert consumer.polls == [("consume", 10, 0), ("consume", 10, 0)]


def test_with_nothing_fetched_the_first_record_ends_the_wait_and_comes_with_what_arrived_alongside() -> None:
    consumer = _Consumer([[], [_Msg(5), _Msg(6), _Msg(7)]])
    assert [m.offset() for m in take(consumer, 10, 60.0)] == [5, 6, 7]
    assert consumer.polls == [("consume", 10, 0), ("poll", IDLE_SLICE_S), ("consume", 9, 0)]


def test_a_batch_of_one_is_never_drained_further() -> None:
    consumer = _Consumer([[], [_Msg(5), _Msg(6)]])
    assert [m.offset() for m in take(consumer, 1, 60.0)] == [5]
    assert consumer.polls == [("consume", 1, 0), ("poll", IDLE_SLICE_S)]


def test_an_idle_wait_is_served_in_slices_and_ends_empty() -> None:
    consumer, served = _Consumer([]), []
    assert take(consumer, 10, 0.05, waiting=lambda: served.append(1) is None) == []
    polls = consumer.polls[1:]
    assert polls and {c[0] for c in polls} == {"poll"} and all(0 < c[1] <= 0.05 for c in polls)
    assert len(served) == len(polls)  # asked before each slice (the loop keeps `last_poll` current there)


def test_an_idle_wait_ends_when_the_waiting_check_says_so() -> None:
    consumer, asked = _Consumer([]), []
    assert take(consumer, 10, 60.0, waiting=lambda: not asked.append(1) and len(asked) < 3) == []
    assert consumer.polls[1:] == [("poll", IDLE_SLICE_S), ("poll", IDLE_SLICE_S)] and len(asked) == 3


class _AssignedWhileWaiting(_Consumer):
    """The assignment comes inside the first poll that waits (a slice), not with the first look."""

    def _called(self, call: tuple[Any, ...]) -> None:
        self.polls.append(call)
        if call[0] == "poll" and self.callbacks and [c[0] for c in self.polls].count("poll") == 1:
            self.callbacks["on_assign"](self, ["t[0]"])


def test_a_rebalance_during_an_idle_wait_ends_it_so_the_handler_sees_the_assignment_at_once() -> None:
    consumer = _AssignedWhileWaiting([])
    h = _Handler(consumer, polls=2)
    h.loop.wait_s = 60.0  # without the rebalance, the second poll would wait a minute
    h.loop.run()
    assert h.calls == ["started", "before", "idle", "after", "before", "assigned", "idle", "after", "stopped"]
    # the first poll does not wait; the second's first slice brings the assignment, and no second slice follows
    assert consumer.polls == [("consume", 10, 0), ("consume", 10, 0), ("poll", IDLE_SLICE_S)]


def test_a_zero_wait_only_looks_at_what_is_fetched_and_a_stop_ends_the_wait() -> None:
    consumer = _Consumer([[], [_Msg(1)]])
    assert take(consumer, 10, 0.0) == [] and consumer.polls == [("consume", 10, 0)]
    stop = threading.Event()
    stop.set()
    assert take(consumer, 10, 60.0, stop) == [] and consumer.polls[1:] == [("consume", 10, 0)]
