"""The effects ledger's read of a batch's event ids is planned for its values each time (kafold.db.BY_KEYS): no
generic plan made while the ledger was empty (a sequential scan) is kept for it as the table grows."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from kafold.config import PostgresConfig
from kafold.connectors.effects.ledger import Ledger

pytestmark = pytest.mark.integration


def test_the_ledger_reads_of_a_growing_ledger_are_planned_for_their_values(effects_pg: PostgresConfig) -> None:
    ledger = Ledger(effects_pg, f"plans-{uuid.uuid4().hex[:8]}", None)

    async def reads() -> list[tuple[Any, ...]]:
        try:
            for _ in range(20):  # psycopg would prepare it from the 5th; PostgreSQL keeps a generic plan from the 6th
                assert await ledger.finished_ids([str(uuid.uuid4()) for _ in range(10)]) == set()
            assert ledger._aread is not None  # the read's own connection (the executor loop's)
            cur = await ledger._aread.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
                ("%effect_ledger%ANY%",))
            return await cur.fetchall()
        finally:
            await ledger.close_async()

    try:
        if ledger._reader.info.server_version < 140000:
            pytest.skip("pg_prepared_statements counts plans from PostgreSQL 14")
        plans = asyncio.run(reads())
        assert all(generic == 0 for generic, _ in plans), plans
    finally:
        ledger.close()
