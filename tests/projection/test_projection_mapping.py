"""Unit tests: projection config validation, SQL identifier checks and the pure event -> row mapping."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from kafold.connectors.convert.api import UNAVAILABLE
from kafold.connectors.projection.config import VERSION_COLUMN, ProjectionConfig
from kafold.connectors.projection.mapping import UNCHANGED, Mapping, MappingError
from kafold.connectors.projection.sql import check_type, qualified
from kafold.envelope import Event
from kafold.schema import Problems, is_missing, load
from kafold.sqlnames import check_identifier

BASE: dict[str, Any] = {
    "table": "accounts",
    "key_columns": ["account_id"],
    "columns": {"account_id": "text", "owner": "text", "balance": "numeric(12,2)", "status": "text",
                "opened_at": "timestamptz", "deposits": "bigint"},
    "on": [
        {"type": "AccountOpened", "set": {"owner": "payload.owner", "status": "'open'", "opened_at": "occurred_at",
                                          "balance": 0}},
        {"type": "MoneyDeposited", "action": "update", "increment": {"balance": "payload.amount",
                                                                      "deposits": "payload.one"}},
        {"type": "AccountClosed", "action": "delete"},
    ],
}


def problems_of(raw: dict[str, Any]) -> list[str]:
    problems = Problems("kafold.toml")
    load(ProjectionConfig, raw, "connectors[0].config", problems, Path("."))
    return problems.items


def config(**changes: Any) -> ProjectionConfig:
    problems = Problems("kafold.toml")
    cfg = load(ProjectionConfig, {**BASE, **changes}, "c", problems, Path("."))
    assert problems.items == [] and not is_missing(cfg)
    return cfg


def event(type_: str, version: int, aggregate: str = "acc-1", **payload: Any) -> Event:
    return Event.new(type_, "account", aggregate, version, payload)


@pytest.mark.parametrize("name", ["accounts", "_private", "Mixed_Case9", "a" * 63])
def test_plain_identifiers_are_accepted(name: str) -> None:
    assert check_identifier(name) is None


@pytest.mark.parametrize("name", ["", "9lives", "has space", "accounts; DROP TABLE x", 'q"uote', "a" * 64, "é"])
def test_unsafe_identifiers_are_refused_with_the_reason(name: str) -> None:
    message = check_identifier(name)
    assert message is not None and "not a valid SQL identifier" in message


@pytest.mark.parametrize("tp", ["text", "numeric(12,2)", "timestamp with time zone", "double precision", "int[]",
                                "character varying(40)", "jsonb"])
def test_plain_sql_types_are_accepted(tp: str) -> None:
    assert check_type(tp) is None


@pytest.mark.parametrize("tp", ["text; drop table x", "int) --", "text DEFAULT 'x'", ""])
def test_anything_but_a_plain_type_is_refused(tp: str) -> None:
    assert check_type(tp) is not None


def test_identifiers_are_quoted_never_formatted() -> None:
    assert qualified("Public", "my table").as_string(None) == '"Public"."my table"'


def test_a_valid_config_loads() -> None:
    cfg = config()
    assert cfg.key_sources == {"account_id": "aggregate_id"}
    assert cfg.handled_types == {"AccountOpened", "MoneyDeposited", "AccountClosed"}


def test_config_problems_name_the_key_and_are_all_reported() -> None:
    raw = {**BASE, "table": "bad name", "columns": {**BASE["columns"], "x": "text; drop"},
           "on": [{"type": "AccountOpened", "set": {"nope": "payload.a", "owner": "paylod.owner"}}]}
    items = problems_of(raw)
    text = "\n".join(items)
    assert "connectors[0].config" in text
    assert "table: 'bad name' is not a valid SQL identifier" in text
    assert "columns.x: 'text; drop' is not a plain SQL type" in text
    assert "on[0].set.nope: unknown column" in text
    assert "on[0].set.owner: 'paylod.owner' is neither a payload path" in text


def test_mapper_and_rules_are_mutually_exclusive() -> None:
    assert any("give exactly one of" in p for p in problems_of({**BASE, "mapper": "m:f"}))
    assert any("give exactly one of" in p for p in problems_of({k: v for k, v in BASE.items() if k != "on"}))


def test_several_key_columns_need_their_sources() -> None:
    raw = {**BASE, "key_columns": ["account_id", "owner"]}
    assert any("key: required when there are several key_columns" in p for p in problems_of(raw))


def test_upsert_sets_columns_from_payload_envelope_and_literals() -> None:
    m = Mapping(config())
    e = event("AccountOpened", 1, owner="ada")
    row = m.apply(None, e, m.key(e))
    assert row == {"account_id": "acc-1", "owner": "ada", "balance": 0, "status": "open",
                   "opened_at": e.occurred_at, "deposits": None, VERSION_COLUMN: 1}


def test_increment_adds_to_the_column_and_keeps_decimals_exact() -> None:
    m = Mapping(config())
    row = {"account_id": "acc-1", "balance": Decimal("10.10"), "deposits": None, VERSION_COLUMN: 1}
    e = event("MoneyDeposited", 2, amount=0.2, one=1)
    new = m.apply(row, e, m.key(e))
    assert isinstance(new, dict)
    assert new["balance"] == Decimal("10.30") and new["deposits"] == 1 and new[VERSION_COLUMN] == 2
    assert row["balance"] == Decimal("10.10")  # the given row is not changed


def test_update_of_a_missing_row_leaves_it_missing() -> None:
    m = Mapping(config())
    e = event("MoneyDeposited", 2, amount=5, one=1)
    assert m.apply(None, e, m.key(e)) is UNCHANGED


def test_delete_removes_the_row() -> None:
    m = Mapping(config())
    e = event("AccountClosed", 3)
    assert m.apply({"account_id": "acc-1", VERSION_COLUMN: 2}, e, m.key(e)) is None


def test_a_missing_payload_path_is_a_record_error_naming_it() -> None:
    m = Mapping(config())
    e = event("AccountOpened", 1)
    with pytest.raises(MappingError, match=r"payload\.owner is missing") as info:
        m.apply(None, e, m.key(e))
    assert info.value.reason == "schema-invalid"


def test_a_non_numeric_increment_is_a_record_error() -> None:
    m = Mapping(config())
    e = event("MoneyDeposited", 2, amount="lots", one=1)
    with pytest.raises(MappingError, match="not a number"):
        m.apply({"account_id": "acc-1", "balance": 1, VERSION_COLUMN: 1}, e, m.key(e))


def test_an_event_not_newer_than_the_row_is_stale() -> None:
    m = Mapping(config())
    row = {"account_id": "acc-1", VERSION_COLUMN: 5}
    assert m.is_stale(row, event("MoneyDeposited", 5))
    assert m.is_stale(row, event("MoneyDeposited", 4))
    assert not m.is_stale(row, event("MoneyDeposited", 6))
    assert not m.is_stale(None, event("MoneyDeposited", 1))
    assert not Mapping(config(version_guard=False)).is_stale(row, event("MoneyDeposited", 1))


def fold_counter(row: dict[str, Any] | None, e: Event) -> dict[str, Any] | None:
    if e.type == "AccountClosed":
        return None
    return {"deposits": ((row or {}).get("deposits") or 0) + 1}


def test_a_mapper_function_folds_and_deletes() -> None:
    cfg = config(on=[], mapper="tests:fold_counter")
    m = Mapping(cfg, fold_counter)
    e1, e2 = event("MoneyDeposited", 1), event("AccountClosed", 2)
    row = m.apply(None, e1, m.key(e1))
    assert isinstance(row, dict) and row["deposits"] == 1 and row["account_id"] == "acc-1"
    assert m.apply(row, e2, m.key(e2)) is None
    assert m.handles("Anything")


def test_a_failing_mapper_is_a_record_error_not_a_crash() -> None:
    def broken(row: Any, e: Event) -> Any:
        raise KeyError("amount")

    m = Mapping(config(on=[], mapper="tests:broken"), broken)
    e = event("MoneyDeposited", 1)
    with pytest.raises(MappingError, match="mapper raised KeyError"):
        m.apply(None, e, m.key(e))


def test_unknown_event_types_are_not_handled() -> None:
    assert not Mapping(config()).handles("SomethingElse")


def test_whole_types_are_the_upserts_setting_every_column_and_their_rows_need_no_stored_row() -> None:
    """A type is whole (whole_rows.py: written without reading its row) only when its rule is an upsert that sets
    every non-key column and increments none; a mapper makes none whole; an UNAVAILABLE value needs the stored row."""
    every = {"owner": "payload.owner", "status": "'open'", "opened_at": "occurred_at", "balance": "payload.b",
             "deposits": 0}
    rules = [*BASE["on"], {"type": "State", "set": every},
             {"type": "StateIfThere", "action": "update", "set": every},
             {"type": "StateAndCount", "set": {**every, "deposits": 1}, "increment": {"balance": "payload.b"}}]
    mapping = Mapping(config(on=rules))
    assert mapping.whole_types == {"State"}  # AccountOpened leaves `deposits` out
    e = Event.new("State", "account", "acc-1", 4, {"owner": "ada", "b": 5})
    row = mapping.whole_row(e, ("acc-1",))
    assert row is not None and dict(zip(mapping.written, row, strict=True)) == mapping.apply(None, e, ("acc-1",))
    assert row[-1] == 4  # the version, last
    unavailable = Event.new("State", "account", "acc-1", 5, {"owner": UNAVAILABLE, "b": 5})
    assert mapping.whole_row(unavailable, ("acc-1",)) is None
    with pytest.raises(MappingError):
        mapping.whole_row(Event.new("State", "account", "acc-1", 6, {"owner": "ada"}), ("acc-1",))
    assert Mapping(config(on=rules), mapper=lambda row, event: row).whole_types == frozenset()
