"""The batch read-back from the local state store alone (no broker): evicted states and outcomes come back."""

from __future__ import annotations

from pathlib import Path

from kafold.daemon.aggregates.local import LocalStates
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.daemon.aggregates.window import Window, accepted, rejected
from tests.aggregates.agg_support import bank_config, bank_domain

DAY = 86_400_000


def test_read_back_restores_evicted_states_and_outcomes_of_every_partition(tmp_path: Path) -> None:
    """A batch over two open partitions and one not open here: each evicted aggregate's committed state, each
    command id's first outcome (a key known only from a rejection too) are back in the store; ids never decided and
    keys of a partition not open here stay unknown."""
    agg = bank_config("unit")
    domain = bank_domain(agg)
    local = LocalStates(tmp_path / "unit", domain, agg.state_schema_version, DAY)
    for n in (0, 1):
        local.open(n, 0, 0)
    window = Window(DAY, 100)
    a, b, r = Entry(domain.initial(), 2, 0), Entry(domain.initial(), 5, 1), Entry(domain.initial(), 0, 1)
    window.remember(a, "a", "a-1", accepted(1_000, 2, 1))
    window.remember(r, "r", "r-1", rejected(2_000, 0, "no such account"))
    local.committed({0: [("a", a, ["a-1"])], 1: [("b", b, []), ("r", r, ["r-1"])]}, {0: 2, 1: 5}, cutoff=0)

    store = StateStore(10, Window(DAY, 100), local)
    local.read_back(store, [(0, "a", "a-1"), (1, "b", "b-new"), (1, "r", "r-1"), (1, "x", "x-1"), (2, "c", "c-1")])
    assert (store.entries["a"].version, store.entries["a"].recent["a-1"]) == (2, accepted(1_000, 2, 1))
    assert store.entries["b"].version == 5 and "b-new" not in store.entries["b"].recent
    assert store.entries["r"].version == 0 and store.entries["r"].recent["r-1"] == rejected(2_000, 0,
                                                                                             "no such account")
    assert "x" not in store.entries and "c" not in store.entries
    assert local.reads == 2  # the two states on disk; a rejection-only key has no state record
    local.close_all()
