"""kafold's PostgreSQL sessions plan every execution of a prepared statement for its values: a plan made while the
effects ledger was empty (a sequential scan) is never kept for the ledger's reads as the table grows."""

from __future__ import annotations

import uuid

import pytest

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.effects.ledger import Ledger

pytestmark = pytest.mark.integration


def test_a_kafold_session_plans_each_execution_and_holds_no_transaction(effects_pg: PostgresConfig) -> None:
    for autocommit in (True, False):
        with db.connect(effects_pg, autocommit=autocommit) as conn:
            assert conn.info.transaction_status.name == "IDLE"  # the SET's transaction is committed
            assert conn.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)


def test_the_ledger_reads_of_a_growing_ledger_are_planned_for_their_values(effects_pg: PostgresConfig) -> None:
    ledger = Ledger(effects_pg, f"plans-{uuid.uuid4().hex[:8]}", None)
    try:
        if ledger._reader.info.server_version < 140000:
            pytest.skip("pg_prepared_statements counts plans from PostgreSQL 14")
        for _ in range(20):  # psycopg prepares it from the 5th; PostgreSQL would keep a generic plan from the 6th
            assert ledger.finished_ids([str(uuid.uuid4()) for _ in range(10)]) == set()
        rows = ledger._reader.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            ("%effect_ledger%ANY%",)).fetchall()
        assert len(rows) == 1, rows
        generic, custom = rows[0]
        assert generic == 0 and custom >= 5, (generic, custom)
    finally:
        ledger.close()
