"""Integration: the projection applies each event once (duplicates, out-of-order re-publishing) and passes the
SinkTask contract, against the real broker and PostgreSQL."""

from __future__ import annotations

import pytest

from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.projection.fold import APPLIED
from tests.projection.projection_support import (
    closed,
    deposited,
    encoded,
    ends_of,
    fold,
    history,
    read_table,
    running,
    settings,
    stored_offsets,
    table_name,
    wait_for_offsets,
)
from tests.support import SinkTaskContract, create_topic, produce


@pytest.fixture(autouse=True)
def _pg_env(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The contract drives the task without a host: it finds PostgreSQL through KAFOLD_POSTGRES__URL.
    monkeypatch.setenv("KAFOLD_POSTGRES__URL", pg_url)


class TestProjectionContract(SinkTaskContract):
    connector_ref = "postgres-projection"
    config = {"table": "contract_things", "key_columns": ["id"], "columns": {"id": "text", "n": "bigint"},
              "on": [{"type": "ThingHappened", "set": {"n": "payload.n"}}]}


@pytest.mark.parametrize("dedup", ["auto", "tracking"])  # auto: by version here (kafold envelopes)
def test_duplicates_are_applied_once_and_the_newest_version_wins(kafka_config: KafkaConfig,
                                                                 pg_config: PostgresConfig, unique: str,
                                                                 dedup: str) -> None:
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=3)
    events = history(accounts=30, deposits=8, close_every=7)
    # the same records again (same event ids), then some histories re-published newest-first
    again = events[::3]
    reversed_ = [e for e in reversed(events) if e.aggregate_id in ("acc-1", "acc-2", "acc-7")]
    # a deposit re-published with a new event id but an old version must not overwrite the newer row
    stale = deposited("acc-3", 2, 1_000_000)
    late_close = closed("acc-4", 3)  # a new id, older than the row: ignored too
    produced = events + again + reversed_ + [stale, late_close]
    coords = produce(kafka_config, topic, encoded(produced, 3))
    cfg = settings(unique, topic, table, dedup=dedup)
    with running(kafka_config, pg_config, cfg, unique, batch=97) as runner:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), runner)
        totals = runner.task.totals  # type: ignore[attr-defined]
    assert read_table(pg_config, table) == fold(events)
    # Applied once: each distinct event exactly once, every other record skipped (tracking calls a re-delivered
    # record a duplicate, the version guard calls it stale, as it does a new id at an old version).
    assert sum(counts[APPLIED] for counts in totals.by_partition.values()) == len(events)
    assert totals.duplicates + totals.stale == len(again) + len(reversed_) + 2


def test_a_restarted_task_resumes_from_the_offsets_stored_in_postgres(kafka_config: KafkaConfig,
                                                                       pg_config: PostgresConfig,
                                                                       unique: str) -> None:
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=2)
    first, second = history(10, 3), [deposited(f"acc-{a}", 5, 7) for a in range(10)]
    coords = produce(kafka_config, topic, encoded(first, 2))
    cfg = settings(unique, topic, table)
    with running(kafka_config, pg_config, cfg, unique) as runner:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), runner)
    coords += produce(kafka_config, topic, encoded(second, 2))
    # Kafka's committed offsets are not what the task trusts: a new group would start from the beginning,
    # yet nothing is applied twice because the task seeks to PostgreSQL's checkpoints.
    with running(kafka_config, pg_config, cfg, f"{unique}.other-group") as runner:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), runner)
        totals = runner.task.totals  # type: ignore[attr-defined]
    assert totals.events == len(second) and totals.duplicates == 0
    assert read_table(pg_config, table) == fold(first + second)
    assert stored_offsets(pg_config, unique, topic) == ends_of(coords)
