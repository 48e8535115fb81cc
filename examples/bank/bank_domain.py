"""The bank example domain: accounts that open, take deposits and withdrawals, and close. Pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import singledispatch
from typing import Any


class Rejected(Exception):
    """A command the current state does not allow; the reason goes back to the caller."""


# ---- events (what happened) -------------------------------------------------------------------
@dataclass(frozen=True)
class AccountOpened:
    owner: str
    currency: str = "EUR"


@dataclass(frozen=True)
class MoneyDeposited:
    amount: int  # minor units (cents)


@dataclass(frozen=True)
class MoneyWithdrawn:
    amount: int


@dataclass(frozen=True)
class AccountClosed:
    reason: str = ""


EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (AccountOpened, MoneyDeposited, MoneyWithdrawn, AccountClosed)
}


# ---- commands (what is asked) -----------------------------------------------------------------
@dataclass(frozen=True)
class OpenAccount:
    owner: str
    currency: str = "EUR"


@dataclass(frozen=True)
class Deposit:
    amount: int


@dataclass(frozen=True)
class Withdraw:
    amount: int


@dataclass(frozen=True)
class CloseAccount:
    reason: str = ""


COMMAND_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (OpenAccount, Deposit, Withdraw, CloseAccount)
}


# ---- state --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Account:
    status: str = "new"  # new | open | closed
    owner: str = ""
    currency: str = "EUR"
    balance: int = 0


def initial() -> Account:
    return Account()


def evolve(state: Account, event: Any) -> Account:
    """The fold: pure and total over EVENT_TYPES."""
    return _apply(event, state)


@singledispatch
def _apply(event: Any, state: Account) -> Account:
    raise TypeError(f"unknown event {type(event).__name__}")


@_apply.register
def _(event: AccountOpened, state: Account) -> Account:
    return replace(state, status="open", owner=event.owner, currency=event.currency)


@_apply.register
def _(event: MoneyDeposited, state: Account) -> Account:
    return replace(state, balance=state.balance + event.amount)


@_apply.register
def _(event: MoneyWithdrawn, state: Account) -> Account:
    return replace(state, balance=state.balance - event.amount)


@_apply.register
def _(event: AccountClosed, state: Account) -> Account:
    return replace(state, status="closed")


def decide(command: Any, state: Account) -> list[Any]:
    """The events a command yields in this state, or Rejected with the reason."""
    return _handle(command, state)


@singledispatch
def _handle(command: Any, state: Account) -> list[Any]:
    raise Rejected(f"unknown command {type(command).__name__}")


@_handle.register
def _(command: OpenAccount, state: Account) -> list[Any]:
    if state.status != "new":
        raise Rejected("account already exists")
    if not command.owner:
        raise Rejected("owner is required")
    return [AccountOpened(owner=command.owner, currency=command.currency)]


@_handle.register
def _(command: Deposit, state: Account) -> list[Any]:
    _require_open(state)
    if command.amount <= 0:
        raise Rejected("amount must be positive")
    return [MoneyDeposited(amount=command.amount)]


@_handle.register
def _(command: Withdraw, state: Account) -> list[Any]:
    _require_open(state)
    if command.amount <= 0:
        raise Rejected("amount must be positive")
    if command.amount > state.balance:
        raise Rejected(f"insufficient funds: balance {state.balance}, asked {command.amount}")
    return [MoneyWithdrawn(amount=command.amount)]


@_handle.register
def _(command: CloseAccount, state: Account) -> list[Any]:
    _require_open(state)
    if state.balance != 0:
        raise Rejected("balance must be zero to close")
    return [AccountClosed(reason=command.reason)]


def _require_open(state: Account) -> None:
    if state.status != "open":
        raise Rejected(f"account is {state.status}")
