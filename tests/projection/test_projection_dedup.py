"""Integration (real PostgreSQL, Apache Kafka): deduplicating by version (`dedup = "version"`) — no tracking record
per event, the checkpoint update fencing every other writer of a partition — and the event-id tracking kept where
a stream gives no versions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kafold import db
from kafold.config import ConnectorConfig, ConvertConfig, ConverterKind, KafkaConfig, PostgresConfig
from kafold.connectors.projection.config import Dedup
from kafold.connectors.projection.mapping import Mapping
from kafold.connectors.projection.writer import ProjectionWriter
from kafold.connectors.registry import instantiate
from tests.projection import test_rebuild
from tests.projection.projection_support import (
    closed,
    deposited,
    encoded,
    ends_of,
    fold,
    history,
    opened,
    read_table,
    running,
    settings,
    stored_offsets,
    table_name,
    wait_for_offsets,
)
from tests.projection.test_projection_writer import _records
from tests.support import create_topic, produce


def _tracked(pgc: PostgresConfig, namespace: str) -> int:
    with db.connect(pgc) as conn:
        row = conn.execute("SELECT count(*) FROM kafold.tracking WHERE projection = %s", (namespace,)).fetchone()
    return row[0] if row else 0


def test_by_version_duplicates_are_applied_once_without_tracking_records(kafka_config: KafkaConfig,
                                                                         pg_config: PostgresConfig,
                                                                         unique: str) -> None:
    """The duplicate-id test's records with `dedup = "version"`: a record produced twice (same event id, same
    aggregate and version) and a history re-published newest-first are skipped by the row's version; a new event
    id at an old version too (a producer's bug: the same as with tracking, where it is stale); no tracking rows."""
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=3)
    events = history(accounts=30, deposits=8, close_every=7)
    again = events[::3]
    reversed_ = [e for e in reversed(events) if e.aggregate_id in ("acc-1", "acc-2", "acc-7")]
    stale = deposited("acc-3", 2, 1_000_000)
    late_close = closed("acc-4", 3)
    coords = produce(kafka_config, topic, encoded(events + again + reversed_ + [stale, late_close], 3))
    cfg = settings(unique, topic, table, dedup="version")
    with running(kafka_config, pg_config, cfg, unique, batch=97) as runner:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), runner)
        totals = runner.task.totals  # type: ignore[attr-defined]
    assert read_table(pg_config, table) == fold(events)
    # by version a re-delivered record and an old version look alike: both are stale
    assert totals.duplicates + totals.stale == len(again) + len(reversed_) + 2
    assert _tracked(pg_config, unique) == 0


def test_a_writer_whose_checkpoint_another_moved_fails_its_transaction_and_writes_nothing(
        pg_config: PostgresConfig, unique: str) -> None:
    """Two writers of one partition deduplicating by version (a zombie after a rebalance and the new owner): the
    one whose stored checkpoint moved under it rolls back, reads the checkpoints and applies only what they have
    not passed — here nothing, so none of its rows is written."""
    topic, table = f"{unique}.events", table_name()
    db.upgrade(pg_config)
    config = instantiate(settings(unique, topic, table, dedup="version"), Path(".")).config
    owner = ProjectionWriter(pg_config, config, Mapping(config), unique, track=False, fence=True)
    zombie = ProjectionWriter(pg_config, config, Mapping(config), unique, track=False, fence=True)
    try:
        assert owner.checkpoints() == zombie.checkpoints() == {}
        # the same offsets, different events: only the first committed may stand
        mine = _records(topic, 0, [opened(f"acc-{i}", "owner") for i in range(5)])
        theirs = _records(topic, 0, [opened(f"acc-{i}", "zombie") for i in range(5)])
        assert owner.write(mine).upserted == 5
        with capture_logs() as logs:
            late = zombie.write(theirs)
        assert [e for e in logs if e["event"] == "projection.checkpoint_moved"]
        assert (late.upserted, late.duplicates, late.checkpoints) == (0, 5, {})
        assert {r["owner"] for r in read_table(pg_config, table).values()} == {"owner"}
        # the zombie knows the stored checkpoint now: what follows it is applied, once, in order
        more = _records(topic, 0, [deposited("acc-0", 2, 7)], start=5)
        assert zombie.write(more).upserted == 1
        assert owner.write(more).upserted == 0  # the owner's turn to find its checkpoint moved
        assert stored_offsets(pg_config, unique, topic) == {0: 6}
        assert read_table(pg_config, table)["acc-0"]["balance"] == 7
    finally:
        owner.close()
        zombie.close()
    assert _tracked(pg_config, unique) == 0


def test_a_stream_without_versions_is_still_deduplicated_by_event_id(pg_config: PostgresConfig, unique: str) -> None:
    """`dedup = "auto"` keeps tracking where the converter derives versions from offsets (json without a `version`
    source): a record produced twice gets a new version there, and only its event id finds it."""
    topic, table = f"{unique}.events", table_name()
    auto = {**settings(unique, topic, table).config, "dedup": "auto"}
    json = ConnectorConfig(name=unique, connector_class="postgres-projection", topics=[topic],
                           converter=ConverterKind.JSON, convert=ConvertConfig(id="meta.id"), config=auto)
    kafold = ConnectorConfig(name=unique, connector_class="postgres-projection", topics=[topic], config=auto)
    assert instantiate(json, Path(".")).task_configs(1)[0].config.dedup is Dedup.TRACKING
    assert instantiate(kafold, Path(".")).task_configs(1)[0].config.dedup is Dedup.VERSION
    db.upgrade(pg_config)
    config = instantiate(json, Path(".")).task_configs(1)[0].config
    writer = ProjectionWriter(pg_config, config, Mapping(config), unique)
    first = deposited("acc-1", 2, 5)
    twice = dataclasses.replace(first, version=9)  # the same event id, the version of a later offset
    try:
        writer.write(_records(topic, 0, [opened("acc-1"), first]))
        again = writer.write(_records(topic, 0, [twice], start=2))
    finally:
        writer.close()
    assert (again.duplicates, again.upserted) == (1, 0)
    assert read_table(pg_config, table)["acc-1"]["balance"] == 5
    assert _tracked(pg_config, unique) == 2


@pytest.mark.timeout(300)
def test_a_rebuild_under_traffic_swaps_in_the_live_result_with_live_writers_deduplicating_by_version(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild-under-traffic test with its live connectors deduplicating by version: the swap's locks and the
    fence's do not wait in a circle, and the rows after the swap equal the fold of every event."""
    monkeypatch.setattr(test_rebuild, "settings", lambda *a, **k: settings(*a, dedup="version", **k))
    test_rebuild.test_rebuild_under_live_traffic_swaps_in_a_table_equal_to_the_live_result(kafka_config, pg_config,
                                                                                           unique)
    assert _tracked(pg_config, unique) == 0
