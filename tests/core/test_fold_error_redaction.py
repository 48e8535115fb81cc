"""A fold error of an aggregate with protected fields quotes no value: evolve saw the opened fields, and the error's
text goes to logs, /status and dead-letter headers. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kafold.config import FoldErrorPolicy
from kafold.envelope import Event, encode
from kafold.errors import redact_quoted
from kafold.fold import Folder, FoldError

SECRET = "SW1A 1AA"


@dataclass
class Entry:
    state: Any = None
    version: int = 0
    covered: int = 0


@dataclass
class Kernel:
    unseal: Any = None
    on_fold_error: FoldErrorPolicy = FoldErrorPolicy.STOP

    @staticmethod
    def evolve(state: Any, event: dict[str, Any]) -> Any:
        return int(event["postcode"])  # a bug: the value is quoted in the error

    @staticmethod
    def event(type_name: str, payload: dict[str, Any], schema_version: int = 1) -> dict[str, Any]:
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


def fold_one(kernel: Kernel) -> FoldError:
    key, value, _ = encode(Event.new("Moved", "customer", "c-1", 1, {"postcode": SECRET}))
    with pytest.raises(FoldError) as e:
        Folder(kernel, States(), partition=0).fold([7], [key], [value])
    return e.value


def test_a_protected_aggregates_fold_error_quotes_no_value() -> None:
    error = fold_one(Kernel(unseal=lambda type_name, aid, payload: payload))
    assert SECRET not in error.describe() and SECRET not in str(error)
    assert SECRET not in repr(error.fields())
    assert error.fields()["error_class"] == "ValueError"
    assert "invalid literal for int() with base 10" in error.describe()


def test_an_unprotected_aggregates_fold_error_keeps_its_text() -> None:
    assert SECRET in fold_one(Kernel()).describe()


def test_redact_quoted_keeps_the_names_it_is_given() -> None:
    text = 'invalid input syntax for type uuid: "x@example.com" in column "email" of \'it\'\'s\''
    assert redact_quoted(text, {"email"}) == 'invalid input syntax for type uuid: "…" in column "email" of "…"'
