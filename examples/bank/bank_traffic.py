"""Demo traffic for the bank example: a stream of account commands, most of which the domain accepts."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import bank_domain as bank


def commands(rng: random.Random, accounts: int = 200) -> Iterator[tuple[str, Any]]:
    """An endless stream of (account id, command) that mostly succeed: open, deposit, withdraw, close."""
    ids = [f"acc-{i:05d}" for i in range(accounts)]
    while True:
        account_id = rng.choice(ids)
        roll = rng.random()
        if roll < 0.55:
            yield account_id, bank.Deposit(amount=rng.randint(1, 500) * 100)
        elif roll < 0.9:
            yield account_id, bank.Withdraw(amount=rng.randint(1, 300) * 100)
        elif roll < 0.99:
            yield account_id, bank.OpenAccount(owner=f"owner of {account_id}")
        else:
            yield account_id, bank.CloseAccount(reason="demo")
