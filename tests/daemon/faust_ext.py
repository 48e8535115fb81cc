"""A user's Faust module for the daemon tests: an agent (when TOPIC is set), a timer and a web page."""

from __future__ import annotations

from typing import Any

import faust

TOPIC = ""  # the test sets it before the daemon starts; empty = no agent (timer and page only)
SEEN: list[bytes] = []
TICKS: list[int] = []


def setup(app: faust.App) -> None:
    SEEN.clear()
    TICKS.clear()
    if TOPIC:
        @app.agent(app.topic(TOPIC, value_serializer="raw"))
        async def collect(stream: Any) -> None:
            async for value in stream:
                SEEN.append(value)

    @app.timer(interval=0.2)
    async def tick() -> None:
        TICKS.append(len(TICKS))

    @app.page("/faust-ext/seen")
    async def seen(web: Any, request: Any) -> Any:
        return web.json({"seen": [v.decode() for v in SEEN], "ticks": len(TICKS)})
