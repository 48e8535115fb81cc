"""Demo traffic for the bank example: a believable bank, whose commands the domain mostly accepts.

The generator keeps the book it believes in (each account it opened and its balance): it opens accounts before using
them, deposits, withdraws within the balance, and empties an account before closing it, so its commands succeed; a
small share of them are deliberate mistakes (an overdraft, a deposit to a closed account, an account opened twice,
a withdrawal from an account nobody opened) to show what a refusal looks like. The book stays true as long as the
commands of one account are decided in the order they were sent (one key, one partition) from a fresh account:
the account names carry a token drawn per generator, so a dev stack kept from an earlier run holds none of them.
"""

from __future__ import annotations

import random
import secrets
from collections import deque
from collections.abc import Iterator
from typing import Any

import bank_domain as bank

REFUSALS = 0.04  # the share of commands meant to be refused


def commands(rng: random.Random, accounts: int = 200, refusals: float = REFUSALS,
             prefix: str | None = None) -> Iterator[tuple[str, Any]]:
    """An endless stream of (account id, command): up to `accounts` open accounts at a time, about `refusals` of
    the commands refused by the domain (on purpose), the rest accepted."""
    prefix = f"acc-{secrets.token_hex(2)}-" if prefix is None else prefix
    book: dict[str, int] = {}  # open account -> the balance it has once the commands sent so far are decided
    ids: list[str] = []  # book's accounts, to draw from
    closed: deque[str] = deque(maxlen=100)  # recently closed accounts, for a deposit refused as too late
    opened = 0
    while True:
        if rng.random() < refusals:
            yield _mistake(rng, book, ids, closed, f"{prefix}{opened + 1_000_000:07d}")
            continue
        if not book or (len(book) < accounts and rng.random() < 0.05):
            account_id = f"{prefix}{opened:05d}"
            opened += 1
            book[account_id] = 0
            ids.append(account_id)
            yield account_id, bank.OpenAccount(owner=f"owner of {account_id}")
            continue
        account_id = rng.choice(ids)
        balance, roll = book[account_id], rng.random()
        if balance < 100 or roll < 0.5:
            amount = rng.randint(1, 500) * 100
            book[account_id] = balance + amount
            yield account_id, bank.Deposit(amount=amount)
        elif roll < 0.995 or len(book) < 10:
            amount = rng.randint(1, balance // 100) * 100
            book[account_id] = balance - amount
            yield account_id, bank.Withdraw(amount=amount)
        else:  # the customer leaves: the account is emptied, then closed
            if balance:
                yield account_id, bank.Withdraw(amount=balance)
            del book[account_id]
            ids.remove(account_id)
            closed.append(account_id)
            yield account_id, bank.CloseAccount(reason="customer left")


def _mistake(rng: random.Random, book: dict[str, int], ids: list[str], closed: deque[str],
             unknown: str) -> tuple[str, Any]:
    """A command the domain refuses, which changes no balance: an overdraft mostly, now and then another kind."""
    roll = rng.random()
    if closed and roll < 0.15:
        return rng.choice(closed), bank.Deposit(amount=rng.randint(1, 50) * 100)
    if ids and roll < 0.25:
        account_id = rng.choice(ids)
        return account_id, bank.OpenAccount(owner=f"owner of {account_id}")
    if not ids or roll < 0.3:
        return unknown, bank.Withdraw(amount=100)
    account_id = rng.choice(ids)
    return account_id, bank.Withdraw(amount=book[account_id] + rng.randint(1, 200) * 100)
