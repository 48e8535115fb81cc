"""A dataclass state's JSON form (kafold.domain's default state_to_json / state_from_json, what the local state store,
the snapshot topic and `kafold state get` hold) reads back as the very state: Decimals with their digits and
exponent, aware datetimes with their offset, a datetime in a named zone with its zone (and its fold in the hour a
DST change repeats), nested dataclasses in tuples and dicts; the evolve that follows a read-back equals the one that
follows the state itself."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple, TypedDict
from zoneinfo import ZoneInfo

import msgspec

from kafold.config import AggregateConfig
from kafold.daemon.aggregates.local import LocalStates
from kafold.daemon.aggregates.store import Entry
from kafold.domain import AggregateDomain
from kafold.state_json import StateJson
from tests.aggregates import book_domain as bd
from tests.aggregates.agg_support import BANK, bank_config, bank_domain
from tests.aggregates.test_rich_state_daemon import same

M = "tests.aggregates.book_domain"
AGG = AggregateConfig(name="book", initial=f"{M}:initial", evolve=f"{M}:evolve", decide=f"{M}:decide")
T0 = datetime(2024, 10, 27, 0, 30, tzinfo=UTC)  # 02:30 in Paris, half an hour before its clocks go back


def _stored(domain: AggregateDomain, state: object) -> object:
    """`state` written as the store writes it (JSON bytes) and read back."""
    return domain.state_from_json(msgspec.json.decode(msgspec.json.encode(domain.state_to_json(state))))


def _book(domain: AggregateDomain) -> bd.Book:
    state = domain.evolve(domain.initial(), bd.BookOpened(T0.astimezone(timezone(timedelta(hours=5, minutes=30))),
                                                          "ann", (Decimal("1E-9"), Decimal("1E+13"))))
    fill = bd.Fill("a0", Decimal("2.5E-7"), Decimal("1234567890.123456789012345"), T0 + timedelta(minutes=5))
    return domain.evolve(state, bd.Filled(fill))


def test_a_zoned_state_read_back_evolves_as_the_state_itself() -> None:
    domain = AggregateDomain.load(AGG)
    state = _book(domain)
    assert state.settles_at is not None and state.settles_at.tzinfo is bd.PARIS
    back = _stored(domain, state)
    assert same(back, state) is None and back.settles_at.tzinfo == bd.PARIS  # type: ignore[attr-defined]
    fill = bd.Fill("a1", Decimal("-4.10"), Decimal("0.000000000000000000123"), T0 + timedelta(minutes=9))
    for _ in range(3):  # across 03:00 CEST -> 02:00 CET: the zone's offset changes, a fixed +02:00 would not
        state, back = domain.evolve(state, bd.Filled(fill)), domain.evolve(back, bd.Filled(fill))
    assert state.settles_at is not None and state.settles_at.utcoffset() == timedelta(hours=1)
    assert same(back, state) is None
    assert domain.state_to_json(back) == domain.state_to_json(state)


def test_datetimes_keep_zone_fold_and_second_offsets_and_plain_ones_keep_msgspec_text() -> None:
    domain = AggregateDomain.load(AGG)
    paris = ZoneInfo("Europe/Paris")
    cases = [datetime(2024, 10, 27, 2, 30, tzinfo=paris, fold=f) for f in (0, 1)]  # the hour that happens twice
    cases += [datetime(1890, 1, 1, 12, tzinfo=paris),  # local mean time: +00:09:21
              datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=5, minutes=30, seconds=15))),
              datetime(2024, 5, 1, 12, tzinfo=ZoneInfo("UTC"))]
    for at in cases:
        state = dataclasses.replace(domain.initial(), opened_at=at, settles_at=at, span=(at, at))
        back = _stored(domain, state)
        assert same(back, state) is None, at
        assert back.settles_at.tzinfo == at.tzinfo and back.settles_at.fold == at.fold  # type: ignore[attr-defined]
    plain = [datetime(2024, 5, 1, 12, tzinfo=UTC), datetime(2024, 5, 1, 12, tzinfo=timezone(-timedelta(hours=3))),
             datetime(2024, 5, 1, 12)]
    for at in plain:  # offsets of whole minutes and naive datetimes: RFC 3339 as before, nothing added
        text = domain.state_to_json(dataclasses.replace(domain.initial(), opened_at=at))["opened_at"]
        assert text == msgspec.to_builtins(at) and same(_stored(domain, dataclasses.replace(
            domain.initial(), opened_at=at)), dataclasses.replace(domain.initial(), opened_at=at)) is None
    assert domain.state_to_json(dataclasses.replace(domain.initial(), settles_at=cases[1]))["settles_at"] == \
        "2024-10-27T02:30:00+01:00[Europe/Paris]"


class Slot(NamedTuple):
    n: int
    at: datetime


class Stamp(TypedDict):
    at: datetime


@dataclasses.dataclass(frozen=True)
class Node:
    at: datetime
    children: tuple[Node, ...] = ()
    by_name: dict[str, list[datetime]] = dataclasses.field(default_factory=dict)
    pair: tuple[int, datetime | None] = (0, None)
    slot: Slot | None = None
    stamps: tuple[Stamp, ...] = ()


def test_zones_are_kept_through_recursive_types_lists_dicts_and_unions_and_no_datetime_costs_nothing() -> None:
    paris, tokyo = ZoneInfo("Europe/Paris"), ZoneInfo("Asia/Tokyo")
    leaf = Node(datetime(2024, 10, 27, 2, 30, fold=1, tzinfo=paris),
                by_name={"t": [datetime(2024, 1, 1, tzinfo=tokyo)]})
    root = Node(T0, (leaf, Node(T0)), {"p": [T0, datetime(2024, 3, 31, 3, 30, tzinfo=paris)]},
                (7, datetime(2024, 6, 1, tzinfo=tokyo)), Slot(1, datetime(2024, 2, 1, tzinfo=tokyo)),
                (Stamp(at=datetime(2024, 2, 2, tzinfo=paris)),))
    form = StateJson(Node)
    data = msgspec.json.decode(msgspec.json.encode(form.to_json(root)))
    assert data["children"][0]["at"] == "2024-10-27T02:30:00+01:00[Europe/Paris]"
    assert same(form.from_json(data), root) is None
    assert form.to_json(Node(T0)) == msgspec.to_builtins(Node(T0))  # nothing zoned: msgspec's own form
    assert StateJson(bd.Fill).check is not None and StateJson(bd.Fill).mark is not None
    assert StateJson(Plain).check is None and StateJson(Plain).mark is None


@dataclasses.dataclass(frozen=True)
class Plain:
    amount: Decimal
    names: tuple[str, ...]


def test_the_local_store_keeps_a_book_and_an_int_beyond_64_bits(tmp_path: Path) -> None:
    """The local store's records read back as the state written: a zoned book, and an int no 64-bit JSON codec
    holds (a balance summed past 2**64 by evolve: orjson refused to write it after the commit, and read such a
    number back as a float)."""
    rich = dataclasses.replace(bank_domain(bank_config("big")).initial(), status="open", balance=3 * 2**63 + 1)
    for agg, state in ((AGG, _book(AggregateDomain.load(AGG))), (bank_config("big"), rich)):
        domain = AggregateDomain.load(agg, [str(BANK)])
        local = LocalStates(tmp_path / agg.name, domain, agg.state_schema_version, 86_400_000)
        local.open(0, 0, 0)
        local.committed({0: [("x", Entry(state, 3, 0), [])]}, {0: 1}, cutoff=0)
        loaded = local.load(0, "x")
        assert loaded is not None and same(loaded.state, state) is None and loaded.version == 3
        local.close_all()
