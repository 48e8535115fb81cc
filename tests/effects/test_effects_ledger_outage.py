"""The ledger's writer while PostgreSQL refuses its writes: retried on a backoff, dropped only after close.

The writes fail for real (the schema holds no ledger tables, so PostgreSQL answers each with an error); nothing
is committed for rows that are dropped at shutdown, so their events are delivered again after a restart.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from structlog.testing import capture_logs

from kafold.config import PostgresConfig
from kafold.connectors.api import SinkRecord
from kafold.connectors.effects.ledger import DeliveryStatus, Ledger, LedgerUpdate, now
from kafold.envelope import Event
from kafold.errors import RetriableError

pytestmark = pytest.mark.integration

RETRYING = "ledger.write_retrying"
DROPPED = "ledger.rows_dropped"


def test_failing_writes_are_retried_with_backoff_until_close_then_dropped_within_the_grace(pg_url: str) -> None:
    pg = PostgresConfig(url=pg_url, schema=f"kt_no_ledger_{uuid.uuid4().hex[:8]}")
    event = Event.new("ItemSet", "item", "k", 1, {"value": 1})
    with capture_logs() as logs:
        ledger = Ledger(pg, "ledger-outage", None, 0.01)
        ledger.outcome(LedgerUpdate(SinkRecord("orders", 0, 0, "k", event), DeliveryStatus.SUCCEEDED, 1, now(), now()))
        barrier = ledger.barrier()
        deadline = time.monotonic() + 60
        while sum(e["event"] == RETRYING for e in logs) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not barrier.done(), "a write that failed was reported done before close"
        ledger.close(timeout=60)
    assert not ledger._thread.is_alive(), "the writer kept retrying past the grace after close"
    delays = [e["retry_in_s"] for e in logs if e["event"] == RETRYING]
    assert delays[:3] == [0.1, 0.2, 0.4], delays  # a backoff, not a busy loop
    dropped = [e for e in logs if e["event"] == DROPPED]
    assert sum(e["rows"] for e in dropped) == 2 and all("kt_no_ledger" in e["error"] for e in dropped), dropped
    assert barrier.done()  # whoever waits on the barrier is released at shutdown


def test_the_intake_read_reports_a_lost_session_as_retriable_and_the_next_read_reconnects(
        effects_pg: PostgresConfig) -> None:
    """The executor's check of a batch's event ids (`finished_ids`, on its loop's own connection): a session
    PostgreSQL ended (a restart, a failover) is a RetriableError, which the executor retries, and the retry answers
    on a new session."""
    ledger = Ledger(effects_pg, f"intake-{uuid.uuid4().hex[:8]}", None)
    ids = [str(uuid.uuid4()) for _ in range(3)]

    async def reads() -> tuple[int, int]:
        try:
            assert await ledger.finished_ids(ids) == set()
            assert ledger._aread is not None
            first = ledger._aread.info.backend_pid
            with ledger._reading() as cur:  # another session ends the read's one, as a server restart would
                cur.execute("SELECT pg_terminate_backend(%s)", (first,))
            with pytest.raises(RetriableError):
                await ledger.finished_ids(ids)
            assert await ledger.finished_ids(ids) == set()
            return first, ledger._aread.info.backend_pid
        finally:
            await ledger.close_async()

    try:
        first, second = asyncio.run(reads())
        assert first != second
    finally:
        ledger.close()
