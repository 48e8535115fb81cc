"""In-memory aggregate states: a bounded LRU over every assigned partition, with an evicted set for reloads, and
the idempotency window of their command ids (window.py). With a local state store (local.py) the LRU is its hot
cache: an evicted aggregate is read back from the store (`fetch`) instead of being reloaded from Kafka."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol

from kafold.daemon.aggregates.window import Remembered, Window


class Entry:
    """One aggregate's state, version and partition, the outcomes of its command ids within the idempotency
    window (`recent`: command id -> window.Remembered) and the hashes of the event ids they wrote -> command id."""

    __slots__ = ("events", "partition", "recent", "state", "version")
    covered = 0  # for the Folder: a runtime's tail starts where its base states end, so no event is covered by offset

    def __init__(self, state: Any, version: int, partition: int) -> None:
        self.state = state
        self.version = version
        self.partition = partition
        self.recent: dict[str, Remembered] = {}
        self.events: dict[int, str] = {}


class Backing(Protocol):
    """Where evicted entries are kept (local.LocalStates)."""

    def load(self, partition: int, aggregate_id: str) -> Entry | None: ...

    def spill(self, evicted: list[tuple[str, Entry]]) -> None: ...


class StateStore:
    """LRU of entries by aggregate id. `trim()` evicts the least recently used down to `max_aggregates` and
    remembers the evicted ids per partition: such an id must be reloaded from Kafka before use (a key that is
    neither cached nor evicted has no events yet). Every method takes the lock: `get_state` runs on other threads.
    """

    def __init__(self, max_aggregates: int, window: Window | None = None, backing: Backing | None = None) -> None:
        self.max_aggregates = max_aggregates
        self.backing = backing  # None: evicted ids are reloaded from Kafka (`evicted`)
        self.window = window or Window(24 * 3600 * 1000, 1_000_000)
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.evicted: dict[int, set[str]] = {}
        self.lock = threading.RLock()
        self.evictions = 0

    def get(self, aggregate_id: str) -> Entry | None:
        with self.lock:
            entry = self.entries.get(aggregate_id)
            if entry is not None:
                self.entries.move_to_end(aggregate_id)
            return entry

    def fetch(self, partition: int, aggregate_id: str) -> Entry | None:
        """The cached entry, else the backing's (cached again); None: unknown (no backing, or no events yet)."""
        with self.lock:
            entry = self.get(aggregate_id)
            if entry is None and self.backing is not None:
                entry = self.backing.load(partition, aggregate_id)
                if entry is not None:
                    self.put(aggregate_id, entry)
            return entry

    def put(self, aggregate_id: str, entry: Entry) -> None:
        with self.lock:
            self.entries[aggregate_id] = entry
            self.entries.move_to_end(aggregate_id)
            ev = self.evicted.get(entry.partition)
            if ev:
                ev.discard(aggregate_id)

    def is_evicted(self, partition: int, aggregate_id: str) -> bool:
        ev = self.evicted.get(partition)
        return ev is not None and aggregate_id in ev

    def has_evicted(self) -> bool:
        """Some aggregate was evicted and not cached again (`missing` may then answer True)."""
        with self.lock:
            return any(self.evicted.values())

    def missing(self, partition: int, aggregate_id: str) -> bool:
        """Evicted and not cached again: its state must be reloaded from Kafka before a decision."""
        with self.lock:
            return self.is_evicted(partition, aggregate_id) and aggregate_id not in self.entries

    def locate(self, aggregate_id: str) -> tuple[Entry | None, int | None]:
        """(its cached entry, else None; the partition it was evicted from, else None), without touching the LRU
        order: a read from another thread must not keep an aggregate cached."""
        with self.lock:
            entry = self.entries.get(aggregate_id)
            if entry is not None:
                return entry, None
            return None, next((p for p, ids in self.evicted.items() if aggregate_id in ids), None)

    def revert(self, undo: dict[str, tuple[tuple[Any, int] | None, list[str]]]) -> None:
        """Put each touched aggregate back as it was before an aborted transaction: its (state, version), or
        uncached when it was new, and its command ids of that transaction out of the window."""
        with self.lock:
            for aid, (old, command_ids) in undo.items():
                entry = self.entries.get(aid)
                if entry is None:
                    continue
                for cid in command_ids:
                    self.window.forget(entry, cid)
                if old is None:
                    self.entries.pop(aid, None)
                else:
                    entry.state, entry.version = old

    def window_figures(self) -> dict[str, int]:
        """The idempotency window's figures: ids held, expired, dropped early, and its bound."""
        with self.lock:
            w = self.window
            return {"ids_held": w.held(self.entries), "expired": w.expired, "dropped_early": w.dropped_early,
                    "max_ids": w.max_ids}

    def trim(self) -> int:
        with self.lock:
            n = 0
            spilled: list[tuple[str, Entry]] = []
            while len(self.entries) > self.max_aggregates:
                aid, entry = self.entries.popitem(last=False)
                if self.backing is None:
                    self.evicted.setdefault(entry.partition, set()).add(aid)
                else:
                    spilled.append((aid, entry))
                n += 1
            if spilled:
                assert self.backing is not None
                self.backing.spill(spilled)  # only what is not yet written (a recovering partition's) is written
            self.evictions += n
            self.window.expire(self.entries)
            return n

    def drop_partition(self, partition: int) -> None:
        with self.lock:
            for aid in [a for a, e in self.entries.items() if e.partition == partition]:
                del self.entries[aid]
            self.evicted.pop(partition, None)

    def __len__(self) -> int:
        return len(self.entries)
