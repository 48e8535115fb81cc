"""Pure restore logic (no Kafka): snapshot + tail equals full replay, whatever the cut and the junk on the topic."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafold.config import FoldErrorPolicy
from kafold.envelope import Event, encode
from kafold.fold import Folder, FoldError
from kafold.snapshot import Marker, Selector, Snapshot, Tail
from kafold.snapshot import folder as new_folder
from kafold.snapshot.select import REJECTED
from tests.snapshots.snaphelpers import bank_aggregate, bank_domain, generate

AGG = bank_aggregate("account", partitions=1)
DOMAIN = bank_domain(AGG)
IDENT = DOMAIN.identity


def events(n: int, seed: int, accounts: int) -> list[tuple[int, bytes, bytes]]:
    out = []
    for offset, (aid, v, kind, payload) in enumerate(generate(random.Random(seed), accounts, n, {})):
        key, value, _ = encode(Event.new(kind, "account", aid, v, payload))
        out.append((offset, key, value))
    return out


def fold(evs: list[tuple[int, bytes, bytes]], folder: Folder[Tail]) -> Folder[Tail]:
    if evs:
        offsets, keys, values = zip(*evs, strict=True)
        folder.fold(list(offsets), list(keys), list(values))
    return folder


def snapshot_records(evs: list[tuple[int, bytes, bytes]], cut: int) -> list[tuple[bytes, bytes]]:
    """What a snapshot run up to offset `cut` writes: a snapshot per aggregate, then the marker."""
    folder = fold(evs[:cut], new_folder(DOMAIN))
    out = [s.encode()[:2] for s in folder.held.snapshots(0, cut)]
    return [*out, Marker("account", 0, cut, IDENT.fingerprint, IDENT.state_schema_version).encode()[:2]]


def junk(kind: str, evs: list[tuple[int, bytes, bytes]], cut: int, rng: random.Random) -> tuple[bytes, bytes]:
    """A snapshot record that must never be used (out-of-order: a genuine older one, written late)."""
    if kind == "out-of-order":
        early = max(1, cut // 2)
        aid = evs[rng.randrange(early)][1]
        folded = fold(evs[:early], new_folder(DOMAIN))
        older = [s for s in folded.held.snapshots(0, early) if s.aggregate_id.encode() == aid]
        return older[0].encode()[:2]
    aid_text = evs[rng.randrange(len(evs))][1].decode()
    bad_state = {"status": "open", "owner": "forged", "currency": "EUR", "balance": 10**9}
    good = Snapshot("account", aid_text, bad_state, 1, 0, max(1, cut), IDENT.fingerprint, IDENT.state_schema_version)
    if kind == "checksum":
        key, value, _ = good.encode()
        return key, value.replace(b"forged", b"FORGED")
    if kind == "fingerprint":
        return good._replace(fingerprint="other-fold").encode()[:2]
    if kind == "schema":
        return good._replace(state_schema_version=2).encode()[:2]
    return good._replace(offset=len(evs) + 5, version=2).encode()[:2]  # ahead of the events


KINDS = ("checksum", "fingerprint", "schema", "ahead", "out-of-order")


def topic_records(evs: list[tuple[int, bytes, bytes]], cuts: list[float], bad: list[str],
                  rng: random.Random) -> list[tuple[bytes, bytes]]:
    """A snapshot topic: the records of runs at the given cuts (fractions of the history), then junk of each kind."""
    recs: list[tuple[bytes, bytes]] = []
    for c in sorted(int(f * len(evs)) for f in cuts):
        recs += snapshot_records(evs, c)
    return recs + [junk(kind, evs, len(evs) // 2, rng) for kind in bad]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), accounts=st.integers(1, 12), seed=st.integers(0, 10**6),
       cuts=st.lists(st.floats(0, 1), min_size=0, max_size=3),
       bad=st.lists(st.sampled_from(KINDS), max_size=4))
def test_snapshot_plus_tail_equals_full_replay(n: int, accounts: int, seed: int, cuts: list[float],
                                               bad: list[str]) -> None:
    """For any history, any sequence of snapshot runs and any junk on the topic, restore == full replay."""
    evs = events(n, seed, accounts)
    recs = topic_records(evs, cuts, bad, random.Random(seed))
    selector = Selector(IDENT, 0, 0, n)
    for offset, (key, value) in enumerate(recs):
        selector.feed(key, value, offset)
    sel = selector.result()
    restored = fold([e for e in evs if e[0] >= sel.start], new_folder(DOMAIN, sel.bases))
    full = fold(evs, new_folder(DOMAIN))
    assert restored.held.states() == full.held.states()
    assert sum(sel.rejected.values()) >= len([k for k in bad if k != "out-of-order"])
    if cuts and not bad:
        assert sel.start == max(int(f * n) for f in cuts)  # only the tail after the last run is replayed
        assert restored.read == n - sel.start


def test_each_defect_is_detected_counted_and_never_used() -> None:
    evs = events(200, 3, 5)
    recs = snapshot_records(evs, 150)
    before = dict(REJECTED)
    for kind in KINDS:
        selector = Selector(IDENT, 0, 0, len(evs))
        bad_key, bad_value = junk(kind, evs, 150, random.Random(1))
        for offset, (key, value) in enumerate([*recs, (bad_key, bad_value)]):
            selector.feed(key, value, offset)
        sel = selector.result()
        assert sel.rejected == {kind: 1}, kind
        assert sel.bases[bad_key].offset == 150 and sel.bases[bad_key].state["owner"] != "forged"
        assert REJECTED[("account", kind)] == before.get(("account", kind), 0) + 1


def test_a_rejected_snapshot_without_fallback_means_full_replay_for_all() -> None:
    evs = events(100, 5, 4)
    bad_key, bad_value = junk("fingerprint", evs, 80, random.Random(2))
    recs = [r for r in snapshot_records(evs, 80) if r[0] != bad_key] + [(bad_key, bad_value)]
    selector = Selector(IDENT, 0, 0, len(evs))
    for key, value in recs:
        selector.feed(key, value)
    sel = selector.result()
    assert bad_key in sel.orphans and sel.start == 0
    restored = fold(evs, new_folder(DOMAIN, sel.bases))
    assert restored.held.states() == fold(evs, new_folder(DOMAIN)).held.states()


def test_an_event_the_fold_cannot_apply_stops_it_there_naming_it() -> None:
    """on_fold_error = "stop" (the default): the events before it are applied, then FoldError names the offset,
    aggregate and event type; nothing is skipped silently."""
    evs = events(50, 9, 3)
    broken = [(50, evs[0][1], orjson.dumps({"aggregate_id": evs[0][1].decode(), "version": 99, "type": "Nope",
                                            "payload": {}})), (51, evs[0][1], b"{not json")]
    folder = new_folder(DOMAIN, partition=3)
    with pytest.raises(FoldError, match=r"partition 3 offset 50 .*type 'Nope'.*unknown event type 'Nope'") as info:
        fold(evs + broken, folder)
    assert (info.value.offset, info.value.event_type, info.value.partition) == (50, "Nope", 3)
    assert folder.held.states() == fold(evs, new_folder(DOMAIN)).held.states()


def test_under_dead_letter_bad_events_are_parked_counted_and_the_rest_folds() -> None:
    evs = events(50, 9, 3)
    broken = [(50, evs[0][1], b"{not json"), (51, evs[0][1], orjson.dumps({"version": 99, "type": "Nope"}))]
    parking = dataclasses.replace(DOMAIN, on_fold_error=FoldErrorPolicy.DEAD_LETTER)
    folder = fold(evs + broken, new_folder(parking))
    assert folder.bad == 2 and folder.folded == 50
    assert [(p.offset, p.value) for p in folder.parked] == [(o, v) for o, _, v in broken]
    assert folder.held.states() == fold(evs, new_folder(DOMAIN)).held.states()


def test_duplicate_event_versions_are_not_folded_twice() -> None:
    evs = events(40, 4, 2)
    dup = [(40 + i, k, v) for i, (_, k, v) in enumerate(evs[-5:])]
    assert fold(evs + dup, new_folder(DOMAIN)).held.states() == fold(evs, new_folder(DOMAIN)).held.states()




@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 200), accounts=st.integers(1, 8), seed=st.integers(0, 10**6),
       cuts=st.lists(st.floats(0, 1), min_size=1, max_size=3),
       bad=st.lists(st.sampled_from(KINDS), max_size=4), listed=st.floats(0, 1), end_past=st.integers(0, 10))
def test_a_selection_settled_later_equals_one_that_knew_the_end(n: int, accounts: int, seed: int,
                                                                cuts: list[float], bad: list[str], listed: float,
                                                                end_past: int) -> None:
    """The plan reads snapshots while it probes the events' end, knowing only a lower bound of it (the end
    ListOffsets listed): records past that wait and are judged once the end is settled. Whatever the bound, the
    outcome is the selection made knowing the end from the start (bases, start, marker, orphans, rejections; an
    older snapshot seen after a deferred newer one is simply not chosen rather than counted out-of-order)."""
    evs = events(n, seed, accounts)
    recs = topic_records(evs, cuts, bad, random.Random(seed))
    end = n + end_past  # the probe may settle past the listed end (the end the fetch path reports)
    knowing, later = Selector(IDENT, 0, 0, end), Selector(IDENT, 0, 0, int(listed * n), end_final=False)
    for offset, (key, value) in enumerate(recs):
        knowing.feed(key, value, offset)
        later.feed(key, value, offset)
    expected, got = knowing.result(), later.settle(0, end).result()
    assert (got.bases, got.start, got.marker, got.orphans) == (expected.bases, expected.start, expected.marker,
                                                               expected.orphans)
    def judged(rejected: Counter[str]) -> dict[str, int]:
        return {reason: count for reason, count in rejected.items() if reason != "out-of-order"}
    assert judged(got.rejected) == judged(expected.rejected)


def test_a_selector_must_be_settled_before_its_result() -> None:
    with pytest.raises(RuntimeError, match="settle"):
        Selector(IDENT, 0, 0, 10, end_final=False).result()
