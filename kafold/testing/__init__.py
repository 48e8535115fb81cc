"""kafold.testing: given/when/then for a domain (`kafold.testing.domain`, with the core install) and the contract
every sink connector passes (`kafold.testing.contract`, with kafold[daemon]). Both sets of names import from here; the
contract's are loaded on first use, so a domain's tests never import the daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kafold.testing.domain import DomainFixture, Stored, Then

if TYPE_CHECKING:
    from kafold.testing.contract import (
        LocalContext,
        SinkTaskContract,
        committed,
        create_topic,
        free_port,
        make_event,
        new_producer,
        produce,
        wait_for,
    )

CONTRACT = ("LocalContext", "SinkTaskContract", "committed", "create_topic", "free_port", "make_event",
            "new_producer", "produce", "wait_for")
__all__ = ["DomainFixture", "LocalContext", "SinkTaskContract", "Stored", "Then", "committed", "create_topic",
           "free_port", "make_event", "new_producer", "produce", "wait_for"]


def __getattr__(name: str) -> Any:
    if name in CONTRACT:
        from kafold.testing import contract  # the daemon's runner and Kafka: only when a contract name is used

        return getattr(contract, name)
    raise AttributeError(f"module 'kafold.testing' has no attribute {name!r}")
