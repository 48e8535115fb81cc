"""Unit tests of the pure fold of a projection batch (no PostgreSQL): rows + events -> rows, deletes, outcomes."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from kafold.connectors.api import Outcomes, SinkRecord, TopicPartition
from kafold.connectors.projection import fold as f
from kafold.connectors.projection.config import VERSION_COLUMN, ProjectionConfig
from kafold.connectors.projection.mapping import Mapping, MappingError
from kafold.connectors.projection.writer import tracking_key, tracking_prefix
from kafold.envelope import Event
from kafold.schema import Problems, is_missing, load

CONFIG: dict[str, Any] = {
    "table": "accounts",
    "key_columns": ["account_id"],
    "columns": {"account_id": "text", "owner": "text", "balance": "numeric(12,2)"},
    "on": [
        {"type": "AccountOpened", "set": {"owner": "payload.owner", "balance": 0}},
        {"type": "MoneyDeposited", "action": "update", "increment": {"balance": "payload.amount"}},
        {"type": "AccountClosed", "action": "delete"},
    ],
}
PREFIX = tracking_prefix("accounts")


def mapping(**changes: Any) -> Mapping:
    problems = Problems("kafold.toml")
    cfg = load(ProjectionConfig, {**CONFIG, **changes}, "c", problems, Path("."))
    assert problems.items == [] and not is_missing(cfg)
    return Mapping(cfg)


class Log:
    """Records on partitions of one topic, offsets counted per partition."""

    def __init__(self) -> None:
        self.next: dict[int, int] = {}

    def record(self, type_: str, version: int, aggregate: str = "acc-1", partition: int = 0,
               event: Event | None = None, **payload: Any) -> SinkRecord:
        offset = self.next.get(partition, 0)
        self.next[partition] = offset + 1
        e = event or Event.new(type_, "account", aggregate, version, payload)
        return SinkRecord("events", partition, offset, aggregate, e)


def folded(m: Mapping, records: list[SinkRecord], loaded: dict[f.Key, Any] | None = None,
           gone: dict[f.Key, int] | None = None, prefix: bytes | None = PREFIX) -> tuple[f.Candidates, f.Folded]:
    todo = f.candidates(records, f.prepare(m, records, prefix), set())
    return todo, f.fold(m, list(todo.first.values()), dict(loaded or {}), todo.record_keys, todo.key_errors, gone)


def row(balance: str, version: int, owner: str = "ada", key: str = "acc-1") -> dict[str, Any]:
    return {"account_id": key, "owner": owner, "balance": Decimal(balance), VERSION_COLUMN: version}


def test_new_events_fold_into_new_rows_counted_as_applied_per_partition() -> None:
    log = Log()
    records = [log.record("AccountOpened", 1, owner="ada"), log.record("MoneyDeposited", 2, amount=5),
               log.record("AccountOpened", 1, "acc-2", 1, owner="bob")]
    _, out = folded(mapping(), records)
    upserts, deletes = out.changes()
    assert sorted((r["account_id"], r["balance"], r[VERSION_COLUMN]) for r in upserts) == [
        ("acc-1", 5, 2), ("acc-2", 0, 1)]
    assert deletes == [] and out.bad == [] and out.stale == 0
    assert out.applied == {("events", 0): 2, ("events", 1): 1}


def test_events_at_or_below_the_row_version_are_stale_and_the_rest_applies() -> None:
    log = Log()
    loaded = {("acc-1",): row("10", 3)}
    records = [log.record("MoneyDeposited", v, amount=1) for v in (2, 3, 4)]
    _, out = folded(mapping(), records, loaded)
    assert out.stale == 1 + 1 and out.stale_records == records[:2]
    assert out.state[("acc-1",)] == row("11", 4)
    assert out.applied == {("events", 0): 1}
    assert out.loaded[("acc-1",)] == row("10", 3), "the rows read are not changed"


def test_without_the_version_guard_an_older_version_still_applies() -> None:
    log = Log()
    _, out = folded(mapping(version_guard=False), [log.record("MoneyDeposited", 1, amount=1)],
                    {("acc-1",): row("10", 3)})
    assert out.stale == 0 and out.state[("acc-1",)]["balance"] == Decimal("11")


def test_an_event_id_twice_in_a_batch_is_one_candidate_when_tracking() -> None:
    log = Log()
    first = log.record("MoneyDeposited", 2, amount=5)
    again = log.record("MoneyDeposited", 2, event=first.event)  # redelivered at a later offset
    todo, out = folded(mapping(), [first, again], {("acc-1",): row("0", 1)})
    assert list(todo.first.values()) == [first]
    assert list(todo.first) == [tracking_key(PREFIX, first.event.event_id)]
    assert out.state[("acc-1",)] == row("5", 2)
    # deduplicating by version, both are candidates: the second is stale by the version the first reached
    todo, out = folded(mapping(), [first, again], {("acc-1",): row("0", 1)}, gone={}, prefix=None)
    assert len(todo.first) == 2 and out.stale_records == [again] and out.state[("acc-1",)] == row("5", 2)


def test_a_delete_removes_a_loaded_row_and_leaves_a_tombstone_when_deduplicating_by_version() -> None:
    log = Log()
    records = [log.record("AccountClosed", 5), log.record("MoneyDeposited", 4, amount=1),
               log.record("AccountOpened", 6, owner="eve")]
    gone: dict[f.Key, int] = {}
    _, out = folded(mapping(), records[:2], {("acc-1",): row("1", 4)}, gone=gone, prefix=None)
    assert out.changes() == ([], [("acc-1",)])
    assert out.buried == {("acc-1",): 5} and gone == {("acc-1",): 5}
    assert out.stale_records == [records[1]], "no row, but the tombstone's version guards"
    _, later = folded(mapping(), records[2:], {}, gone=gone, prefix=None)
    assert later.changes()[0] == [{"account_id": "acc-1", "owner": "eve", "balance": 0, VERSION_COLUMN: 6}]


def test_a_row_created_and_deleted_in_one_batch_writes_nothing() -> None:
    log = Log()
    _, out = folded(mapping(), [log.record("AccountOpened", 1, owner="ada"), log.record("AccountClosed", 2)])
    assert out.changes() == ([], [])
    assert out.applied == {("events", 0): 2}


def test_an_update_of_a_missing_row_is_applied_unchanged() -> None:
    log = Log()
    _, out = folded(mapping(), [log.record("MoneyDeposited", 2, amount=1)])
    assert out.unchanged == 1 and out.applied == {("events", 0): 1} and out.changes() == ([], [])


def test_events_that_do_not_fit_the_mapping_are_refused_by_name_the_rest_applies() -> None:
    log = Log()
    no_owner = log.record("AccountOpened", 1)  # payload.owner missing
    fine = log.record("AccountOpened", 1, "acc-2", owner="bob")
    _, out = folded(mapping(), [no_owner, fine])
    assert [(r, type(e)) for r, e in out.bad] == [(no_owner, MappingError)]
    assert "payload.owner is missing" in str(out.bad[0][1]) and out.bad[0][1].raw is no_owner
    assert list(out.state) == [("acc-2",)]


def test_a_row_key_error_counts_only_for_a_candidate() -> None:
    m = mapping(key={"account_id": "payload.account"})
    log = Log()
    keyless = log.record("MoneyDeposited", 2, amount=1)  # no payload.account: no row key
    todo, out = folded(m, [keyless])
    assert list(todo.key_errors) == [id(keyless)] and todo.keys == []
    assert [r for r, _ in out.bad] == [keyless]
    skipped = f.candidates([keyless], f.prepare(m, [keyless], PREFIX), {id(keyless)})
    assert skipped.first == {} and skipped.key_errors == {}


def test_next_offsets_and_the_outcome_accounting() -> None:
    log = Log()
    records = [log.record("MoneyDeposited", v, partition=v % 2, amount=1) for v in range(1, 6)]
    assert f.next_offsets(records) == {TopicPartition("events", 1): 3, TopicPartition("events", 0): 2}
    result = f.BatchResult(events=5)
    f.tally(result.by_partition, records[:3], f.APPLIED)
    f.tally(result.by_partition, records[3:], f.STALE)
    other = f.BatchResult(events=1, duplicates=1, checkpoints={TopicPartition("events", 0): 2})
    f.tally(other.by_partition, records[:1], f.DUPLICATE)
    result.add(other)
    assert (result.events, result.duplicates) == (6, 1)
    assert result.checkpoints == {TopicPartition("events", 0): 2}
    assert result.outcomes() == {TopicPartition("events", 1): Outcomes(2, 1, 1, 0),
                                 TopicPartition("events", 0): Outcomes(1, 0, 1, 0)}
