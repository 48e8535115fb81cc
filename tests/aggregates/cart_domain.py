"""A shopping cart written the way Python developers write a domain: frozen dataclasses with a tuple, a datetime,
a Decimal and a nested dataclass. Its evolve and decide only work on those types (a tuple concatenated, a datetime
subtracted, Decimals added): a fold that hands them a list or a string diverges at once. Pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from enum import Enum
from typing import Any

MAX_OPEN = timedelta(days=2)  # a cart older than this cannot be checked out


class Rejected(Exception):
    """A command the current state does not allow."""


class Status(Enum):
    NEW = "new"
    OPEN = "open"
    CHECKED_OUT = "checked-out"


@dataclass(frozen=True)
class Line:
    sku: str
    price: Decimal


# ---- events -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CartOpened:
    opened_at: datetime


@dataclass(frozen=True)
class ItemsAdded:
    skus: tuple[str, ...]
    lines: tuple[Line, ...]
    note: str | None = None


@dataclass(frozen=True)
class CheckedOut:
    at: datetime
    total: Decimal


EVENT_TYPES: dict[str, type] = {c.__name__: c for c in (CartOpened, ItemsAdded, CheckedOut)}


# ---- commands -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenCart:
    at: datetime


@dataclass(frozen=True)
class AddItems:
    lines: tuple[Line, ...]
    note: str | None = None


@dataclass(frozen=True)
class CheckOut:
    at: datetime


COMMAND_TYPES: dict[str, type] = {c.__name__: c for c in (OpenCart, AddItems, CheckOut)}


# ---- state --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cart:
    status: Status = Status.NEW
    opened_at: datetime | None = None
    skus: tuple[str, ...] = ()
    total: Decimal = Decimal("0")
    last: Line | None = None


def initial() -> Cart:
    return Cart()


def evolve(state: Cart, event: Any) -> Cart:
    if isinstance(event, CartOpened):
        return replace(state, status=Status.OPEN, opened_at=event.opened_at)
    if isinstance(event, ItemsAdded):
        return replace(state, skus=state.skus + event.skus, total=state.total + sum(
            (line.price for line in event.lines), Decimal("0")), last=event.lines[-1])
    if isinstance(event, CheckedOut):
        return replace(state, status=Status.CHECKED_OUT)
    raise TypeError(f"not a cart event: {event!r}")


def decide(command: Any, state: Cart) -> list[Any]:
    if isinstance(command, OpenCart):
        if state.status is not Status.NEW:
            raise Rejected("cart already opened")
        return [CartOpened(command.at)]
    if state.status is not Status.OPEN:
        raise Rejected(f"cart is {state.status.value}")
    assert state.opened_at is not None
    if isinstance(command, AddItems):
        if not command.lines:
            raise Rejected("nothing to add")
        return [ItemsAdded(tuple(line.sku for line in command.lines), command.lines, command.note)]
    if isinstance(command, CheckOut):
        if command.at - state.opened_at > MAX_OPEN:
            raise Rejected("cart expired")
        if not state.skus:
            raise Rejected("cart is empty")
        return [CheckedOut(command.at, state.total)]
    raise Rejected(f"unknown command {type(command).__name__}")


# ---- a read model: one row per cart (a postgres-projection mapper; it reads today's ItemsAdded shape only) ----
def cart_row(row: dict[str, Any] | None, event: Any) -> dict[str, Any] | None:
    p = event.payload
    if event.type == "CartOpened":
        return {"status": "open", "skus": "", "lines": 0, "total": "0"}
    if row is None:
        raise ValueError(f"{event.type} before CartOpened")
    if event.type == "ItemsAdded":
        total = Decimal(row["total"]) + sum((Decimal(line["price"]) for line in p["lines"]), Decimal("0"))
        return {**row, "skus": ",".join(filter(None, [row["skus"], *p["skus"]])),
                "lines": row["lines"] + len(p["lines"]), "total": str(total)}
    if event.type == "CheckedOut":
        return {**row, "status": "checked-out"}
    raise ValueError(f"unknown event type {event.type}")
