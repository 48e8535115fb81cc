"""Demo traffic for the bank example: valid account histories, decided and folded with the domain itself."""

from __future__ import annotations

import dataclasses
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


def events(rng: random.Random, accounts: int = 200) -> Iterator[tuple[str, int, str, dict[str, Any]]]:
    """(account id, version, event type, payload) for the commands the domain accepts, in order."""
    states: dict[str, tuple[bank.Account, int]] = {}
    for account_id, command in commands(rng, accounts):
        state, version = states.get(account_id, (bank.initial(), 0))
        if state.status == "new" and not isinstance(command, bank.OpenAccount):
            command = bank.OpenAccount(owner=f"owner of {account_id}")
        try:
            new = bank.decide(command, state)
        except bank.Rejected:
            continue
        for event in new:
            version += 1
            state = bank.evolve(state, event)
            yield account_id, version, type(event).__name__, dataclasses.asdict(event)
        states[account_id] = (state, version)
