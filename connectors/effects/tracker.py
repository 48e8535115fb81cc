"""Per-partition commit tracking: the committable offset is the end of the contiguous completed prefix.

Note on offsets and commits
---------------------------
Every record handed to the executor is `add`ed (in offset order per partition) before `put` returns, and
`done` when its effect succeeded or it was durably parked. The offset offered to the runner's commit is
`min(offered, first incomplete offset)`: never past an event still in flight, waiting for a retry, or whose
parking is not yet durable. Offsets that never reach the tracker (dead-lettered or skipped records, transaction
markers) lie inside the offered position the runner computed after their batch, so they need no entry here.
"""

from __future__ import annotations

import threading
from collections import deque

from kafold.connectors.api import TopicPartition


class OffsetTracker:
    """Incomplete offsets per partition; thread-safe (put and pre_commit run on the runner thread, completions
    on the executor thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[TopicPartition, deque[int]] = {}
        self._done: dict[TopicPartition, set[int]] = {}
        self._count = 0

    def add(self, tp: TopicPartition, offset: int) -> None:
        with self._lock:
            self._pending.setdefault(tp, deque()).append(offset)
            self._done.setdefault(tp, set())
            self._count += 1

    def done(self, tp: TopicPartition, offset: int) -> bool:
        """Mark one offset complete; True when the partition's first incomplete offset moved."""
        with self._lock:
            pending = self._pending.get(tp)
            if not pending:
                return False  # the partition was dropped (revoked) meanwhile
            finished = self._done[tp]
            finished.add(offset)
            self._count -= 1
            moved = False
            while pending and pending[0] in finished:
                finished.discard(pending.popleft())
                moved = True
            return moved

    def first_incomplete(self, tp: TopicPartition) -> int | None:
        with self._lock:
            pending = self._pending.get(tp)
            return pending[0] if pending else None

    def committable(self, offered: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """For each offered partition: the offered position, held back to its first incomplete offset."""
        with self._lock:
            out = {}
            for tp, off in offered.items():
                pending = self._pending.get(tp)
                out[tp] = min(off, pending[0]) if pending else off
            return out

    def drop(self, tp: TopicPartition) -> None:
        with self._lock:
            pending = self._pending.pop(tp, None)
            finished = self._done.pop(tp, set())
            if pending:
                self._count -= len(pending) - len(finished)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._count
