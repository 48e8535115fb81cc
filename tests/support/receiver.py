"""A real HTTP receiver on 127.0.0.1 (aiohttp in its own thread) that records every webhook request."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class Req:
    event_id: str
    key: str
    version: int
    at: float
    headers: dict[str, str]
    body: bytes
    status: int = 200
    answered_at: float = 0.0


Behaviour = Callable[[Req], Awaitable[tuple[int, dict[str, str]] | None]]


@dataclass
class Receiver:
    behaviour: Behaviour | None = None
    requests: list[Req] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, port: int = 0) -> str:
        """Serve on `port` (0 = a free one; the same port again after `stop` brings the receiver back)."""
        ready: threading.Event = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready, port), daemon=True)
        self._thread.start()
        assert ready.wait(10)
        return f"http://127.0.0.1:{self.port}/hook"

    def _serve(self, ready: threading.Event, port: int) -> None:
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", port)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._runner = runner
        ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        doc = orjson.loads(body)
        req = Req(request.headers.get("webhook-id", ""), doc.get("aggregate_id", ""), int(doc.get("version", 0)),
                  time.monotonic(), dict(request.headers), body)
        with self.lock:
            self.requests.append(req)
        answer = await self.behaviour(req) if self.behaviour is not None else None
        status, headers = answer or (200, {})
        req.status, req.answered_at = status, time.monotonic()
        return web.Response(status=status, headers=headers)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def successes(self) -> list[Req]:
        with self.lock:
            return [r for r in self.requests if 200 <= r.status < 300 and r.answered_at]

    def delivered_at(self) -> dict[str, float]:
        """Event id -> when its first successful request was answered."""
        out: dict[str, float] = {}
        for r in self.successes():
            out.setdefault(r.event_id, r.answered_at)
        return out

    def per_key(self, only_success: bool = True) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        with self.lock:
            reqs = list(self.requests)
        for r in reqs:
            if not only_success or 200 <= r.status < 300:
                out.setdefault(r.key, []).append(r.version)
        return out


def as_dict(x: Any) -> dict[str, Any]:
    return dict(x)
