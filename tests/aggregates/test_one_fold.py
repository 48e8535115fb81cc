"""Live = replay, for a domain with a tuple, a datetime, a Decimal, an Enum and a nested dataclass (cart_domain):
random command sequences decided live, and decided again with the states rebuilt at random points — by a replay
of the written events (the runtime's fold), by a snapshot run's fold, or through a snapshot's JSON — give the same
outcomes and the same states. And a field type that cannot read back is refused when the aggregate loads."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafold.codec import Codec
from kafold.config import AggregateConfig
from kafold.daemon.aggregates import recovery
from kafold.daemon.aggregates.processor import handle
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.domain import AggregateDomain
from kafold.errors import ConfigError
from kafold.messages import Command
from kafold.snapshot import fold as snapshot_fold

M = "tests.aggregates.cart_domain"
AGG = AggregateConfig(name="cart", initial=f"{M}:initial", evolve=f"{M}:evolve", decide=f"{M}:decide")
DOMAIN = AggregateDomain.load(AGG)
T0 = datetime(2026, 11, 1, 9, 0, tzinfo=UTC)

line = st.fixed_dictionaries({"sku": st.sampled_from(["a", "b", "c"]),
                              "price": st.decimals(min_value=0, max_value=500, places=2).map(str)})
command = st.one_of(
    st.tuples(st.just("OpenCart"), st.integers(0, 60).map(lambda m: {"at": (T0 + timedelta(minutes=m)).isoformat()})),
    st.tuples(st.just("AddItems"), st.fixed_dictionaries({"lines": st.lists(line, min_size=1, max_size=3)},
                                                         optional={"note": st.none() | st.text(max_size=5)})),
    st.tuples(st.just("CheckOut"), st.integers(0, 72).map(lambda h: {"at": (T0 + timedelta(hours=h)).isoformat()})))
plan = st.lists(st.tuples(st.sampled_from(["c1", "c2"]), command), min_size=1, max_size=25)
Rebuild = str  # "replay" | "snapshot-run" | "snapshot-json"


def _run(commands: list[tuple[str, tuple[str, dict[str, Any]]]], rebuilds: dict[int, Rebuild]
         ) -> tuple[list[tuple[str, str | None]], dict[str, Any]]:
    """Decide `commands` in order (the runtime's `handle`), rebuilding every state as `rebuilds` says before the
    command at that index; (outcomes, final states as JSON)."""
    entries: dict[str, Entry] = {}
    written: list[tuple[bytes, bytes]] = []
    outcomes: list[tuple[str, str | None]] = []
    for i, (cart, (kind, data)) in enumerate(commands):
        if i in rebuilds:
            entries = _rebuild(entries, written, rebuilds[i])
        entry = entries.get(cart) or Entry(DOMAIN.initial(), 0, 0)
        cmd = Command(f"cmd-{i}", kind, cart, data, "cart")
        out = handle(DOMAIN, cmd, entry, "2026-11-01T09:00:00Z", i, 10**12)
        assert out.error is None, out.error
        outcomes.append((out.result.status, out.result.reason))
        written += [(key, value) for key, value, _ in out.events]
        if out.events:
            entries[cart] = Entry(out.state, out.version, 0)
    return outcomes, {aid: DOMAIN.state_to_json(e.state) for aid, e in sorted(entries.items())}


def _rebuild(entries: dict[str, Entry], written: list[tuple[bytes, bytes]], how: Rebuild) -> dict[str, Entry]:
    offsets, keys, values = list(range(len(written))), [k for k, _ in written], [v for _, v in written]
    if how == "replay":  # the runtime after kill -9, an evicted aggregate reloaded, another instance taking over
        store = StateStore(1000)
        recovery.folder(DOMAIN, store, 0).fold(offsets, keys, values)
        return {aid: Entry(e.state, e.version, 0) for aid, e in store.entries.items()}
    if how == "snapshot-run":  # a snapshot run's fold, its states written as snapshot JSON, restored
        folder = snapshot_fold.folder(snapshot_fold.Domain.load(AGG))
        folder.fold(offsets, keys, values)
        restored = {aid: (DOMAIN.state_from_json(orjson.loads(orjson.dumps(DOMAIN.state_to_json(s)))), v)
                    for aid, (s, v) in folder.held.states().items()}
        return {aid: Entry(s, v, 0) for aid, (s, v) in restored.items()}
    return {aid: Entry(DOMAIN.state_from_json(orjson.loads(orjson.dumps(DOMAIN.state_to_json(e.state)))),
                       e.version, 0) for aid, e in entries.items()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(commands=plan, data=st.data())
def test_outcomes_and_states_are_the_same_whatever_rebuilds_happen(commands: list[Any], data: st.DataObject) -> None:
    live_outcomes, live_states = _run(commands, {})
    rebuilds = data.draw(st.dictionaries(st.integers(0, len(commands) - 1),
                                         st.sampled_from(["replay", "snapshot-run", "snapshot-json"]), max_size=4))
    outcomes, states = _run(commands, rebuilds)
    assert outcomes == live_outcomes
    assert states == live_states


def test_the_issues_sequence_after_a_replay() -> None:
    """Open, add ("a", "b"), kill -9 (a replay), add again, check out: accepted, with the typed state."""
    at = T0.isoformat()
    commands = [("c1", ("OpenCart", {"at": at})),
                ("c1", ("AddItems", {"lines": [{"sku": "a", "price": "1.10"}, {"sku": "b", "price": "2.20"}]})),
                ("c1", ("AddItems", {"lines": [{"sku": "c", "price": "0.05"}]})),
                ("c1", ("CheckOut", {"at": (T0 + timedelta(hours=1)).isoformat()}))]
    for rebuild in ("replay", "snapshot-run", "snapshot-json"):
        outcomes, states = _run(commands, {2: rebuild, 3: rebuild})
        assert [o[0] for o in outcomes] == ["accepted"] * 4, (rebuild, outcomes)
        assert list(states["c1"]["skus"]) == ["a", "b", "c"] and states["c1"]["total"] == "3.35"
        assert states["c1"]["status"] == "checked-out" and states["c1"]["opened_at"] == "2026-11-01T09:00:00Z"


class Money:  # no JSON form
    pass


@dataclasses.dataclass(frozen=True)
class Paid:
    amount: Money


@dataclasses.dataclass(frozen=True)
class Counted:
    by_day: dict[int, int]


def test_a_field_that_cannot_read_back_is_refused_when_the_aggregate_loads() -> None:
    with pytest.raises(ConfigError) as info:
        Codec("cart", {"Paid": Paid, "Counted": Counted}, {})
    text = "\n".join(info.value.problems)
    assert "EVENT_TYPES['Paid']: " in text and "Paid.amount: " in text and "Money has no JSON form" in text
    assert "Counted.by_day: a dict whose keys are not strings" in text


def test_typed_events_and_commands_round_trip_exactly() -> None:
    from tests.aggregates.cart_domain import AddItems, CheckedOut, ItemsAdded, Line

    event = ItemsAdded(("a", "b"), (Line("a", Decimal("1.10")), Line("b", Decimal("2"))), None)
    name, payload = DOMAIN.codec.payload(event)
    assert DOMAIN.event(name, orjson.loads(orjson.dumps(payload))) == event
    out = CheckedOut(T0, Decimal("3.10"))
    assert DOMAIN.event(*DOMAIN.codec.payload(out)) == out
    cmd = DOMAIN.command("AddItems", {"lines": [{"sku": "a", "price": "1.10"}]})
    assert cmd == AddItems((Line("a", Decimal("1.10")),))


@dataclasses.dataclass(frozen=True)
class Flat:
    name: str
    n: int
    x: float
    ok: bool
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class Nested:
    line: tuple[str, ...]


def test_an_event_is_evolved_as_is_only_when_it_reads_back_equal() -> None:
    """The runtime skips decoding what it writes only for flat events holding exactly their fields' types; for
    every such event here the read-back equals it, and every other one is read back."""
    codec = Codec("t", {"Flat": Flat, "Nested": Nested}, {})
    as_is = [Flat("a", 1, 1.5, True), Flat("a", 1, 1.5, True, "n")]
    read_back = [Flat("a", 1, 1, True),          # an int in a float field comes back 1.0
                 Flat("a", True, 1.0, True),      # a bool in an int field
                 Flat("a", 1, float("nan"), True),  # JSON has no NaN
                 Flat("a", 1, 1.0, 1),            # an int in a bool field
                 Nested(("a",))]                  # not flat
    for event in as_is:
        name, payload, same = codec.written(event)
        assert same and (name, payload) == codec.payload(event)
        assert codec.event(name, orjson.loads(orjson.dumps(payload))) == event
    for event in read_back:
        assert codec.written(event) == (*codec.payload(event), False)
