"""GET /connectors/{name}/wait: the long-poll view over the host's watches (visibility.py says what "covered" is)."""

from __future__ import annotations

import time
from typing import Any

from faust.web import Request, Response

from kafold import tokens
from kafold.daemon.http import HostView
from kafold.tokens import BadToken

DEFAULT_TIMEOUT_MS = 10_000
MAX_TIMEOUT_MS = 60_000  # a longer wait is a client's loop of requests (kafold.client.DaemonClient does that)
RETRY_AFTER_S = 1  # what a client refused for too many waits is told to wait before it asks again


class WaitView(HostView):
    """200 {"covered": true} once covered; 408 on timeout; 400 for a bad token; 404 for an unknown connector."""

    async def get(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        group = self.host.group(name)
        if group is None:
            return self.problem(404, f"Connector {name} not found")
        try:
            wanted = tokens.parse(request.query.get("token"))
        except BadToken as e:
            return self.problem(400, f"token: {e}")
        timeout_ms = _timeout_ms(request.query.get("timeout_ms"))
        if timeout_ms is None:
            return self.problem(400, f"timeout_ms: expected an integer from 0 to {MAX_TIMEOUT_MS}")
        foreign = sorted({t for t, _ in wanted} - set(group.connector.settings.topics))
        if foreign:
            return self.problem(400, f"token: names topic {foreign[0]!r}, which connector {name} does not read "
                                f"(it reads {', '.join(group.connector.settings.topics)})")
        all_watches = self.host.watches
        if all_watches.active >= self.host.cfg.daemon.max_waits:
            self.host.metrics.waited(name, "refused")
            return self.json({"error_code": 503, "message": f"too many waits at once (daemon.max_waits = "
                              f"{self.host.cfg.daemon.max_waits}); retry later"}, status=503,
                             headers={"Retry-After": str(RETRY_AFTER_S)})
        watch = all_watches.get(name, group)
        started = time.monotonic()
        all_watches.active += 1
        try:
            covered = await watch.wait(wanted, timeout_ms / 1000)
        finally:
            all_watches.active -= 1
        waited_s = time.monotonic() - started
        result = "covered" if covered else "unreadable" if watch.error is not None else "timeout"
        self.host.metrics.waited(name, result, waited_s)
        if covered:
            return self.json({"covered": True, "connector": name, "waited_ms": round(waited_s * 1000, 1)})
        if watch.error is not None:
            return self.problem(503, f"Connector {name}: committed positions not readable: {watch.error}")
        behind = tokens.missing(wanted, watch.seen)
        return self.json({"error_code": 408, "covered": False, "message": f"Connector {name} did not cover the "
                          f"token within {timeout_ms} ms", "behind": [
                              {"topic": t, "partition": p, "offset": wanted[(t, p)],
                               "committed": watch.seen.get((t, p))} for t, p in behind]}, status=408)


def _timeout_ms(raw: str | None) -> int | None:
    if raw is None:
        return DEFAULT_TIMEOUT_MS
    if not tokens.digits(raw, MAX_TIMEOUT_MS):
        return None
    return int(raw)


ROUTES: dict[str, type[HostView]] = {"/connectors/{name}/wait": WaitView}
