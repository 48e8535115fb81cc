"""The idempotency window: the outcome of every command id decided per aggregate, kept by command time.

A command's time is the timestamp of its record on the commands topic (the client's CreateTime, or the broker's
LogAppendTime when the topic says so). It is written into its events (`occurred_at`) and its result (`at`), so a
replay, a snapshot and the live runtime all know the same time for the same command id, whatever the host's
clock says when they run. An id decided at time t absorbs a retry whose own time r satisfies r - t <= window.

Ids are forgotten oldest first: once they are older than the window measured back from the latest command time
this runtime has seen (`high`), or, earlier, when more than `max_ids` are held (memory is bounded; each such early
drop is counted and logged). The outcomes live in their aggregate's `Entry.recent`, with the hashes of the event
ids they wrote in `Entry.events` (the last line of defence); this class keeps the order in which they expire
across all aggregates of a runtime.

Memory: an accepted outcome is one int (time, version after, events written, packed), a rejection a tuple; the
expiry order is three deques of references rather than a tuple per id (docs/benchmarks.md has the bytes per id).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kafold import logs
from kafold.decision import event_ids

log = logs.get(__name__)

# What the window remembers of a command: an acceptance packed in one int, t << 64 | version after << 20 | events;
# a rejection (or an acceptance too large to pack) is (t, version, events, reason).
Remembered = int | tuple[int, int, int, str | None]
_EVENTS_BITS, _VERSION_BITS = 20, 44
_EVENTS_MASK, _VERSION_MASK = (1 << _EVENTS_BITS) - 1, (1 << _VERSION_BITS) - 1


def accepted(t: int, version_after: int, events: int) -> Remembered:
    if 0 <= events <= _EVENTS_MASK and 0 <= version_after <= _VERSION_MASK and t >= 0:
        return t << 64 | version_after << _EVENTS_BITS | events
    return (t, version_after, events, None)


def rejected(t: int, version: int, reason: str) -> Remembered:
    return (t, version, 0, reason)


def unpack(outcome: Remembered) -> tuple[int, int, int, str | None]:
    """(command time ms, version after (a rejection: the version it was rejected at), events written, rejection
    reason or None for an acceptance)."""
    if type(outcome) is int:
        return outcome >> 64, outcome >> _EVENTS_BITS & _VERSION_MASK, outcome & _EVENTS_MASK, None
    return outcome  # type: ignore[return-value]


def time_of(outcome: Remembered) -> int:
    return outcome >> 64 if type(outcome) is int else outcome[0]  # type: ignore[index]


class Window:
    """Expiry order of the ids held by the entries of one StateStore (see the module docstring)."""

    def __init__(self, window_ms: int, max_ids: int) -> None:
        self.window_ms = window_ms
        self.max_ids = max_ids
        # the expiry order, in insertion order: command time, aggregate id, command id (three deques: no tuple)
        self.times: deque[int] = deque()
        self.aggregates: deque[str] = deque()
        self.commands: deque[str] = deque()
        self.high = 0
        self.expired = 0
        self.dropped_early = 0
        self.on_disk = False  # a local state store keeps every outcome for the window: an early drop loses nothing
        # With a local state store: handed the outcomes dropped early, (partition, aggregate id, command id, outcome),
        # so those not on disk yet (a recovering partition's: written at its seal otherwise) are written first
        # (LocalStates.keep)
        self.keep: Callable[[list[tuple[int, str, str, Remembered]]], None] | None = None

    def remember(self, entry: Any, aggregate_id: str, command_id: str, outcome: Remembered,
                 written: Sequence[str] = ()) -> None:
        """Record the outcome of `command_id` on `entry`, with the ids of the events it wrote (a later record of
        the same id replaces it)."""
        if command_id in entry.recent:
            self.forget(entry, command_id)
        entry.recent[command_id] = outcome
        for eid in written:
            entry.events[hash(eid)] = command_id
        t = time_of(outcome)
        self.times.append(t)
        self.aggregates.append(aggregate_id)
        self.commands.append(command_id)
        if t > self.high:
            self.high = t

    def add_event(self, entry: Any, aggregate_id: str, command_id: str, t: int, version: int,
                  event_id: str) -> None:
        """A replayed event: extend its command's accepted outcome (or start it); idempotent per event id."""
        seen = entry.recent.get(command_id)
        if seen is None and 0 <= version <= _VERSION_MASK and t >= 0:  # the replay's common case, inlined
            entry.recent[command_id] = t << 64 | version << _EVENTS_BITS | 1
            entry.events[hash(event_id)] = command_id
            self.times.append(t)
            self.aggregates.append(aggregate_id)
            self.commands.append(command_id)
            if t > self.high:
                self.high = t
            return
        h = hash(event_id)
        if entry.events.get(h) == command_id:
            return
        if seen is None or type(seen) is not int:
            self.remember(entry, aggregate_id, command_id, accepted(t, version, 1), (event_id,))
            return
        t0, after, n, _ = unpack(seen)
        entry.recent[command_id] = accepted(t0, max(after, version), n + 1)
        entry.events[h] = command_id

    def forget(self, entry: Any, command_id: str) -> None:
        """Take an outcome back out (expired, or recorded in a batch whose transaction aborted)."""
        outcome = entry.recent.pop(command_id, None)
        if outcome is None:
            return
        _, after, n, reason = unpack(outcome)
        if reason is None and n:
            events = entry.events
            for eid in event_ids(command_id, after - n, n):
                if events.get(hash(eid)) == command_id:
                    del events[hash(eid)]

    def expire(self, entries: Mapping[str, Any]) -> int:
        """Drop ids past the window (and beyond `max_ids`); entries evicted meanwhile are skipped."""
        times, aggs, cmds = self.times, self.aggregates, self.commands
        cutoff, n, early = self.high - self.window_ms, 0, 0
        kept: list[tuple[int, str, str, Remembered]] = []
        while times and (times[0] < cutoff or len(times) > self.max_ids):
            t, aid, cid = times.popleft(), aggs.popleft(), cmds.popleft()
            entry = entries.get(aid)
            if entry is None:
                continue
            outcome = entry.recent.get(cid)
            if outcome is None or time_of(outcome) != t:
                continue
            self.forget(entry, cid)
            if not entry.recent:
                entry.events.clear()  # ids of events written by others than this window's commands go too
            n += 1
            if t >= cutoff:
                early += 1
                if self.keep is not None:
                    kept.append((entry.partition, aid, cid, outcome))
        if kept:
            assert self.keep is not None
            self.keep(kept)
        self.expired += n - early
        if early:
            if self.dropped_early == 0 or (self.dropped_early + early) // 100_000 > self.dropped_early // 100_000:
                if self.on_disk:
                    log.info("aggregate.idempotency_window_memory_full", max_ids=self.max_ids,
                             dropped_early_total=self.dropped_early + early,
                             hint="older ids are read back from the local state store when retried")
                else:
                    log.warning("aggregate.idempotency_window_full", max_ids=self.max_ids,
                                dropped_early_total=self.dropped_early + early,
                                hint="raise idempotency_max_ids or shorten idempotency_window_s")
            self.dropped_early += early
        return n

    def held(self, entries: Mapping[str, Any]) -> int:
        return sum(len(e.recent) for e in entries.values())
