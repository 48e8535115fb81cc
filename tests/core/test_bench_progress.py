"""The benches' wait (kafold.tools.bench.progress): it lasts as long as the phase moves and fails only when it
stalls, naming where it stopped."""

from __future__ import annotations

import itertools

import pytest

from kafold.daemon.aggregates.gate import LIVE, PartitionGate
from kafold.tools.bench.progress import gates_progress, wait_progress


def test_a_moving_phase_is_waited_for_past_any_stall_allowance() -> None:
    ticks = itertools.count()
    # each poll moves the progress: 50 polls are waited for, though the allowance is a fraction of a poll
    wait_progress(lambda: next(ticks) >= 50, object,
                  "a moving phase", stall_s=0.000001, poll_s=0.001)
    assert next(ticks) > 50


def test_a_stalled_phase_fails_naming_what_and_where() -> None:
    gate = PartitionGate(3, captured_end=900, position=412, events_replayed=12)
    with pytest.raises(TimeoutError, match=r"no progress for 0.05 s waiting for the restart to be live; stalled at "
                                           r"\(\('commands', 7\), \('events', 0\), \('results_read', 0\), "
                                           r"\(3, 'RECOVERING', 412, 12\)\)"):
        wait_progress(lambda: False, lambda: gates_progress({"commands": 7}, {3: gate}), "the restart to be live",
                      stall_s=0.05, poll_s=0.001)


def test_gates_progress_leaves_out_the_clock() -> None:
    gate = PartitionGate(0, captured_end=10)
    before = gates_progress({"commands": 1, "events": 2}, {0: gate})
    gate.began -= 5.0  # the gate's own clock moving is not progress
    assert gates_progress({"commands": 1, "events": 2}, {0: gate}) == before
    gate.phase = LIVE
    assert gates_progress({"commands": 1, "events": 2}, {0: gate}) != before
