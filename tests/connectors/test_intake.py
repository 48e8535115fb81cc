"""The one intake of sink connectors (connectors/intake.py): a record in yesterday's shape reaches the task in
today's, an upcaster that raises becomes a dead letter (`upcast-failed`) naming type, version and connector, and the
unknown-type policy applies to the upcast type."""

from __future__ import annotations

import pytest

from kafold.connectors.intake import Intake
from kafold.envelope import Event, encode
from kafold.errors import FatalError, RecordError, UnknownTypeError
from kafold.upcast import UpcasterConfig, build

UP = build([UpcasterConfig(type="FundsAdded", rename_type="MoneyDeposited", rename_fields={"amt": "amount"}),
            UpcasterConfig(type="Moved", split_on="kind", split_types={"home": "HomeMoved"})], "connectors[0]")


class Msg:
    def __init__(self, event: Event) -> None:
        self._key, self._value, self._headers = encode(event)

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)


def _intake(on_unknown: str = "dead-letter") -> Intake:
    return Intake("accounts", {"MoneyDeposited", "AccountOpened"}.__contains__, on_unknown, UP)


def test_a_record_in_yesterdays_shape_reaches_the_task_in_todays() -> None:
    old = Event.new("FundsAdded", "account", "a1", 2, {"amt": 5}, causation_id="c1")
    record = _intake().record(Msg(old), "t", 0, 7)
    assert record is not None
    event = record.event
    assert (event.type, event.schema_version, event.payload) == ("MoneyDeposited", 2, {"amount": 5})
    assert (event.event_id, event.version, event.causation_id, event.occurred_at) == \
        (old.event_id, 2, "c1", old.occurred_at)
    today = Event.new("MoneyDeposited", "account", "a1", 3, {"amount": 1}, schema_version=2)
    assert _intake().record(Msg(today), "t", 0, 8).event == today  # type: ignore[union-attr]  # as stored


def test_a_failing_upcaster_is_a_dead_letter_naming_type_version_and_connector() -> None:
    bad = Event.new("Moved", "account", "a1", 2, {"kind": "car"})
    with pytest.raises(RecordError) as info:
        _intake().record(Msg(bad), "t", 0, 9)
    assert info.value.reason == "upcast-failed"
    assert "connector 'accounts': upcasting Moved v1 failed: ValueError: kind='car'" in str(info.value)


def test_the_unknown_type_policy_applies_to_the_upcast_type() -> None:
    moved = Event.new("Moved", "account", "a1", 2, {"kind": "home"})
    assert _intake("skip").record(Msg(moved), "t", 0, 1) is None
    with pytest.raises(UnknownTypeError, match="unknown event type 'HomeMoved'"):
        _intake("dead-letter").record(Msg(moved), "t", 0, 1)
    with pytest.raises(FatalError, match="'HomeMoved'"):
        _intake("fail").record(Msg(moved), "t", 0, 1)


def test_an_event_the_connector_does_not_handle_is_never_decrypted_but_an_upcast_one_is_before_its_steps() -> None:
    """Protected fields are opened only for events the connector takes: a type it skips (with no upcaster step
    that could make it one it handles) is decided before any decryption; a type upcast to a handled one is
    opened first, its steps reading the clear payload."""
    opened: list[str] = []

    def decrypt(event: Event, _raw: object) -> Event:
        opened.append(event.type)
        return event

    intake = Intake("accounts", {"MoneyDeposited"}.__contains__, "skip", UP, decrypt=decrypt)
    assert intake.record(Msg(Event.new("CustomerRegistered", "account", "a1", 1, {"email": "x"})), "t", 0, 1) is None
    assert intake.record(Msg(Event.new("FundsAdded", "account", "a1", 2, {"amt": 5})), "t", 0, 2) is not None
    assert intake.record(Msg(Event.new("Moved", "account", "a1", 3, {"kind": "home"})), "t", 0, 3) is None
    assert opened == ["FundsAdded", "Moved"]  # Moved has a step (to HomeMoved, not handled): opened, then skipped
    dead = Intake("accounts", {"MoneyDeposited"}.__contains__, "dead-letter", UP, decrypt=decrypt)
    with pytest.raises(UnknownTypeError):
        dead.record(Msg(Event.new("CustomerRegistered", "account", "a1", 4, {"email": "x"})), "t", 0, 4)
    assert opened == ["FundsAdded", "Moved"]
