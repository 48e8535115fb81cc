"""The local state store alone (no broker): what `open` trusts, outcomes kept until the window passes them."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from kafold.daemon.aggregates.local import LAYOUT, LocalStates, Trusted, outcome_key, state_key
from kafold.daemon.aggregates.mapped import RELEASE_RECORDS
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.daemon.aggregates.window import Window, accepted, rejected
from kafold.envelope import MAX_ID_CHARS
from kafold.errors import FatalError
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


def test_a_store_of_an_earlier_record_layout_is_rebuilt(tmp_path: Path) -> None:
    """A store whose meta record names no layout (kafold before layout 2 kept the outcomes apart from the states) or
    another one is not trusted: its records are not where this kafold looks for them. It is emptied and rebuilt."""
    earlier = _states(tmp_path)
    earlier.identity = {k: v for k, v in earlier.identity.items() if k != "layout"}
    earlier.open(0, 0, 0)
    earlier.seal(0, [("a", Entry(earlier.domain.initial(), 3, 0))], 40, None)
    earlier.close_all()
    local = _states(tmp_path)
    assert local.identity["layout"] == LAYOUT
    assert local.open(0, 0, 40) is None and local.load(0, "a") is None
    local.seal(0, [("a", Entry(local.domain.initial(), 3, 0))], 40, None)
    assert local.open(0, 0, 40) == Trusted(40, None)
    local.close_all()


def test_an_aggregates_state_and_outcomes_are_neighbours_and_no_id_is_another_ones_prefix() -> None:
    """Keys: the state and the window outcomes of one aggregate sort together (one page for a command's write), and
    the id's length in front keeps an id that extends another (`a` and `a\0w...`) from reaching into its records."""
    keys = sorted([state_key("b"), outcome_key("b", "c1"), state_key("a"), outcome_key("a", "c9"),
                   outcome_key("a", "c1"), state_key("a\0wc1"), state_key("ab")])
    a, b = keys.index(state_key("a")), keys.index(state_key("b"))
    assert keys[a + 1:a + 3] == [outcome_key("a", "c1"), outcome_key("a", "c9")]
    assert keys[b + 1] == outcome_key("b", "c1")
    assert len(set(keys)) == 7 and outcome_key("a", "c1") != state_key("a\0wc1")


def test_ids_of_the_longest_size_allowed_are_stored_and_read_back(tmp_path: Path) -> None:
    """An aggregate id and a command id of MAX_ID_CHARS characters of 4 bytes each (LMDB refuses a key over 511
    bytes): their state and outcome are written, read back and swept like any other, apart from a short id's."""
    local = _states(tmp_path)
    local.open(0, 0, 0)
    long_aid, long_cid = "\U0001F600" * MAX_ID_CHARS, "\u4e2d" * MAX_ID_CHARS
    near_aid = "\U0001F600" * (MAX_ID_CHARS - 1) + "x"  # the same length, another id: its own records
    entry, other = Entry(local.domain.initial(), 1, 0), Entry(local.domain.initial(), 2, 0)
    window = Window(DAY, 10)
    window.remember(entry, long_aid, long_cid, accepted(1_000, 1, 1))
    window.remember(other, near_aid, long_cid, rejected(3_000, 2, "insufficient funds"))
    local.committed({0: [(long_aid, entry, [long_cid]), (near_aid, other, [long_cid])]}, {0: 1}, cutoff=0)
    loaded, near = local.load(0, long_aid), local.load(0, near_aid)
    assert loaded is not None and loaded.version == 1 and near is not None and near.version == 2
    assert local.outcome(0, long_aid, long_cid) == accepted(1_000, 1, 1)
    assert local.outcome(0, near_aid, long_cid) == rejected(3_000, 2, "insufficient funds")
    local.committed({0: [(long_aid, entry, [])]}, {0: 1}, cutoff=2_000)  # the first outcome past the window
    assert local.outcome(0, long_aid, long_cid) is None and local.outcome(0, near_aid, long_cid) is not None
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


def test_a_damaged_record_is_found_when_read_and_distrusts_its_partition(tmp_path: Path) -> None:
    """The open checks the meta record only; a record whose bytes changed fails its checksum when it is read: the
    read raises, nothing more is written there, and the next open rebuilds the partition."""
    local = _states(tmp_path)
    local.open(0, 0, 0)
    local.seal(0, [("a", Entry(local.domain.initial(), 3, 0)), ("b", Entry(local.domain.initial(), 2, 0))], 40, None)
    local.close(0)
    env = lmdb.open(str(local.path(0)))
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(state_key("a")))
        value[-2] ^= 0x01
        txn.put(state_key("a"), bytes(value))
    env.close()
    assert local.open(0, 0, 40) == Trusted(40, None)  # the damage is not looked for at the open
    loaded = local.load(0, "b")
    assert loaded is not None and loaded.version == 2
    with pytest.raises(FatalError, match="damaged"):
        local.load(0, "a")
    assert 0 in local.damaged
    with pytest.raises(FatalError, match="damaged"):  # nor is anything written to it any more
        local.seal(0, [("b", Entry(local.domain.initial(), 4, 0))], 41, None)
    assert local.open(0, 0, 41) is None and local.load(0, "b") is None  # rebuilt
    assert not local.damaged
    local.close_all()


def test_outcomes_dropped_early_while_a_partition_recovers_reach_the_store(tmp_path: Path) -> None:
    """A replay holding more ids than idempotency_max_ids drops the oldest from memory before the gate's seal; they
    are written when dropped, so the sealed store (trusted past their events) still answers them."""
    local = _states(tmp_path)
    local.open(0, 0, 0)  # recovering: nothing written until the seal but what is dropped or evicted
    store = StateStore(100, Window(DAY, 2), local)
    store.window.keep = local.keep
    entry = Entry(local.domain.initial(), 0, 0)
    store.put("a", entry)
    for v in range(1, 6):  # five replayed acceptances of one aggregate, then a rejection from the results
        store.window.add_event(entry, "a", f"c{v}", 1_000 * v, v, f"e{v}")
        entry.version = v
    store.window.remember(entry, "a", "no", rejected(9_000, 5, "insufficient funds"))
    store.trim()
    assert sorted(entry.recent) == ["c5", "no"] and store.window.dropped_early == 4
    local.seal(0, [("a", entry)], 5, None)
    assert local.open(0, 0, 5) == Trusted(5, None)
    assert [local.outcome(0, "a", f"c{v}") for v in range(1, 6)] == [accepted(1_000 * v, v, 1) for v in range(1, 6)]
    assert local.outcome(0, "a", "no") == rejected(9_000, 5, "insufficient funds")
    local.close_all()


def test_an_id_decided_again_past_the_window_keeps_its_new_outcome_when_the_old_one_is_swept(tmp_path: Path) -> None:
    """A retry past the window is decided again before the sweep reached the first outcome: the sweep of the first
    outcome's expiry entry leaves the new outcome (under the same key) in place."""
    local = _states(tmp_path)
    local.open(0, 0, 0)
    entry = Entry(local.domain.initial(), 1, 0)
    window = Window(DAY, 10)
    window.remember(entry, "a", "dep", accepted(1_000, 1, 1))
    local.committed({0: [("a", entry, ["dep"])]}, {0: 1}, cutoff=0)
    entry.version = 2
    window.remember(entry, "a", "dep", accepted(DAY + 5_000, 2, 1))  # retried 24 h + 4 s later: decided again
    local.committed({0: [("a", entry, ["dep"])]}, {0: 2}, cutoff=5_000)
    assert local.outcome(0, "a", "dep") == accepted(DAY + 5_000, 2, 1)
    local.committed({0: [("a", entry, [])]}, {0: 2}, cutoff=DAY + 6_000)
    assert local.outcome(0, "a", "dep") is None  # its own expiry entry sweeps it in turn
    local.close_all()


def test_window_bound_in_memory_follows_the_cache_with_a_local_store() -> None:
    """Unset, idempotency_max_ids is 1,000,000 without a local store and 2 per cached aggregate (at most 1,000,000)
    with one; set, it is what it says either way."""
    agg = bank_config("w", cache_max_aggregates=10_000)
    assert agg.window_max_ids(on_disk=False) == 1_000_000
    assert agg.window_max_ids(on_disk=True) == 20_000
    assert bank_config("w").window_max_ids(on_disk=True) == 200_000  # the default cache: 100,000 aggregates
    assert bank_config("w", cache_max_aggregates=900_000).window_max_ids(on_disk=True) == 1_000_000
    pinned = bank_config("w", cache_max_aggregates=10_000, idempotency_max_ids=300)
    assert pinned.window_max_ids(on_disk=True) == pinned.window_max_ids(on_disk=False) == 300


def _mapped_kb(data_file: Path) -> int | None:
    """The process's resident kB of its mappings of `data_file` (/proc/self/smaps), None off Linux."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's header line
            inside = len(head) == 6 and head[5] == str(data_file)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def _filled(tmp_path: Path, batch: int) -> tuple[LocalStates, Path, list[str]]:
    """A partition's store with 20,000 aggregates written in batches of `batch` (pages mapped as LMDB finds where to
    put them), its data file and the ids; the test is skipped where mappings cannot be read or released."""
    local = _states(tmp_path)
    local.open(0, 0, 0)
    data_file = local.path(0) / "data.mdb"
    if _mapped_kb(data_file) is None or local.mapped.madvise is None:
        pytest.skip("no /proc/self/smaps or madvise here (not Linux)")
    state = local.domain.initial()
    ids = [f"acc-{i:06d}" for i in range(20_000)]
    for start in range(0, len(ids), batch):
        local.committed({0: [(aid, Entry(state, 1, 0), []) for aid in ids[start:start + batch]]}, {0: 1}, cutoff=0)
    return local, data_file, ids


def test_the_store_file_pages_mapped_into_the_process_are_released(tmp_path: Path) -> None:
    """Records read and written map the store's file pages into the process; every RELEASE_RECORDS records the
    map is handed back to the page cache (RSS bounded), and the records still read back whole."""
    local, data_file, ids = _filled(tmp_path, 1000)
    assert local.mapped.releases >= len(ids) // max(RELEASE_RECORDS, 2000) - 1  # at least every other batch
    size_kb = data_file.stat().st_size // 1024
    short = RELEASE_RECORDS - 1 - local.mapped.touched[0]  # one short of a release: what they map stays mapped
    for i in range(short):  # spread over the whole file
        assert local.load(0, ids[i * 7919 % len(ids)]) is not None
    before = _mapped_kb(data_file)
    assert before is not None and before > size_kb // 10
    assert local.load(0, ids[-1]) is not None  # the read that releases
    after = _mapped_kb(data_file)
    assert after is not None and after < before // 4, (before, after, size_kb)
    local.close_all()


def test_a_batch_hands_back_the_pages_it_mapped_once_it_has_read_and_once_it_has_written(tmp_path: Path) -> None:
    """A batch's reads (read_back) and its write map the store's pages; each is followed by a release, so between
    batches (while the next one is decided and committed) none of them stays mapped, however few records it had."""
    local, data_file, ids = _filled(tmp_path, 2000)
    after_writes = _mapped_kb(data_file)
    size_kb = data_file.stat().st_size // 1024
    batch = [ids[i * 7919 % len(ids)] for i in range(RELEASE_RECORDS // 2)]  # fewer than a count's release
    released = local.mapped.releases
    mapped_by_reads: list[int] = []

    class Watching(StateStore):
        def put(self, aggregate_id: str, entry: Entry) -> None:  # called as each record is read back
            super().put(aggregate_id, entry)
            if len(self.entries) == len(batch):
                mapped_by_reads.append(_mapped_kb(data_file) or 0)

    store = Watching(len(ids))
    local.read_back(store, [(0, aid, f"{aid}-cmd") for aid in batch])
    assert len(store.entries) == len(batch) and mapped_by_reads and mapped_by_reads[0] > size_kb // 10
    after_reads = _mapped_kb(data_file)
    assert after_reads is not None and after_reads < mapped_by_reads[0] // 4, (mapped_by_reads, after_reads)
    assert after_writes is not None and after_writes < size_kb // 4, (after_writes, size_kb)
    assert local.mapped.releases == released + 1
    local.close_all()
