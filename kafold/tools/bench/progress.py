"""Waiting on a bench's phase for as long as it moves: it fails when its progress stalls, naming where, rather than
at a fixed deadline that a larger run (issue 56's 10M commands) outgrows."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# How long a phase may show no progress at all before the bench gives up on it: above a group join with the
# benches' short timeouts (SHORT_GROUP_TIMEOUTS) and a store's open, far below a run's length.
STALL_S = 120.0


def wait_progress(done: Callable[[], bool], progress: Callable[[], Any], what: str, stall_s: float = STALL_S,
                  poll_s: float = 0.01) -> None:
    """Poll `done()` until it holds. `progress()` says where the phase is (any value comparable with ==, shown in
    the error: counts, the gates' phases and positions); while it keeps changing the wait goes on, however long
    the run; unchanged for `stall_s` seconds, TimeoutError naming `what` was awaited and where it stopped."""
    last, moved = progress(), time.monotonic()
    while not done():
        now, seen = time.monotonic(), progress()
        if seen != last:
            last, moved = seen, now
        elif now - moved > stall_s:
            raise TimeoutError(f"bench: no progress for {stall_s:g} s waiting for {what}; stalled at {seen}")
        time.sleep(poll_s)


def gates_progress(counts: dict[str, int], gates: dict[int, Any]) -> tuple[Any, ...]:
    """Where an aggregate runtime (or its worker processes) is: commands and events counted, results read, and
    each partition gate's phase and position (PartitionGate; its clock-derived fields left out: they always move)."""
    return (("commands", counts.get("commands", 0)), ("events", counts.get("events", 0)),
            ("results_read", counts.get("recovery_results_read", 0)),
            *((g.partition, g.phase, g.position, g.events_replayed) for g in sorted(list(gates.values()),
                                                                                  key=lambda g: g.partition)))
