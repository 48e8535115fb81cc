"""The effects bench's webhook receiver (its own process): checks per-key order and counts what it received."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web


class Receiver:
    """Checks per-key order (versions increase per aggregate id, a redelivery aside) and counts; `/down` stops its
    listener as a stopping service does, `/up` brings it back on the same port; `/stats` reports."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"count": 0, "out_of_order": 0, "first": None, "last": None, "ids": set()}
        self.last: dict[str, int] = {}
        self.received_at: dict[str, float] = {}  # webhook-id (the event id) -> first received (time.time())
        self.runner: web.AppRunner | None = None
        self.site: web.TCPSite | None = None
        self.port = 0

    async def hook(self, request: web.Request) -> web.Response:
        state, last = self.state, self.last
        if state.get("down"):  # a kept-alive connection of the client: dropped, as a stopping service does
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=503)
        doc = orjson.loads(await request.read())
        key, version = doc["aggregate_id"], doc["version"]
        if last.get(key, 0) >= version and request.headers["webhook-id"] not in state["ids"]:
            state["out_of_order"] += 1
        last[key] = max(version, last.get(key, 0))
        state["ids"].add(request.headers["webhook-id"])
        self.received_at.setdefault(request.headers["webhook-id"], time.time())
        state["count"] += 1
        state["first"] = state["first"] or time.time()
        state["last"] = time.time()
        return web.Response(status=204)

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response({k: v for k, v in self.state.items() if k not in ("ids", "down")} |
                                 {"unique": len(self.state["ids"])})

    async def times(self, _: web.Request) -> web.Response:
        """When each event was first received (for `kafold bench latency`), emptied once read."""
        times, self.received_at = self.received_at, {}
        return web.Response(body=orjson.dumps(times), content_type="application/json")

    async def listen(self, port: int) -> int:
        assert self.runner is not None
        site = web.TCPSite(self.runner, "127.0.0.1", port, backlog=1024)
        await site.start()
        self.site = site
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def down(self, _: web.Request) -> web.Response:
        assert self.site is not None
        self.state["down"] = True
        await self.site.stop()
        return web.Response(status=204)

    async def up(self, _: web.Request) -> web.Response:
        await self.listen(self.port)
        self.state["down"] = False
        return web.Response(status=204)

    async def main(self) -> None:
        """Serve /hook and the control endpoints; print both ports (hook, control) on one line, then run."""
        app = web.Application()
        app.router.add_post("/hook", self.hook)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = await self.listen(0)
        control = web.Application()
        control.router.add_get("/stats", self.stats)
        control.router.add_get("/times", self.times)
        control.router.add_post("/down", self.down)
        control.router.add_post("/up", self.up)
        control_runner = web.AppRunner(control, access_log=None)
        await control_runner.setup()
        control_site = web.TCPSite(control_runner, "127.0.0.1", 0)
        await control_site.start()
        print(self.port, control_site._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]
        await asyncio.Event().wait()


def serve() -> None:
    asyncio.run(Receiver().main())
