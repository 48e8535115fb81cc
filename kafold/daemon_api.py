"""The daemon's HTTP API as a service speaks it, written once without I/O: paths, answers, the token-safe
redirect rule and the retry loops, as flows that kafold.client (urllib, blocking) and kafold.aio (aiohttp) drive.

A flow is a generator: it yields what to do next, a `Hop` (one GET; redirects are the flow's business) or a
`Backoff`, and is sent the `Reply` to each hop; a driver that got no HTTP answer throws `Unreachable` (caused by
its transport's error) into the flow instead. The same split as h11 or httpx's `Auth.auth_flow`: the protocol
has one implementation and each transport is a loop of a few lines (`resume` is the step they share).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from kafold import tokens
from kafold.config import DaemonConfig
from kafold.errors import KafoldError
from kafold.tokens import BadToken

T = TypeVar("T")

REQUEST_MAX_MS = 60_000  # the daemon's longest single wait; a longer timeout is several requests
HTTP_SLACK_S = 5.0  # beyond the wait itself, for the request and its answer
UNREACHABLE_RETRY_S = 0.2
STATE_SLACK_S = 10.0  # a state read may be forwarded to the owner, which can itself wait (min_version)

REDIRECTS_MAX = 5
ANSWER_MAX_BYTES = 64 * 1024 * 1024  # far above any state; a daemon (or whatever answers) cannot fill the memory
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class Hop:
    """One GET, no redirect followed; `bearer` is this request's token (None: no Authorization header). A driver
    reads at most ANSWER_MAX_BYTES + 1 bytes of the body (the flow refuses more)."""
    url: str
    bearer: str | None
    timeout: float


@dataclass(frozen=True)
class Backoff:
    seconds: float


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: Any  # the transport's case-insensitive mapping (urllib's HTTPMessage, aiohttp's CIMultiDictProxy)
    url: str


Step = Hop | Backoff
Flow = Generator[Step, Reply | None, T]


class Unreachable(KafoldError):
    """No HTTP answer (refused, reset, timed out): the daemon may be restarting. `__cause__` is the transport's
    error."""

    @classmethod
    def of(cls, error: BaseException) -> Unreachable:
        made = cls(str(error))
        made.__cause__ = error
        return made


class NotVisible(KafoldError):
    """The connector did not cover the token in time (it may be behind, paused or failed); the write stands."""


def resume(flow: Flow[T], outcome: Reply | Unreachable | None) -> tuple[bool, Any]:
    """Send `outcome` (the last hop's reply, or Unreachable) into `flow`: (False, the next step) or (True, what
    the flow returned)."""
    try:
        step = flow.throw(outcome) if isinstance(outcome, Unreachable) else flow.send(outcome)
    except StopIteration as done:
        return True, done.value
    return False, step


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of `url`, the default port made explicit: what a credential is sent to."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or ""), parts.port or {"http": 80, "https": 443}.get(parts.scheme)


def get(url: str, token: str | None, timeout: float) -> Flow[Reply]:
    """GET `url`, following up to REDIRECTS_MAX redirects to http(s) URLs; `token` goes as a bearer token only to
    `url`'s origin (scheme, host and port), never to a host a redirect names (a kafold daemon's redirect carries
    its own short-lived credential). KafoldError for a redirect elsewhere than http(s), too many of them, or an
    answer over ANSWER_MAX_BYTES."""
    home = origin(url)
    for _ in range(REDIRECTS_MAX + 1):
        reply = yield Hop(url, token if token is not None and origin(url) == home else None, timeout)
        assert reply is not None  # a driver answers every Hop
        location = reply.headers.get("Location") if reply.status in REDIRECT_CODES else None
        if location is None:
            if len(reply.body) > ANSWER_MAX_BYTES:
                raise KafoldError(f"{url}: the answer is larger than {ANSWER_MAX_BYTES} bytes")
            return reply
        url = urllib.parse.urljoin(url, location)
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise KafoldError(f"redirected to {url!r}: not an http(s) URL")
    raise KafoldError(f"{url}: more than {REDIRECTS_MAX} redirects")


class Endpoint:
    """A daemon's base URL and its `[daemon].api_token` (sent as a bearer token), and the flows of its API that a
    service needs. `for_config` takes both from a kafold.toml's [daemon]."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token

    @classmethod
    def for_config(cls, daemon: DaemonConfig, host: str | None = None) -> Self:
        """The daemon a kafold.toml's [daemon] describes (on this host when it listens on every address)."""
        if not daemon.http_port:
            raise KafoldError("the daemon's HTTP server is disabled ([daemon].http_port = 0): nothing to wait on")
        host = host or ("127.0.0.1" if daemon.http_host in ("0.0.0.0", "", "::") else daemon.http_host)
        return cls(f"http://{host}:{daemon.http_port}",
                   daemon.api_token.reveal() if daemon.api_token is not None else None)

    def wait_flow(self, connector: str, token: str, timeout: float) -> Flow[None]:
        """`GET /connectors/{connector}/wait` until the connector's committed checkpoint covers `token`, asked
        again for waits longer than the daemon's longest (REQUEST_MAX_MS), while it does not answer and while it
        holds its most waits at once (503 with Retry-After: `daemon.max_waits`). NotVisible
        after `timeout` s; BadToken when the token is refused (checked here, then by the daemon against the
        connector's topics); KafoldError for an unknown connector, or a daemon silent until `timeout`."""
        tokens.parse(token)
        deadline = time.monotonic() + timeout
        path = f"{self.url}/connectors/{urllib.parse.quote(connector, safe='')}/wait"
        while True:
            left_ms = max(0, min(REQUEST_MAX_MS, int((deadline - time.monotonic()) * 1000)))
            query = urllib.parse.urlencode({"token": token, "timeout_ms": str(left_ms)})
            try:
                reply = yield from get(f"{path}?{query}", self.token, left_ms / 1000 + HTTP_SLACK_S)
                body = _json(reply)
            except Unreachable as e:
                if time.monotonic() + UNREACHABLE_RETRY_S >= deadline:
                    raise KafoldError(f"{self.url}: the daemon did not answer: {e.__cause__}") from e
                yield Backoff(UNREACHABLE_RETRY_S)
                continue
            if reply.status == 200:
                return
            message = str(body.get("message", "")) if isinstance(body, dict) else str(body)
            if reply.status == 400 and message.startswith("token:"):
                raise BadToken(message.removeprefix("token:").strip())
            busy = retry_after(reply.headers) if reply.status == 503 else None
            if busy is not None and time.monotonic() + busy < deadline:
                yield Backoff(busy)  # the daemon holds `daemon.max_waits` waits already; one ends soon
                continue
            if reply.status != 408:
                raise KafoldError(f"{self.url}: waiting on connector {connector!r}: HTTP {reply.status}: {message}")
            if time.monotonic() >= deadline:
                behind = body.get("behind", []) if isinstance(body, dict) else []
                raise NotVisible(f"connector {connector!r} did not cover the token within {timeout:.1f}s "
                                 f"(behind: {json.dumps(behind)})")

    def state_flow(self, aggregate: str, aggregate_id: str, min_version: int | None = None,
                   timeout: float = 10.0, version: int | None = None) -> Flow[dict[str, Any]]:
        """`GET /aggregates/{aggregate}/{id}` (any instance: it forwards or redirects to the owner), asked again
        while the key's partition moves (503 with Retry-After) until `timeout` s; with `min_version`, the daemon
        waits until the state has reached it; with `version`, the state after the aggregate's first `version`
        events (from its history). The answer's JSON; KafoldError for anything but the state."""
        # the daemon waits at most 60 s per read (daemon/aggregates/routing.py WAIT_MAX_MS)
        target = f"{self.url}/aggregates/{urllib.parse.quote(aggregate, safe='')}/" \
                 f"{urllib.parse.quote(aggregate_id, safe='')}"
        query: dict[str, int] = {} if version is None else {"version": version}
        if min_version is not None:
            query.update(min_version=min_version, timeout_ms=min(int(timeout * 1000), REQUEST_MAX_MS))
        if query:
            target += "?" + urllib.parse.urlencode(query)
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = yield from get(target, self.token, timeout + STATE_SLACK_S)
            except Unreachable as e:
                raise KafoldError(f"{target}: {e.__cause__}") from None
            if reply.status == 200:
                try:
                    body: dict[str, Any] = json.loads(reply.body)
                except ValueError as e:
                    raise KafoldError(f"{target}: {e}") from None
                return body
            pause = retry_after(reply.headers) if reply.status == 503 else None
            if pause is None or time.monotonic() + pause > deadline:
                where = target if reply.url == target else f"{target} (redirected to {reply.url.split('?')[0]})"
                raise KafoldError(f"{where}: {reply.status} {_message(reply.body)}")
            yield Backoff(pause)


def _json(reply: Reply) -> Any:
    """The wait endpoint's JSON answer; Unreachable when a 200 is not JSON (something else answered)."""
    try:
        return json.loads(reply.body or b"null")
    except ValueError as e:
        if reply.status == 200:
            raise Unreachable.of(e) from e
        return reply.body.decode("utf-8", "replace")[:200]


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw).get("message", ""))
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace")


def retry_after(headers: Any) -> float | None:
    """The pause a 503 asks for; None without Retry-After (not a partition moving: asking again will not help)."""
    if headers.get("Retry-After") is None:
        return None
    try:
        return max(0.1, float(headers["Retry-After"]))
    except ValueError:
        return 1.0
