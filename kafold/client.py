"""Request/reply for aggregates: send commands to the commands topic and wait for their results; wait until a
connector's read model shows them (read-your-writes, kafold.tokens).

Offset note: before sending, the client takes each results partition's end offset as ListOffsets reports it;
a result is written (by a transaction committed after the command was read) at a later offset, so reading
each partition from there cannot miss it. A broker that under-reports that end only makes the client read a
few records more. Results are read with read_committed: only results of committed batches are seen.

Read-your-writes: an accepted result carries a token (where its events landed); `wait_visible` asks the daemon
(`GET /connectors/{name}/wait`, a `DaemonClient`) to answer once the connector's committed checkpoint covers it. An
event producer makes its own token from delivery reports (`Landed`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kafold import kafka_clients, logs, tokens, tracing
from kafold.config import AggregateConfig, DaemonConfig, KafkaConfig
from kafold.consumer_loop import take
from kafold.errors import KafoldError, RetriableError
from kafold.messages import H_COMMAND_ID, Command, Result, decode_result, header
from kafold.tokens import BadToken

log = logs.get(__name__)

# librdkafka's murmur2_random is the partitioner of the Java client: the same key lands in the same partition
# whichever of the two produced it (the runtime writes events and results to the command's partition).
PARTITIONER = "murmur2_random"


def _producer_kind() -> Any:
    # opentelemetry: kafold[tracing], imported only when [tracing] is on
    from opentelemetry.trace import SpanKind
    return SpanKind.PRODUCER


def _in_span(span: Any) -> Any:
    # opentelemetry: kafold[tracing], imported only when [tracing] is on
    from opentelemetry import trace
    return trace.set_span_in_context(span)


class ResultTimeout(KafoldError):
    """No result arrived in time (the runtime may be down or still recovering); the command may still apply."""


class NotVisible(KafoldError):
    """The connector did not cover the token in time (it may be behind, paused or failed); the write stands."""


class NoToken(KafoldError):
    """The result wrote events but carries no token (a duplicate whose first decision the runtime no longer
    remembers, or a daemon before tokens): there is nothing to wait on."""


REQUEST_MAX_MS = 60_000  # the daemon's longest single wait; a longer timeout is several requests
HTTP_SLACK_S = 5.0  # beyond the wait itself, for the request and its answer
UNREACHABLE_RETRY_S = 0.2
BUSY_RETRY_S = 1.0  # the daemon's Retry-After for a wait past daemon.max_waits


REDIRECTS_MAX = 5
ANSWER_MAX_BYTES = 64 * 1024 * 1024  # far above any state; a daemon (or whatever answers) cannot fill the memory
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows redirects with every header of the request, the bearer token included, to any host:
    `http_get` follows them itself."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of `url`, the default port made explicit: what a credential is sent to."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or ""), parts.port or {"http": 80, "https": 443}.get(parts.scheme)


def http_get(url: str, token: str | None, timeout: float) -> tuple[int, bytes, Any, str]:
    """GET `url` (status, body, headers, the URL that answered), following up to REDIRECTS_MAX redirects to
    http(s) URLs; `token` goes as a bearer token only to `url`'s origin (scheme, host and port), never to a host
    a redirect names (a kafold daemon's redirect carries its own short-lived credential). OSError when nothing
    answers; KafoldError for a redirect elsewhere than http(s), too many of them, or an answer over
    ANSWER_MAX_BYTES."""
    home = origin(url)
    for _ in range(REDIRECTS_MAX + 1):
        req = urllib.request.Request(url)
        if token is not None and origin(url) == home:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return resp.status, _capped(resp, url), resp.headers, url
        except urllib.error.HTTPError as e:
            with e:
                location = e.headers.get("Location") if e.code in REDIRECT_CODES else None
                if location is None:
                    return e.code, _capped(e, url), e.headers, url
            url = urllib.parse.urljoin(url, location)
            if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                raise KafoldError(f"redirected to {url!r}: not an http(s) URL") from None
    raise KafoldError(f"{url}: more than {REDIRECTS_MAX} redirects")


def _capped(resp: Any, url: str) -> bytes:
    raw: bytes = resp.read(ANSWER_MAX_BYTES + 1)
    if len(raw) > ANSWER_MAX_BYTES:
        raise KafoldError(f"{url}: the answer is larger than {ANSWER_MAX_BYTES} bytes")
    return raw


class DaemonClient:
    """The daemon's HTTP API as a service needs it: `wait` until a connector covers a token.

    `url`: the daemon's base URL (e.g. http://127.0.0.1:8083); `token`: its `[daemon].api_token`, if set (sent
    as a bearer token). `for_config` takes both from a kafold.toml's [daemon]."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token

    @classmethod
    def for_config(cls, daemon: DaemonConfig, host: str | None = None) -> DaemonClient:
        """The daemon a kafold.toml's [daemon] describes (on this host when it listens on every address)."""
        if not daemon.http_port:
            raise KafoldError("the daemon's HTTP server is disabled ([daemon].http_port = 0): nothing to wait on")
        host = host or ("127.0.0.1" if daemon.http_host in ("0.0.0.0", "", "::") else daemon.http_host)
        return cls(f"http://{host}:{daemon.http_port}",
                   daemon.api_token.reveal() if daemon.api_token is not None else None)

    def wait(self, connector: str, token: str, timeout: float = 10.0) -> None:
        """Return once `connector`'s committed checkpoint covers `token`. NotVisible after `timeout` seconds;
        BadToken when the token is refused (checked here, then by the daemon against the connector's topics);
        KafoldError for an unknown connector, or a daemon that did not answer within `timeout` (a daemon
        restarting, or holding `daemon.max_waits` waits already, is asked again until then)."""
        tokens.parse(token)
        deadline = time.monotonic() + timeout
        while True:
            left_ms = max(0, min(REQUEST_MAX_MS, int((deadline - time.monotonic()) * 1000)))
            try:
                status, body = self._get(f"/connectors/{urllib.parse.quote(connector, safe='')}/wait",
                                         {"token": token, "timeout_ms": str(left_ms)}, left_ms / 1000 + HTTP_SLACK_S)
            except _Unreachable as e:
                if time.monotonic() + UNREACHABLE_RETRY_S >= deadline:
                    raise KafoldError(f"{self.url}: the daemon did not answer: {e.__cause__}") from e
                time.sleep(UNREACHABLE_RETRY_S)
                continue
            if status == 200:
                return
            message = str(body.get("message", "")) if isinstance(body, dict) else str(body)
            if status == 400 and message.startswith("token:"):
                raise BadToken(message.removeprefix("token:").strip())
            if status == 503 and "max_waits" in message and time.monotonic() + BUSY_RETRY_S < deadline:
                time.sleep(BUSY_RETRY_S)  # the daemon holds its most waits at once; one ends soon
                continue
            if status != 408:
                raise KafoldError(f"{self.url}: waiting on connector {connector!r}: HTTP {status}: {message}")
            if time.monotonic() >= deadline:
                behind = body.get("behind", []) if isinstance(body, dict) else []
                raise NotVisible(f"connector {connector!r} did not cover the token within {timeout:.1f}s "
                                 f"(behind: {json.dumps(behind)})")

    def _get(self, path: str, query: dict[str, str], timeout: float) -> tuple[int, Any]:
        try:
            status, raw, _, _ = http_get(f"{self.url}{path}?{urllib.parse.urlencode(query)}", self.token, timeout)
        except OSError as e:
            raise _Unreachable() from e
        try:
            return status, json.loads(raw or b"null")
        except ValueError as e:
            if status == 200:  # the wait endpoint answers JSON: something else answered
                raise _Unreachable() from e
            return status, raw.decode("utf-8", "replace")[:200]


class _Unreachable(Exception):
    """No HTTP answer (refused, reset, timed out): the daemon may be restarting."""


class Landed:
    """A delivery-report callback (`producer.produce(..., on_delivery=landed)`) that collects where records
    landed; after `flush`, `token` names them all (the last offset per partition) for `DaemonClient.wait`."""

    def __init__(self) -> None:
        self.positions: tokens.Positions = {}
        self.failed: list[str] = []

    def __call__(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.failed.append(str(err))
            return
        tp = (msg.topic(), msg.partition())
        self.positions[tp] = max(msg.offset(), self.positions.get(tp, -1))

    @property
    def token(self) -> str:
        if self.failed:
            raise KafoldError(f"{len(self.failed)} record(s) not delivered: {self.failed[0]}")
        if not self.positions:
            raise KafoldError("no record delivered yet (flush the producer first)")
        return tokens.encode(self.positions)


class CommandClient:
    """Sends commands of one aggregate type; `send` waits for the result when asked to; `wait_visible` waits for
    a result's events in a connector's read model (needs `daemon`)."""

    def __init__(self, kafka: KafkaConfig, agg: AggregateConfig, daemon: DaemonClient | None = None, *,
                 tracer_provider: Any = None) -> None:
        self.agg = agg
        # OpenTelemetry: a span per command (child of the current context) whose `traceparent` rides on the record;
        # None unless a provider is given, kafold.tracing is on here, or the application set a global SDK provider.
        self.tracer = tracing.application_tracer(tracer_provider)
        self.daemon = daemon
        self.commands, self.results = agg.topic("commands"), agg.topic("results")
        self.producer = kafka_clients.producer(kafka, **{"enable.idempotence": True, "acks": "all",
                                                         "linger.ms": 5, "partitioner": PARTITIONER})
        self.kafka = kafka
        self._reader: Any = None

    def command(self, aggregate_id: str, type: str, data: dict[str, Any] | None = None, *,
                expected_version: int | None = None, command_id: str | None = None) -> Command:
        return Command.new(self.agg.name, aggregate_id, type, data, expected_version=expected_version,
                           command_id=command_id)

    def send(self, command: Command, *, wait: bool = True, timeout: float = 30.0) -> Result | None:
        """Send one command; with `wait`, its Result (ResultTimeout if none arrives within `timeout`)."""
        results = self.send_many([command], wait=wait, timeout=timeout)
        return results.get(command.command_id) if wait else None

    def send_many(self, commands: Iterable[Command], *, wait: bool = True,
                  timeout: float = 30.0) -> dict[str, Result]:
        """Send commands (in order per aggregate) and, with `wait`, collect one result per command id."""
        cmds = list(commands)
        starts = self._result_ends() if wait else {}
        partitions = self._produce(cmds)
        if not wait:
            return {}
        return self._collect({c.command_id for c in cmds}, {p: starts[p] for p in set(partitions.values())},
                             timeout)

    def wait_visible(self, result: Result, connector: str, timeout: float = 10.0) -> None:
        """Return once `connector` (e.g. a projection of this aggregate's events) has committed `result`'s
        events: a read of its table after this sees them. At once when the command wrote nothing (rejected, or
        no events); NotVisible after `timeout` s; NoToken when it wrote events but carries no token."""
        if not result.event_ids or not result.accepted:
            return
        if result.token is None:
            why = "a duplicate whose first decision is no longer remembered" if result.duplicate else \
                "a daemon before tokens"
            raise NoToken(f"the result of command {result.command_id!r} carries no token ({why})")
        if self.daemon is None:
            raise KafoldError("waiting on a connector needs CommandClient(..., daemon=DaemonClient(url, token))")
        self.daemon.wait(connector, result.token, timeout)

    def _produce(self, cmds: list[Command]) -> dict[str, int]:
        placed: dict[str, int] = {}
        failed: list[str] = []

        def delivered(cid: str) -> Any:
            def report(err: Any, msg: Any) -> None:
                if err is not None:
                    failed.append(str(err))
                else:
                    placed[cid] = msg.partition()
            return report

        spans = []
        try:
            for c in cmds:
                key, value, headers = c.encode()
                if self.tracer is not None:
                    span = self.tracer.start_span(f"send {self.agg.name} {c.type}", kind=_producer_kind(),
                                                  attributes={"kafold.command_id": c.command_id,
                                                              "kafold.aggregate_id": c.aggregate_id,
                                                              "messaging.destination.name": self.commands})
                    spans.append(span)
                    headers = [*headers, *tracing.inject(_in_span(span))]
                kafka_clients.produce(self.producer, self.commands, value, key, headers,
                                      on_delivery=delivered(c.command_id))
            if self.producer.flush(30) or failed:
                raise RetriableError(f"{self.commands}: commands not acknowledged: {failed[:1] or 'timeout'}")
        finally:
            for span in spans:
                span.end()
        return placed

    def _result_ends(self) -> dict[int, int]:
        reader = self._results_reader()
        meta = reader.list_topics(self.results, timeout=10).topics[self.results]
        if meta.error is not None:
            raise RetriableError(f"results topic {self.results!r}: {meta.error.str()}")
        # Every partition's end in one ListOffsets request per leader (timestamp -1: the latest offset), not a
        # round trip per partition, which an idle `send` waited for in turn (docs/benchmarks.md, aggregates).
        try:
            found = reader.offsets_for_times([TopicPartition(self.results, p, -1) for p in meta.partitions],
                                             timeout=10)
        except KafkaException as e:
            raise RetriableError(f"{self.results}: cannot list offsets: {e}") from e
        ends = {}
        for tp in found:
            if tp.error is not None:
                raise RetriableError(f"{self.results}[{tp.partition}]: cannot list offsets: {tp.error}")
            ends[tp.partition] = max(0, tp.offset)
        return ends

    def _results_reader(self) -> Any:
        if self._reader is None:
            self._reader = kafka_clients.consumer(self.kafka, f"kafold.client.{self.agg.name}", **{
                "isolation.level": "read_committed", "fetch.wait.max.ms": kafka_clients.RANGE_FETCH_WAIT_MS})
        return self._reader

    def _collect(self, wanted: set[str], starts: dict[int, int], timeout: float) -> dict[str, Result]:
        reader = self._results_reader()
        reader.assign([TopicPartition(self.results, p, off) for p, off in starts.items()])
        found: dict[str, Result] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(found) < len(wanted):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResultTimeout(f"{len(wanted) - len(found)} of {len(wanted)} results not received within "
                                        f"{timeout:.1f}s from {self.results!r}")
                for m in take(reader, 1000, min(left, 0.2)):  # at once: no wait for 1,000 results
                    if m.error() is not None:
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            log.warning("client.results_error", error=m.error().str())
                        continue
                    cid = header(m.headers(), H_COMMAND_ID)
                    if cid in wanted and cid not in found and m.value() is not None:
                        found[cid] = decode_result(m.value())
        finally:
            reader.unassign()
        return found

    def close(self) -> None:
        kafka_clients.close_producer(self.producer, 10)
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def __enter__(self) -> CommandClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
