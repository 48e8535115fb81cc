"""The idempotency window: the outcome of every command id decided per aggregate, kept by command time.

A command's time is the timestamp of its record on the commands topic (the client's CreateTime, or the broker's
LogAppendTime when the topic says so). It is written into its events (`occurred_at`) and its result (`at`), so a
replay, a snapshot and the live runtime all know the same time for the same command id, whatever the host's
clock says when they run. An id decided at time t absorbs a retry whose own time r satisfies r - t <= window.

Ids are forgotten oldest first: once they are older than the window measured back from the latest command time
this runtime has seen (`high`), or, earlier, when more than `max_ids` are held (memory is bounded; each such early
drop is counted and logged). The outcomes live in their aggregate's `Entry.recent`; this class keeps the order in
which they expire across all aggregates of a runtime.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, NamedTuple

from kafold import logs

log = logs.get(__name__)

class Outcome(NamedTuple):
    """What a command id got: its command time (ms), the version after it (rejected: the version it was rejected
    at), the events it wrote, the rejection reason (None: accepted) and the hashes of its event ids."""

    t: int
    version: int
    events: int
    reason: str | None
    hashes: tuple[int, ...]


def accepted(t: int, version_after: int, event_ids: tuple[str, ...] | list[str]) -> Outcome:
    return Outcome(t, version_after, len(event_ids), None, tuple(hash(e) for e in event_ids))


def rejected(t: int, version: int, reason: str) -> Outcome:
    return Outcome(t, version, 0, reason, ())


class Window:
    """Expiry order of the ids held by the entries of one StateStore (see the module docstring)."""

    def __init__(self, window_ms: int, max_ids: int) -> None:
        self.window_ms = window_ms
        self.max_ids = max_ids
        self.order: deque[tuple[int, str, str]] = deque()  # (t, aggregate id, command id), in insertion order
        self.high = 0
        self.expired = 0
        self.dropped_early = 0

    def fresh(self, outcome: Outcome, t: int) -> bool:
        """Whether `outcome` still absorbs a retry at command time `t`."""
        return t - outcome.t <= self.window_ms

    def remember(self, entry: Any, aggregate_id: str, command_id: str, outcome: Outcome) -> None:
        """Record the outcome of `command_id` on `entry` (a later record of the same id replaces it)."""
        if command_id in entry.recent:
            self.forget(entry, command_id)
        entry.recent[command_id] = outcome
        for h in outcome.hashes:
            entry.events[h] = command_id
        self.order.append((outcome.t, aggregate_id, command_id))
        if outcome.t > self.high:
            self.high = outcome.t

    def add_event(self, entry: Any, aggregate_id: str, command_id: str, t: int, version: int,
                  event_id: str) -> None:
        """A replayed event: extend its command's accepted outcome (or start it); idempotent per event id."""
        h = hash(event_id)
        seen = entry.recent.get(command_id)
        if seen is None or seen.reason is not None:
            self.remember(entry, aggregate_id, command_id, Outcome(t, version, 1, None, (h,)))
        elif h not in seen.hashes:
            entry.recent[command_id] = Outcome(seen.t, max(seen.version, version), seen.events + 1, None,
                                               (*seen.hashes, h))
            entry.events[h] = command_id

    def forget(self, entry: Any, command_id: str) -> None:
        """Take back an outcome recorded in a batch whose transaction aborted."""
        outcome = entry.recent.pop(command_id, None)
        if outcome is not None:
            for h in outcome.hashes:
                entry.events.pop(h, None)

    def expire(self, entries: Mapping[str, Any]) -> int:
        """Drop ids past the window (and beyond `max_ids`); entries evicted meanwhile are skipped."""
        order, cutoff, n = self.order, self.high - self.window_ms, 0
        early = 0
        while order and (order[0][0] < cutoff or len(order) > self.max_ids):
            t, aid, cid = order.popleft()
            entry = entries.get(aid)
            if entry is None:
                continue
            outcome = entry.recent.get(cid)
            if outcome is None or outcome.t != t:
                continue
            self.forget(entry, cid)
            n += 1
            if t >= cutoff:
                early += 1
        self.expired += n - early
        if early:
            if self.dropped_early == 0 or (self.dropped_early + early) // 100_000 > self.dropped_early // 100_000:
                log.warning("aggregate.idempotency_window_full", max_ids=self.max_ids,
                            dropped_early_total=self.dropped_early + early,
                            hint="raise idempotency_max_ids or shorten idempotency_window_s")
            self.dropped_early += early
        return n

    def held(self, entries: Mapping[str, Any]) -> int:
        return sum(len(e.recent) for e in entries.values())
