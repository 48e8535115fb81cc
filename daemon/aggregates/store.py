"""In-memory aggregate states: a bounded LRU over every assigned partition, with an evicted set for reloads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

RECENT_COMMANDS = 32  # command ids remembered per aggregate for the idempotency guard


class Entry:
    """One aggregate's state, version, partition and its last processed command ids -> (version after, events)."""

    __slots__ = ("partition", "recent", "state", "version")

    def __init__(self, state: Any, version: int, partition: int, recent: dict[str, tuple[int, int]] | None = None
                 ) -> None:
        self.state = state
        self.version = version
        self.partition = partition
        self.recent: dict[str, tuple[int, int]] = recent if recent is not None else {}

    def note(self, command_id: str, version_after: int, events: int, keep: int = RECENT_COMMANDS) -> None:
        """Remember that `command_id` produced `events` events ending at `version_after`."""
        recent = self.recent
        prior = recent.get(command_id)
        if prior is not None:  # more events of the same command (replay): extend its range
            events = prior[1] + 1 if version_after > prior[0] else prior[1]
            version_after = max(version_after, prior[0])
        recent[command_id] = (version_after, events)
        if len(recent) > keep:
            del recent[next(iter(recent))]

    def copy(self) -> Entry:
        return Entry(self.state, self.version, self.partition, dict(self.recent))


class StateStore:
    """LRU of entries by aggregate id. `trim()` evicts the least recently used down to `max_aggregates` and
    remembers the evicted ids per partition: such an id must be reloaded from Kafka before use (a key that is
    neither cached nor evicted has no events yet). Every method takes the lock: `get_state` runs on other threads.
    """

    def __init__(self, max_aggregates: int) -> None:
        self.max_aggregates = max_aggregates
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

    def trim(self) -> int:
        with self.lock:
            n = 0
            while len(self.entries) > self.max_aggregates:
                aid, entry = self.entries.popitem(last=False)
                self.evicted.setdefault(entry.partition, set()).add(aid)
                n += 1
            self.evictions += n
            return n

    def drop_partition(self, partition: int) -> None:
        with self.lock:
            for aid in [a for a, e in self.entries.items() if e.partition == partition]:
                del self.entries[aid]
            self.evicted.pop(partition, None)

    def __len__(self) -> int:
        return len(self.entries)
