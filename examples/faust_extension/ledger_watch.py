"""A Faust module extending the kafold sidecar: an agent, a table, a timer and a page (docs/extending.md).

Named in `[daemon] faust_modules`, it runs in the daemon's own Faust worker: the daemon calls `setup(app)`
before the worker starts. The agent counts the bank's account events per type in a Faust table (Faust's own
consumer group `kafold-daemon-<group_prefix>`, at least once); the timer logs large withdrawals seen since its
last tick; the page serves the counts behind the daemon's API token like every other route.
"""

from __future__ import annotations

from typing import Any

import faust
import structlog

TOPIC = "account.events"  # the bank aggregate's events
LARGE = 500  # a withdrawal at least this large is reported by the timer
log = structlog.get_logger("ledger_watch")


def setup(app: faust.App) -> None:
    events = app.topic(TOPIC, value_serializer="json")  # kafold's envelope is a JSON object
    counts = app.Table("ledger_watch.counts", default=int, partitions=4)
    large: list[dict[str, Any]] = []

    @app.agent(events)
    async def count(stream: Any) -> None:
        async for event in stream:
            counts[event["type"]] += 1
            if event["type"] == "MoneyWithdrawn" and event["payload"].get("amount", 0) >= LARGE:
                large.append({"account": event["aggregate_id"], "amount": event["payload"]["amount"]})

    @app.timer(interval=10.0)
    async def report() -> None:
        if large:
            log.info("ledger_watch.large_withdrawals", count=len(large), largest=max(w["amount"] for w in large))
            large.clear()

    @app.page("/ledger-watch/counts")
    async def show(web: Any, request: Any) -> Any:
        return web.json(dict(counts.items()))
