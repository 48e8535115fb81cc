"""A trading book whose state holds what a float or a naive datetime would spoil: Decimals with exponents and more
digits than a float keeps, aware datetimes in several UTC offsets and one in a named time zone (Europe/Paris, moved
by wall-clock arithmetic across a DST change), tuples, frozen dataclasses nested in a tuple, in a dict and in each
other, and an integer beyond 64 bits. Its decide and evolve use those types as such (Decimal arithmetic, aware
datetimes compared across offsets, a zone's wall clock, a tuple concatenated, a nested dataclass's attributes, the
integer multiplied): a state read back as a float, a string, a naive datetime, a fixed offset for the zone, a list
or a dict fails or diverges at once. Pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

ZERO = Decimal("0")
RECENT = 4  # fills kept in the state, newest last
MAX_OPEN = timedelta(days=30)
PARIS = ZoneInfo("Europe/Paris")
SETTLE_STEP = timedelta(minutes=20)  # each fill moves the next settlement 20 minutes on Paris's wall clock


class Rejected(Exception):
    """A command the current state does not allow."""


@dataclass(frozen=True)
class Fill:
    asset: str
    qty: Decimal
    price: Decimal
    at: datetime


@dataclass(frozen=True)
class Position:
    qty: Decimal
    cost: Decimal
    since: datetime
    first: Fill


# ---- events -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BookOpened:
    at: datetime
    owner: str
    limits: tuple[Decimal, Decimal]


@dataclass(frozen=True)
class Filled:
    fill: Fill


@dataclass(frozen=True)
class BookClosed:
    at: datetime
    notional: Decimal


EVENT_TYPES: dict[str, type] = {c.__name__: c for c in (BookOpened, Filled, BookClosed)}


# ---- commands -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenBook:
    at: datetime
    owner: str
    low: Decimal
    high: Decimal


@dataclass(frozen=True)
class Trade:
    asset: str
    qty: Decimal
    price: Decimal
    at: datetime


@dataclass(frozen=True)
class CloseBook:
    at: datetime


COMMAND_TYPES: dict[str, type] = {c.__name__: c for c in (OpenBook, Trade, CloseBook)}


# ---- state --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Book:
    status: str = "new"
    opened_at: datetime | None = None
    closed_at: datetime | None = None
    limits: tuple[Decimal, Decimal] = (ZERO, ZERO)
    positions: dict[str, Position] = field(default_factory=dict)
    recent: tuple[Fill, ...] = ()
    span: tuple[datetime, datetime] | None = None  # first and last fill, each in its own offset
    notional: Decimal = ZERO
    settles_at: datetime | None = None  # in PARIS: its wall clock, hence its offset, moves with the zone's rules
    tally: int = 1  # grows past 64 bits after a few fills (a Python int has no bound): a float or a refusal spoils it


def initial() -> Book:
    return Book()


def evolve(state: Book, event: Any) -> Book:
    if isinstance(event, BookOpened):
        return replace(state, status="open", opened_at=event.at, limits=event.limits,
                       settles_at=event.at.astimezone(PARIS))
    if isinstance(event, Filled):
        f = event.fill
        held = state.positions.get(f.asset)
        pos = Position(f.qty, f.qty * f.price, f.at, f) if held is None else \
            replace(held, qty=held.qty + f.qty, cost=held.cost + f.qty * f.price)
        recent = (state.recent + (f,))[-RECENT:]  # noqa: RUF005  # a list read back for the tuple raises here
        return replace(state, positions={**state.positions, f.asset: pos}, recent=recent,
                       span=(state.span[0] if state.span else f.at, f.at), notional=state.notional + f.qty * f.price,
                       settles_at=state.settles_at + SETTLE_STEP if state.settles_at else None,
                       tally=state.tally * 1_000_003 + len(recent))
    if isinstance(event, BookClosed):
        return replace(state, status="closed", closed_at=event.at)
    raise TypeError(f"not a book event: {event!r}")


def decide(command: Any, state: Book) -> list[Any]:
    if isinstance(command, OpenBook):
        if state.status != "new":
            raise Rejected("book already opened")
        return [BookOpened(command.at, command.owner, (command.low, command.high))]
    if state.status != "open":
        raise Rejected(f"book is {state.status}")
    assert state.opened_at is not None
    if isinstance(command, Trade):
        if state.span is not None and command.at <= state.span[1]:  # instants compared across offsets
            raise Rejected(f"a fill at {command.at.isoformat()} is not after the last one")
        low, high = state.limits
        if not low <= command.price <= high:
            raise Rejected(f"price {command.price} outside [{low}, {high}]")
        return [Filled(Fill(command.asset, command.qty, command.price, command.at))]
    if isinstance(command, CloseBook):
        if command.at - state.opened_at > MAX_OPEN:
            raise Rejected("book expired")
        if not state.recent or state.recent[-1].at >= command.at:
            raise Rejected("nothing filled before the close")
        return [BookClosed(command.at, sum((p.cost for p in state.positions.values()), ZERO))]
    raise Rejected(f"unknown command {type(command).__name__}")
