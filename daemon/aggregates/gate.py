"""The catch-up gate of one commands partition: RECOVERING until its events partition is replayed to the end.

Offset note: `captured_end` is the events partition's high watermark at assignment (ListOffsets under
read_uncommitted: every record written, transactions still open included). The gate opens only when the replay
(read_committed) has reached it *and* a fetch response reported the end of the partition (partition EOF) at an
offset >= `captured_end`. The last stable offset is not enough: the previous owner's last transaction can be
committed, its command offsets already readable by the group, while its COMMIT marker has not yet reached the
events partition (the coordinator writes the markers partition by partition); a gate opened there decides the
next commands on a state without that transaction's events and writes a second event at their versions. Below
the high watermark the replay waits until every such transaction ends (committed: folded; aborted, or timed out
by the coordinator after transaction.timeout.ms: skipped, and the fetch reports EOF past it). A fetch reports the
true end of the log, so if the captured figure under-reports the end the replay simply continues: the gate can
open late, never early. Until it opens, the partition's commands are paused and any command fetched anyway is
sought back (never decided).

LIVE means commands are being decided: `end_of_partition` only says the replay is complete; the runtime then reads
the window's results tail, seals the local store and resumes the partition's commands (catchup.CatchUp._open),
and only then calls `open`. A status read, a `ready` check or a state read never sees LIVE before that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# A gate's fields in the daemon's /status rows and `kafold status` (after the aggregate's name).
STATUS_FIELDS = ("partition", "phase", "position", "captured_end", "fold_error")

RECOVERING, LIVE, STOPPED = "RECOVERING", "LIVE", "STOPPED"  # STOPPED: an event the fold cannot apply


@dataclass
class PartitionGate:
    """State machine of one partition: RECOVERING -> LIVE, or RECOVERING -> STOPPED at an event the fold cannot
    apply (`on_fold_error = "stop"`: the gate never opens on a state that misses it; a new assignment, after a fix
    and a restart, starts a new gate)."""

    partition: int
    captured_end: int
    start: int = 0                       # first events offset replayed (after a snapshot: the tail's start)
    phase: str = RECOVERING
    position: int = -1                   # next events offset after the last replayed record
    eof_at: int | None = None            # latest partition EOF reported by a fetch
    events_replayed: int = 0
    last_event: int = -1                 # offset of the last event replayed (-1: none since `start`)
    snapshot_version: int | None = None  # set by a snapshot restore (none yet: full replay)
    began: float = field(default_factory=time.monotonic)
    reached_at: float | None = None      # when the replay first reached `captured_end`
    replayed_at: float | None = None     # when the replay was complete (end_of_partition said so)
    opened_at: float | None = None       # when its commands resumed: LIVE
    first_decided_at: float | None = None  # when the first command of this assignment was decided
    decided_while_recovering: int = 0    # must stay 0: counted defensively by the runtime
    fold_error: str | None = None        # why the gate STOPPED

    def __post_init__(self) -> None:
        self.position = max(self.position, self.start)

    @property
    def live(self) -> bool:
        return self.phase == LIVE

    def replayed(self, next_offset: int, count: int = 1, now: float | None = None) -> None:
        """Records up to `next_offset` (exclusive) were folded into state."""
        if next_offset > self.position:
            self.position = next_offset
        if count:
            self.last_event = max(self.last_event, next_offset - 1)
        self.events_replayed += count
        self._check_reached(now)

    def end_of_partition(self, offset: int, now: float | None = None) -> bool:
        """A fetch reported partition EOF at `offset` (= the next offset to read). True (once) when the replay is
        complete: the caller then finishes the catch-up and calls `open`; the gate stays RECOVERING until then."""
        if self.live or self.stopped or self.replayed_at is not None:
            return False
        self.eof_at = offset
        if offset > self.position:  # nothing in between (e.g. transaction markers): the position is the end
            self.position = offset
        self._check_reached(now)
        if offset >= self.captured_end and self.position >= self.captured_end:
            self.replayed_at = time.monotonic() if now is None else now
            return True
        return False

    def open(self, now: float | None = None) -> None:
        """The partition's commands resumed: LIVE (commands are decided from now on)."""
        assert self.replayed_at is not None and not self.stopped, "a gate opens only after its replay is complete"
        self.phase = LIVE
        self.opened_at = time.monotonic() if now is None else now

    def stop(self, why: str) -> None:
        """The replay met an event it cannot fold: the gate stays closed."""
        self.phase, self.fold_error = STOPPED, why

    @property
    def stopped(self) -> bool:
        return self.phase == STOPPED

    def _check_reached(self, now: float | None) -> None:
        if self.reached_at is None and self.position >= self.captured_end:
            self.reached_at = time.monotonic() if now is None else now

    def may_decide(self) -> bool:
        return self.live

    def describe(self) -> dict[str, object]:
        return {"partition": self.partition, "phase": self.phase, "captured_end": self.captured_end,
                "start": self.start, "position": self.position, "eof_at": self.eof_at,
                "events_replayed": self.events_replayed, "snapshot_version": self.snapshot_version,
                "recovery_s": round((self.opened_at or time.monotonic()) - self.began, 3),
                **({"fold_error": self.fold_error} if self.fold_error else {})}
