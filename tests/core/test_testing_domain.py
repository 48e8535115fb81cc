"""kafold.testing's given/when/then on the cart domain (datetime, tuple, Decimal, enum, nested dataclasses): the
same codec, upcasters and decision as the daemon, so what production would get wrong fails here. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from kafold.errors import ConfigError
from kafold.testing import DomainFixture, Stored
from tests.aggregates import cart_domain as cart
from tests.aggregates.cart_domain import AddItems, CartOpened, CheckedOut, CheckOut, ItemsAdded, Line, OpenCart
from tests.support import ROOT

T0 = datetime(2026, 12, 5, 9, 30, tzinfo=UTC)
LINES = (Line("apple", Decimal("1.10")), Line("pear", Decimal("2.25")))


@pytest.fixture
def carts() -> DomainFixture:
    return DomainFixture.of("cart", cart.initial, cart.evolve, cart.decide)


def test_given_when_then_events(carts: DomainFixture) -> None:
    carts.given().when(OpenCart(T0)).then(CartOpened(T0))
    carts.given(CartOpened(T0)).when(AddItems(LINES, "gift")).then(ItemsAdded(("apple", "pear"), LINES, "gift"))
    (carts.given(CartOpened(T0), ItemsAdded(("apple", "pear"), LINES))
     .when(CheckOut(T0 + timedelta(hours=1)))
     .then(CheckedOut(T0 + timedelta(hours=1), Decimal("3.35")))
     .then_state(cart.Cart(cart.Status.CHECKED_OUT, T0, ("apple", "pear"), Decimal("3.35"), LINES[-1])))


def test_a_command_as_json_reads_through_the_codec(carts: DomainFixture) -> None:
    carts.given(CartOpened(T0)).when("AddItems", {"lines": [{"sku": "fig", "price": "0.40"}]}).then(
        ItemsAdded(("fig",), (Line("fig", Decimal("0.40")),)))


def test_rejections_and_defects_are_told_apart(carts: DomainFixture) -> None:
    carts.given(CartOpened(T0)).when(CheckOut(T0)).then_rejected("cart is empty")
    carts.given(CartOpened(T0)).when(CheckOut(T0 + timedelta(days=3))).then_rejected("expired")
    carts.given().when("AddItems", {"lines": [], "colour": "red"}).then_refused("invalid-command")
    carts.given().when("Teleport", {}).then_refused("unknown-type")
    with pytest.raises(AssertionError, match="rejected: cart is empty"):
        carts.given(CartOpened(T0)).when(CheckOut(T0)).then(CheckedOut(T0, Decimal("0")))
    with pytest.raises(AssertionError, match="refused as a defect"):
        carts.given().when("Teleport", {}).then_rejected()
    with pytest.raises(AssertionError, match="accepted with 1 event"):
        carts.given().when(OpenCart(T0)).then_rejected()


def test_a_mismatch_names_both_sides(carts: DomainFixture) -> None:
    with pytest.raises(AssertionError, match=r"expected \[CartOpened.*\n  got +\[CartOpened"):
        carts.given().when(OpenCart(T0)).then(CartOpened(T0 + timedelta(seconds=1)))


def test_stored_events_of_an_older_shape_read_through_the_upcasters() -> None:
    fixture = DomainFixture.of("cart", cart.initial, cart.evolve, cart.decide, upcasters=[
        {"type": "ItemsAdded", "from_version": 1, "rename_fields": {"items": "lines"}, "add_fields": {"note": None}}])
    v1 = Stored("ItemsAdded", {"skus": ["apple"], "items": [{"sku": "apple", "price": "1.10"}]}, schema_version=1)
    (fixture.given(CartOpened(T0), v1).when(CheckOut(T0))
     .then(CheckedOut(T0, Decimal("1.10"))))
    # without the upcaster the old shape does not read, as in the daemon
    plain = DomainFixture.of("cart", cart.initial, cart.evolve, cart.decide)
    with pytest.raises(Exception, match="lines"):
        plain.given(CartOpened(T0), v1)


@dataclass(frozen=True)
class Counted:
    n: int


EVENT_TYPES: dict[str, type] = {"Counted": Counted}


def initial() -> int:
    return 0


def evolve(state: int, event: Counted) -> int:
    return state + event.n


def decide(command: dict[str, Any], state: int) -> list[Any]:
    return [Counted(command["n"])]  # a str passes through here unnoticed when decide is called directly


def test_an_event_the_daemon_could_not_store_is_a_defect_here() -> None:
    fixture = DomainFixture.of("counter", initial, evolve, decide)
    assert decide({"n": "5"}, 0) == [Counted("5")]  # type: ignore[arg-type]  # the direct call does not see it
    fixture.given().when("Count", {"n": "5"}).then_refused("bad-event")
    fixture.given(Counted(2)).when("Count", {"n": 3}).then(Counted(3)).then_state(5)


def test_from_config_loads_the_aggregate_as_the_daemon_does() -> None:
    bank = DomainFixture.from_config(ROOT / "examples" / "bank" / "kafold.toml", "account")
    assert bank.domain.fingerprint.startswith("auto-")
    with pytest.raises(ConfigError, match="no \\[\\[aggregates\\]\\] entry named 'nope'"):
        DomainFixture.from_config(ROOT / "examples" / "bank" / "kafold.toml", "nope")
