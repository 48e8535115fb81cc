"""The bank domain's own tests, written as a service's team would: kafold.testing loads the `account` aggregate from
kafold.toml as the daemon does, and each scenario is given events, when a command, then events or a rejection."""

from __future__ import annotations

from pathlib import Path

import pytest
from bank_domain import (
    Account,
    AccountClosed,
    AccountOpened,
    CloseAccount,
    Deposit,
    MoneyDeposited,
    MoneyWithdrawn,
    OpenAccount,
    Withdraw,
)

from kafold.testing import DomainFixture

CONFIG = Path(__file__).resolve().parents[1] / "kafold.toml"


@pytest.fixture(scope="module")
def accounts() -> DomainFixture:
    return DomainFixture.from_config(CONFIG, "account", aggregate_id="acc-1")


def test_open_deposit_withdraw(accounts: DomainFixture) -> None:
    accounts.given().when(OpenAccount("ann")).then(AccountOpened("ann", "EUR"))
    (accounts.given(AccountOpened("ann"), MoneyDeposited(500))
     .when(Withdraw(200))
     .then(MoneyWithdrawn(200))
     .then_state(Account("open", "ann", "EUR", 300)))


def test_business_rules(accounts: DomainFixture) -> None:
    accounts.given(AccountOpened("ann")).when(OpenAccount("bob")).then_rejected("already exists")
    accounts.given(AccountOpened("ann"), MoneyDeposited(100)).when(Withdraw(101)).then_rejected("insufficient funds")
    accounts.given(AccountOpened("ann"), MoneyDeposited(1)).when(CloseAccount()).then_rejected("balance must be zero")
    accounts.given(AccountOpened("ann"), AccountClosed()).when(Deposit(5)).then_rejected("account is closed")


def test_a_command_a_client_could_not_send(accounts: DomainFixture) -> None:
    accounts.given(AccountOpened("ann")).when("Deposit", {"amount": "ten"}).then_refused("invalid-command")
