"""The ledger's writer while PostgreSQL refuses its writes: retried on a backoff, dropped only after close.

The writes fail for real (the schema holds no ledger tables, so PostgreSQL answers each with an error); nothing
is committed for rows that are dropped at shutdown, so their events are delivered again after a restart.
"""

from __future__ import annotations

import time
import uuid

import pytest
from structlog.testing import capture_logs

from kafold.config import PostgresConfig
from kafold.connectors.api import SinkRecord
from kafold.connectors.effects.ledger import DeliveryStatus, Ledger, LedgerUpdate, now
from kafold.envelope import Event

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
