"""Integration: a rebuild's copy folds rows ahead in memory; when what it folded cannot be written as folded (an
event the mapping refuses, a row PostgreSQL rejects), nothing of it is, and the rebuild reads again from its stored
checkpoints batch by batch: the table and the dead letters it swaps in equal the live connector's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kafold import db
from kafold.config import KafkaConfig, KafoldConfig, PostgresConfig
from kafold.connectors.projection import rebuild as rb
from kafold.envelope import Event
from tests.projection.projection_support import (
    COLUMNS,
    deposited,
    encoded,
    ends_of,
    history,
    opened,
    read_table,
    running,
    settings,
    table_name,
    wait_for_offsets,
)
from tests.support import create_topic, produce


def _dead(pgc: PostgresConfig, connector: str) -> list[tuple[Any, ...]]:
    with db.connect(pgc) as conn:
        return list(conn.execute('SELECT "offset", status, reason, hold_key FROM kafold.dead_letters '
                                 'WHERE connector = %s ORDER BY "offset"', (connector,)).fetchall())


POISON = {
    # refused by the mapping while folding (no amount): the fold ahead gives way at once
    "refused": [opened("acc-91", "bo"), Event.new("MoneyDeposited", "account", "acc-91", 2, {"amuont": 1}),
                deposited("acc-91", 3, 4)],
    # rejected by PostgreSQL (owner longer than varchar(8)) only when the rows folded ahead are written
    "rejected": [opened("acc-90", "far too long an owner"), deposited("acc-90", 2, 5)],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("poison", sorted(POISON))
def test_a_fold_ahead_that_cannot_be_written_gives_way_to_batch_by_batch_writes(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str, poison: str) -> None:
    topic, table = f"{unique}.events", table_name()
    cfg = settings(unique, topic, table, columns={**COLUMNS, "owner": "varchar(8)"})
    create_topic(kafka_config, topic, partitions=1)
    create_topic(kafka_config, cfg.dlq_topic)
    events = history(accounts=40, deposits=6, close_every=7)
    half = len(events) // 2
    coords = produce(kafka_config, topic, encoded([*events[:half], *POISON[poison], *events[half:]], 1))
    with running(kafka_config, pg_config, cfg, unique, batch=50) as live:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), live)
    expected, dead = read_table(pg_config, table), _dead(pg_config, unique)
    assert len(dead) == len(POISON[poison]) - (poison == "refused")  # the head and what it holds
    assert dead[0][1:3] == ("new", "schema-invalid" if poison == "refused" else "db-rejected")

    plan = rb.plan(KafoldConfig(kafka=kafka_config, postgres=pg_config, connectors=[cfg]), Path("."), unique)
    rebuild = rb.Rebuild(plan, batch=20, max_tail=5, workers=1)
    assert rebuild.run().phase == "swapped"
    assert rebuild.writes.folding is False and rebuild.rewinds == 1  # it did fold ahead, and gave way once
    assert read_table(pg_config, table) == expected
    assert _dead(pg_config, unique) == dead
