"""The executor across a revocation while a key's effect is running (real ledger in PostgreSQL).

A partition revoked and assigned again while an attempt is in flight must not let the attempt's drain pop a *new*
event off the key's queue: that event would never run nor complete, its offset would hold the partition's commits
back for good and, with the in-flight limit reached, fetching would stay paused.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from kafold.config import PostgresConfig
from kafold.connectors.api import SinkRecord, TopicPartition
from kafold.connectors.effects.drivers import Effect
from kafold.connectors.effects.executor import Executor
from kafold.connectors.effects.ledger import Ledger
from kafold.connectors.effects.policy import RetryPolicy
from kafold.connectors.effects.tracker import OffsetTracker
from kafold.envelope import Event

pytestmark = pytest.mark.integration


class GatedEffect(Effect):
    """Records the events it runs; the first run waits until `release()`."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.first_started = threading.Event()
        self._gate: asyncio.Event | None = None

    async def run(self, event: Event) -> None:
        self.runs.append(event.event_id)
        if len(self.runs) == 1:
            self._gate = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self.first_started.set()
            await self._gate.wait()

    def release(self) -> None:
        assert self._gate is not None
        self._loop.call_soon_threadsafe(self._gate.set)


def _record(tp: TopicPartition, offset: int, key: str, event: Event) -> SinkRecord:
    return SinkRecord(tp.topic, tp.partition, offset, key, event)


def test_events_queued_again_after_a_revocation_mid_attempt_all_run_in_order(effects_pg: PostgresConfig) -> None:
    name = f"revoke-{uuid.uuid4().hex[:6]}"
    tracker, effect = OffsetTracker(), GatedEffect()
    ledger = Ledger(effects_pg, name, None, 0.05)
    executor = Executor(name, effect, RetryPolicy(5, 60.0, 0.01, 0.05), ledger, tracker, concurrency=4,
                        request_poll_s=3600, on_progress=lambda: None)
    executor.start()
    tp = TopicPartition("orders", 0)
    first = Event.new("ItemSet", "item", "k", 1, {"value": 1})
    second = Event.new("ItemSet", "item", "k", 2, {"value": 2})
    try:
        executor.open([tp], [])
        tracker.add(tp, 0)
        executor.submit([_record(tp, 0, "k", first)])
        assert effect.first_started.wait(10)
        executor.close([tp])      # revoked while the key's first event runs
        executor.open([tp], [])   # assigned again: the new owner re-reads from the last commit
        tracker.add(tp, 0)
        tracker.add(tp, 1)
        executor.submit([_record(tp, 0, "k", first), _record(tp, 1, "k", second)])
        time.sleep(0.3)           # the re-read events reach the key's queue behind the running attempt
        effect.release()
        deadline = time.monotonic() + 10
        while tracker.first_incomplete(tp) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tracker.first_incomplete(tp) is None, "an event of the new assignment never completed"
        # the revoked attempt, then the re-read events in order: nothing skipped, per-key order kept
        assert effect.runs == [first.event_id, first.event_id, second.event_id]
    finally:
        executor.stop()
        ledger.close()
