"""Unit: the rebuild's status line — records behind the live connector, rate, and an ETA until the swap."""

from __future__ import annotations

from kafold.connectors.projection.rebuild import Progress
from kafold.tools.commands.projection import Eta, describe


def test_the_eta_is_the_gap_over_the_rate_at_which_it_closes_and_unknown_while_it_does_not() -> None:
    assert Eta().seconds(0) == 0.0  # nothing behind: the swap is next
    stalled = Eta()
    stalled.update(0.0, 0, 500)
    stalled.update(1.0, 1000, 500)  # copying as fast as the live connector moves: no closing, no ETA
    assert stalled.seconds(500) is None
    line = describe(Progress("catching-up", 10, 20, 1000, 5, 500), stalled)
    assert line == "catching-up: behind 500 records, 300 ev/s, ETA to swap unknown"
    closing = Eta()
    closing.update(0.0, 0, 10_000)
    closing.update(1.0, 20_000, 6_000)
    assert closing.seconds(6_000) == 6_000 / closing.closing and "ETA to swap 0:05" in describe(
        Progress("copying", 0, 0, 20_000, 0, 6_000), closing)


def test_after_the_swap_the_line_says_so_with_nothing_behind() -> None:
    assert describe(Progress("swapped", 5, 5, 5, 0, 0), Eta()) == "swapped: the rebuilt table is live (behind 0)"
