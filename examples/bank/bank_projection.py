"""The `accounts` read model of the bank example: a pure row fold used by the postgres-projection connector."""

from __future__ import annotations

from typing import Any

from kafold.envelope import Event


def account_row(row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
    """The account's row after `event` (the connector dedups by event id and guards by version)."""
    p = event.payload
    if event.type == "AccountOpened":
        return {"owner": p["owner"], "currency": p.get("currency", "EUR"), "balance": 0, "status": "open",
                "opened_at": event.occurred_at, "updated_at": event.occurred_at}
    if row is None:  # an event for an account whose opening this projection never saw
        raise ValueError(f"{event.type} before AccountOpened")
    if event.type == "MoneyDeposited":
        return {**row, "balance": row["balance"] + p["amount"], "updated_at": event.occurred_at}
    if event.type == "MoneyWithdrawn":
        return {**row, "balance": row["balance"] - p["amount"], "updated_at": event.occurred_at}
    if event.type == "AccountClosed":
        return {**row, "status": "closed", "updated_at": event.occurred_at}
    raise ValueError(f"unknown event type {event.type}")
