"""The folder names the stage an event failed in (kafold.stages), and the dead-letter reasons derived from the stages
are the ones users have always seen. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kafold.config import FoldErrorPolicy
from kafold.envelope import Event, encode
from kafold.fold import Folder, FoldError
from kafold.stages import Stage, deciding_reason, folding_reason
from kafold.upcast import UpcastError


@dataclass
class Entry:
    state: Any = None
    version: int = 0
    covered: int = 0


@dataclass
class Kernel:
    """A domain whose event reader and evolve fail as told."""

    event_fails: BaseException | None = None
    evolve_fails: BaseException | None = None
    unseal: Any = None
    on_fold_error: FoldErrorPolicy = FoldErrorPolicy.STOP

    def evolve(self, state: Any, event: Any) -> Any:
        if self.evolve_fails is not None:
            raise self.evolve_fails
        return event

    def event(self, type_name: str, payload: dict[str, Any], schema_version: int = 1) -> Any:
        if self.event_fails is not None:
            raise self.event_fails
        return payload


@dataclass
class States:
    entries: dict[str, Entry] = field(default_factory=dict)

    def new(self, aggregate_id: str) -> Entry:
        return Entry()

    def add(self, aggregate_id: str, entry: Entry) -> None:
        self.entries[aggregate_id] = entry

    def thaw(self, entry: Entry) -> Any:
        return entry.state

    def note(self, *args: Any) -> None:
        return None


KEY, VALUE, _ = encode(Event.new("Moved", "customer", "c-1", 1, {"to": "x"}))


def stage_of(kernel: Kernel, key: bytes | None = KEY, value: bytes | None = VALUE) -> Stage:
    with pytest.raises(FoldError) as e:
        Folder(kernel, States(), partition=0).fold([7], [key], [value])
    return e.value.stage


def test_an_event_with_no_key_or_no_body_fails_in_decode() -> None:
    assert stage_of(Kernel(), key=None) is Stage.DECODE
    assert stage_of(Kernel(), value=b"not json") is Stage.DECODE


def test_an_upcaster_failure_fails_in_upcast() -> None:
    assert stage_of(Kernel(event_fails=UpcastError("Moved", 1, ValueError("no")))) is Stage.UPCAST


def test_a_payload_todays_class_refuses_fails_in_read() -> None:
    assert stage_of(Kernel(event_fails=TypeError("missing field"))) is Stage.READ


def test_opening_protected_fields_fails_in_read() -> None:
    def unseal(type_name: str, aid: str, payload: Any) -> Any:
        raise ValueError("no key")
    assert stage_of(Kernel(unseal=unseal)) is Stage.READ


def test_evolve_raising_fails_in_fold() -> None:
    assert stage_of(Kernel(evolve_fails=KeyError("x"))) is Stage.FOLD


def test_a_parked_event_keeps_its_stage_and_logs_it() -> None:
    folder = Folder(Kernel(evolve_fails=KeyError("x"), on_fold_error=FoldErrorPolicy.DEAD_LETTER), States())
    folder.fold([7], [KEY], [VALUE])
    assert folder.parked[0].error.stage is Stage.FOLD
    assert folder.parked[0].error.fields()["stage"] == "fold"


def test_the_dead_letter_reasons_stay_what_users_have_seen() -> None:
    assert [deciding_reason(s) for s in (Stage.DECIDE, Stage.FOLD, Stage.ENCODE)] == [
        "decide-error", "evolve-error", "bad-event"]
    assert folding_reason(Stage.UPCAST) == UpcastError.reason == "upcast-failed"
    assert {folding_reason(s) for s in (Stage.DECODE, Stage.READ, Stage.FOLD)} == {"fold-error"}
