"""The daemon's HTTP views on Faust's web server: /health, /ready, /metrics, /aggregates and bearer-token auth."""

from __future__ import annotations

import base64
import binascii
import hmac
from typing import Any, cast

import faust
import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from faust.web import Request, Response, View
from faust.web.drivers.aiohttp import Web as AiohttpWeb

from kafold.daemon import status
from kafold.daemon.aggregates import history, routing, trust
from kafold.daemon.hosting import Host
from kafold.daemon.metrics import CONTENT_TYPE
from kafold.errors import ConfigError, KafoldError

# The only routes answered without the bearer token (docs/security.md): orchestrator probes (kubelet, systemd)
# cannot carry a secret, and these show only liveness and the connectors' readiness.
OPEN_PATHS = frozenset({"/health", "/ready"})
STATE_PATH = "/aggregates/{name}/{id}"  # also answers other instances' signed reads (_instance_read)
# The status page (status_page.py) for a browser, which cannot send a bearer header: it also takes the token as the
# password of HTTP Basic, on GET and HEAD only, since a browser sends cached Basic credentials with any request to
# the origin, a cross-site form's POST included (docs/security.md#the-status-page).
PAGE_PATH = "/ui"
EVENTS_PATH = "/aggregates/{name}/{id}/events"


def token_guard(host: Host) -> Middleware:
    """The aiohttp middleware that refuses, when a token is configured, every request without it but those
    routed to OPEN_PATHS: kafold's views, Faust's own (index, router, tables, whatever a Faust upgrade adds),
    unknown paths and unserved methods alike. The one place auth is decided."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        page = _route(request) == PAGE_PATH and request.method in ("GET", "HEAD")
        if not _open(request) and not authorized(host.token, header) and not _instance_read(host, request) \
                and not (page and basic_authorized(host.token, header)):
            challenge = 'Basic realm="kafold", charset="UTF-8"' if page else 'Bearer realm="kafold"'
            return web.json_response({"error_code": 401, "message": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": challenge})
        return await handler(request)

    return guard


def guard_web(app: faust.App, host: Host) -> None:
    """Put `token_guard` in front of every route of `app`'s web server (before it starts)."""
    server = app.web
    if not isinstance(server, AiohttpWeb):  # another web driver would serve everything without the token
        raise KafoldError(f"the daemon's web server must be Faust's aiohttp driver, not {type(server).__name__}")
    server.web_app.middlewares.append(token_guard(host))


def _open(request: web.Request) -> bool:
    """True when the request was routed to one of OPEN_PATHS (by the route that matched, not by the raw path)."""
    info = request.match_info
    resource = info.route.resource if info.http_exception is None else None
    return resource is not None and resource.canonical in OPEN_PATHS


def _route(request: web.Request) -> str | None:
    """The path pattern of the route the request was routed to (None: no route matched)."""
    info = request.match_info
    resource = info.route.resource if info.http_exception is None else None
    return None if resource is None else resource.canonical


def _instance_read(host: Host, request: web.Request) -> bool:
    """True for a state read another instance sent on (or redirected here) with a valid instance credential: the
    one request accepted without the API token, because the sending instance checked it (routing.py, trust.py)."""
    info = request.match_info
    resource = info.route.resource if info.http_exception is None else None
    return resource is not None and resource.canonical == STATE_PATH and trust.instance_read(
        host.instance_key, request.method, request.raw_path, request.headers)


class HostView(View):
    """Base view: knows the host (auth is `token_guard`'s, in front of every view)."""

    host: Host

    def problem(self, status: int, message: str) -> Response:
        """Kafka Connect's error body."""
        return self.json({"error_code": status, "message": message}, status=status)

    def state_json(self, value: Any, status: int, headers: dict[str, str]) -> Response:
        """An aggregate's state as JSON with its integers exact at any size (Faust's encoder, orjson, refuses one
        beyond 64 bits, and a state may hold one)."""
        return self.bytes(msgspec.json.encode(value), content_type="application/json", status=status,
                          headers=headers)


def authorized(token: str | None, header: str) -> bool:
    """True when no token is configured, or the header is `Bearer <token>` (compared in constant time). Never
    raises: aiohttp hands undecodable header bytes over as lone surrogates, which a strict encode would turn into
    an exception quoting the header, token and all, in the log (and a 500 instead of a 401)."""
    if token is None:
        return True
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"),
                                                              token.encode())


def basic_authorized(token: str | None, header: str) -> bool:
    """True when the header is `Basic base64(<any user>:<token>)` (the password compared in constant time). Never
    raises, whatever the header holds (as `authorized`)."""
    scheme, _, given = header.partition(" ")
    if token is None or scheme.lower() != "basic":
        return False
    try:
        decoded = base64.b64decode(given.strip().encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        return False
    _, colon, password = decoded.partition(b":")
    return bool(colon) and hmac.compare_digest(password, token.encode())


class Health(HostView):
    async def get(self, request: Request, **kwargs: Any) -> Response:
        return self.json({"status": "ok" if not self.host.failed else "failing"},
                         status=200 if not self.host.failed else 503)


# What /ready shows of each part that is not ready: where and why in a word, nothing a value could be quoted in
# (a fold error's message may quote an event's data: it stays behind the token, on /status).
READY_FIELDS = frozenset({"connector", "task", "state", "aggregate", "reason"})


def readiness(report: dict[str, Any]) -> dict[str, Any]:
    """The host's ready report as /ready shows it: the verdict, and per part not ready only READY_FIELDS (and the
    numbers of the partitions it waits on)."""
    waiting = []
    for part in report.get("not_ready", ()):
        shown = {k: v for k, v in part.items() if k in READY_FIELDS}
        partitions = [p.get("partition") for p in part.get("partitions", ())]
        waiting.append({**shown, **({"partitions": partitions} if partitions else {})})
    return {**{k: v for k, v in report.items() if k != "not_ready"}, "not_ready": waiting}


class Ready(HostView):
    # In OPEN_PATHS like /health: it shows only the connectors' readiness (`readiness`), no offsets, data,
    # error messages or configuration.
    async def get(self, request: Request, **kwargs: Any) -> Response:
        ready, report = self.host.ready_report()
        return self.json(readiness(report), status=200 if ready else 503)


class Metrics(HostView):
    async def get(self, request: Request, **kwargs: Any) -> Response:
        return self.bytes(self.host.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


class Status(HostView):
    """kafold's own status (not a Connect path): one row per assigned partition, for `kafold status` (daemon/status.py
    builds it, for the status page too)."""

    async def get(self, request: Request, **kwargs: Any) -> Response:
        return self.json(await status.report(self.host))


class AggregateState(HostView):
    """GET /aggregates/{name}/{id}[?min_version=N&timeout_ms=T] on any instance: served by the owner of the key's
    partition (sent on to it, or redirected there: `[daemon] state_routing`; routing.py)."""

    async def get(self, request: Request, name: str = "", id: str = "", **kwargs: Any) -> Response:
        slot = self.host.aggregates.get(name)
        if slot is None:
            return self.problem(404, f"Aggregate {name} not found")
        try:
            wait = routing.Wait.parse(request.query)
            version = history.version_query(request.query)
        except ValueError as e:
            return self.problem(400, str(e))
        if version is not None:  # an earlier state: from the history (any instance), not the owner's runtime
            got = await self.host.call(self.host.histories.state, slot, id, version)
            return self.state_json(got.body, got.status, got.headers)
        # Faust's aiohttp driver hands over aiohttp's own request (guard_web insists on that driver)
        got = await self.host.router.read(slot, id, wait, cast(web.Request, request), self.app.http_client)
        return self.state_json(got.body, got.status, got.headers)


class AggregateEvents(HostView):
    """GET /aggregates/{name}/{id}/events[?from_version=N&limit=L]: a page of the aggregate's events and the link to
    the next (daemon/aggregates/history.py); any instance answers it."""

    async def get(self, request: Request, name: str = "", id: str = "", **kwargs: Any) -> Response:
        slot = self.host.aggregates.get(name)
        if slot is None:
            return self.problem(404, f"Aggregate {name} not found")
        try:
            from_version, limit = history.page_query(request.query)
        except ValueError as e:
            return self.problem(400, str(e))
        got = await self.host.call(self.host.histories.page, slot, id, from_version, limit)
        return self.json(got.body, status=got.status, headers=got.headers)


class Reload(HostView):
    """POST /reload: re-read the configuration file and apply its connectors (as SIGHUP does)."""

    async def post(self, request: Request, **kwargs: Any) -> Response:
        try:
            result = await self.host.call(self.host.reload)
        except ConfigError as e:
            return self.json({"error_code": 400, "message": "the configuration file is invalid; the running "
                              "configuration stays", "problems": e.problems}, status=400)
        except KafoldError as e:
            return self.json({"error_code": 409, "message": str(e)}, status=409)
        return self.json(result)


class ForgetSubject(HostView):
    """POST /subjects/{subject}/forget: delete the subject's data key (kafold.protect), record the erasure (actor:
    the `X-Kafold-Actor` header, else `api-token`), and drop it from this process's key caches at once."""

    async def post(self, request: Request, subject: str = "", **kwargs: Any) -> Response:
        protector = self.host.protector
        if protector is None:
            return self.problem(404, "no aggregate has protected fields")
        actor = request.headers.get("X-Kafold-Actor", "api-token")[:200]
        existed = await self.host.call(lambda: protector.ring.forget(subject, actor))
        for name, slot in self.host.aggregates.items():  # states folded while the key existed are refolded
            if any(a == name and rule.subject == "aggregate_id" for (a, _), rule in protector.rules.items()):
                slot.runtime.forget(subject)
        return self.json({"subject_hash": protector.ring.cipher.subject_hash(subject), "key_deleted": existed,
                          "actor": actor})


ROUTES: dict[str, type[HostView]] = {
    "/health": Health,
    "/ready": Ready,
    "/metrics": Metrics,
    "/status": Status,
    STATE_PATH: AggregateState,
    EVENTS_PATH: AggregateEvents,
    "/reload": Reload,
    "/subjects/{subject}/forget": ForgetSubject,
}
