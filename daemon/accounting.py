"""Offset accounting: per connector and partition, records seen = applied + duplicates + stale + dead-lettered +
skipped, so that a record dropped silently between Kafka and a task's store shows as a gap.

Note on what is counted
-----------------------
The runner counts, per partition, every record it consumed (`seen`), those it dead-lettered itself (undecodable,
unknown type under `dead-letter`, upcast failed, a RecordError raised by `put`) and those it skipped
(`on_unknown_type = "skip"`); the task tells what became of the rest (`SinkTask.outcomes`: applied, duplicates,
stale, dead-lettered by the task). A task that does not tell has every record put counted as applied. Counts start
with the runner (a restart starts again from 0) and cover every partition it ever held; a record delivered again
after a rebalance or a restart is seen again, and its task counts it again (as a duplicate, usually).
`unaccounted` is seen minus the rest: a pipelined task's write in flight while it runs, 0 once it is done. A value
that stays above 0 with nothing in flight is a record lost on the way (or, after a rebalance, records of a batch
whose partition was revoked while `put` was backing off: the new owner handles them); one that stays below 0 is a
record counted twice (a batch partly committed before a retriable error is redone whole, its committed part then
as duplicates).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kafold.connectors.api import Outcomes, TopicPartition

FIELDS = ("seen", "applied", "duplicates", "stale", "dead_lettered", "skipped", "unaccounted")


@dataclass(frozen=True, slots=True)
class Seen:
    """The runner's half of one partition's accounting."""

    seen: int = 0
    dead_lettered: int = 0
    skipped: int = 0


class Tally:
    """Kept by the runner's thread; `snapshot` (immutable values, replaced whole) is what other threads read."""

    def __init__(self) -> None:
        self.snapshot: dict[TopicPartition, Seen] = {}

    def add(self, seen: Mapping[TopicPartition, int], dead: Mapping[TopicPartition, int],
            skipped: Mapping[TopicPartition, int]) -> None:
        new = dict(self.snapshot)
        for tp in {*seen, *dead, *skipped}:
            old = new.get(tp, Seen())
            new[tp] = Seen(old.seen + seen.get(tp, 0), old.dead_lettered + dead.get(tp, 0),
                           old.skipped + skipped.get(tp, 0))
        self.snapshot = new


@dataclass(frozen=True, slots=True)
class Account:
    """One partition's accounting, both halves."""

    tp: TopicPartition
    seen: int
    applied: int
    duplicates: int
    stale: int
    dead_lettered: int
    skipped: int

    @property
    def unaccounted(self) -> int:
        return self.seen - self.applied - self.duplicates - self.stale - self.dead_lettered - self.skipped

    def as_dict(self) -> dict[str, Any]:
        return {"topic": self.tp.topic, "partition": self.tp.partition,
                **{name: getattr(self, name) for name in FIELDS}}


def accounts(seen: Mapping[TopicPartition, Seen],
             outcomes: Mapping[TopicPartition, Outcomes] | None) -> dict[TopicPartition, Account]:
    """Both halves per partition; `outcomes` None: the task does not tell (every record put counts as applied)."""
    out: dict[TopicPartition, Account] = {}
    for tp in sorted({*seen, *(outcomes or {})}):
        s = seen.get(tp, Seen())
        o = Outcomes(applied=s.seen - s.dead_lettered - s.skipped) if outcomes is None else outcomes.get(
            tp, Outcomes())
        out[tp] = Account(tp, s.seen, o.applied, o.duplicates, o.stale, s.dead_lettered + o.dead_lettered,
                          s.skipped)
    return out
