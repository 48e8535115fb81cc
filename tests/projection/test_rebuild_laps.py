"""When the rebuild's catch-up stops for the swap's lock: laps go on outside the lock while the tail shrinks."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from kafold.connectors.projection.rebuild import LAST_LAP_TAIL, _CatchUp


def _catch_up(share: object = None) -> tuple[_CatchUp, SimpleNamespace]:
    rebuild = SimpleNamespace(stop=threading.Event(), batch=5000, share=share, behind=0)
    return _CatchUp(rebuild), rebuild  # type: ignore[arg-type]


def _laps(tails: list[int]) -> int:
    """How many laps reach their targets before the lock is taken, given the tail each leaves."""
    handler, rebuild = _catch_up()
    handler.loop_started()
    for lap, tail in enumerate(tails, 1):
        rebuild.behind = tail
        if handler._last_lap():
            return lap
    raise AssertionError("the laps never ended")


def test_laps_go_on_while_each_leaves_a_quarter_less() -> None:
    assert _laps([3283, 1800, 1000, 600, 420, 400]) == 6  # 420 -> 400 shrank by less than a quarter


def test_a_growing_tail_ends_the_laps_at_once() -> None:
    assert _laps([3000, 3500]) == 2


def test_a_small_tail_goes_under_the_lock_without_another_lap() -> None:
    assert _laps([LAST_LAP_TAIL]) == 1 and _laps([5000, LAST_LAP_TAIL - 1]) == 2


def test_a_copy_worker_stops_as_soon_as_it_is_near() -> None:
    handler, rebuild = _catch_up(share=frozenset())
    rebuild.behind = 10_000
    assert handler._last_lap()


def test_a_new_attempt_starts_counting_afresh() -> None:
    handler, rebuild = _catch_up()
    rebuild.behind = 1000
    assert not handler._last_lap()
    handler.loop_started()
    rebuild.behind = 2000  # more than the last attempt's, but its first lap
    assert not handler._last_lap()
