"""The local state store alone (no broker): what `open` trusts, outcomes kept until the window passes them."""

from __future__ import annotations

from pathlib import Path

from kafold.daemon.aggregates.local import LocalStates, Trusted
from kafold.daemon.aggregates.store import Entry
from kafold.daemon.aggregates.window import Window, accepted, rejected
from tests.aggregates.agg_support import bank_config, bank_domain

DAY = 86_400_000


def _states(tmp_path: Path) -> LocalStates:
    agg = bank_config("unit")
    return LocalStates(tmp_path / "unit", bank_domain(agg), agg.state_schema_version, DAY)


def test_outcomes_are_kept_for_the_window_then_swept(tmp_path: Path) -> None:
    """An outcome is read back until the window (by command time) has passed it, then swept from disk."""
    local = _states(tmp_path)
    assert local.open(0, 0, 0) is None  # nothing there yet: emptied and to be filled
    entry = Entry(local.domain.initial(), 1, 0)
    window = Window(DAY, 10)
    window.remember(entry, "a", "old", accepted(1_000, 1, 1))
    window.remember(entry, "a", "no", rejected(5_000, 1, "insufficient funds"))
    local.committed({0: [("a", entry, ["old", "no"])]}, {0: 1}, cutoff=0)
    assert local.outcome(0, "a", "old") == accepted(1_000, 1, 1)
    assert local.outcome(0, "a", "no") == rejected(5_000, 1, "insufficient funds")
    local.committed({0: [("a", entry, [])]}, {0: 1}, cutoff=2_000)
    assert local.outcome(0, "a", "old") is None and local.outcome(0, "a", "no") is not None
    loaded = local.load(0, "a")
    assert loaded is not None and (loaded.state, loaded.version) == (entry.state, 1)
    local.close_all()


def test_open_trusts_only_an_offset_within_the_committed_events(tmp_path: Path) -> None:
    """The recorded offset is trusted within [first offset, committed end]; ahead of the end, the store is emptied."""
    local = _states(tmp_path)
    local.open(0, 0, 0)
    local.seal(0, [("a", Entry(local.domain.initial(), 3, 0))], 40, None)
    assert local.open(0, 0, 40) == Trusted(40, None)
    assert local.open(0, 0, 39) is None  # ahead of the committed events: rebuilt
    assert local.load(0, "a") is None
    local.close_all()


def test_the_results_offset_is_written_with_its_outcomes_and_trusted_only_within_the_committed_results(
        tmp_path: Path) -> None:
    """The results offset moves with each committed batch's outcomes (never back), and a store whose results offset
    lies past the committed results (a crash order that must not occur, or files from elsewhere) is emptied."""
    local = _states(tmp_path)
    local.open(0, 0, 0, 0)
    entry = Entry(local.domain.initial(), 0, 0)
    local.seal(0, [("a", entry)], 0, 7)
    assert local.open(0, 0, 0, 7) == Trusted(0, 7)
    window = Window(DAY, 10)
    window.remember(entry, "a", "no", rejected(5_000, 0, "insufficient funds"))
    local.committed({0: [("a", entry, ["no"])]}, {}, cutoff=0, results={0: 12})  # a rejection: no event
    local.committed({0: [("a", entry, [])]}, {}, cutoff=0, results={0: 9})  # a stale report: kept at 12
    assert local.open(0, 0, 0, 12) == Trusted(0, 12)
    assert local.outcome(0, "a", "no") == rejected(5_000, 0, "insufficient funds")
    assert local.open(0, 0, 0, 11) is None  # ahead of the committed results: rebuilt
    assert local.outcome(0, "a", "no") is None
    local.close_all()


def test_a_seal_without_a_results_offset_holds_it_until_the_next_seal(tmp_path: Path) -> None:
    """A gate that could not write every outcome its results read found (ids dropped from memory early) seals with
    no results offset: later batches do not move it past the results whose outcomes are not on disk."""
    local = _states(tmp_path)
    local.open(0, 0, 0, 0)
    entry = Entry(local.domain.initial(), 0, 0)
    local.seal(0, [("a", entry)], 0, 5)
    local.open(0, 0, 0, 9)
    local.seal(0, [("a", entry)], 0, None)  # outcomes of results 5..8 not all held
    local.committed({0: [("a", entry, [])]}, {}, cutoff=0, results={0: 12})
    assert local.open(0, 0, 0, 12) == Trusted(0, 5)  # read from 5 again on the next restart
    local.seal(0, [("a", entry)], 0, 12)
    local.committed({0: [("a", entry, [])]}, {}, cutoff=0, results={0: 14})
    assert local.open(0, 0, 0, 14) == Trusted(0, 14)
    local.close_all()
