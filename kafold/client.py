"""Request/reply for aggregates, blocking: send commands to the commands topic and wait for their results; wait
until a connector's read model shows them (read-your-writes, kafold.tokens). kafold.aio is the same for asyncio.

The protocol is shared with kafold.aio: the command side (records, results partitions' ends, matching results by
command id, the offset note) is kafold.request_reply, the daemon's HTTP API (paths, answers, redirects, retries)
is kafold.daemon_api; this module drives them with a confluent-kafka producer and consumer and with urllib.

Read-your-writes: an accepted result carries a token (where its events landed); `wait_visible` asks the daemon
(`GET /connectors/{name}/wait`, a `DaemonClient`) to answer once the connector's committed checkpoint covers it. An
event producer makes its own token from delivery reports (`Landed`).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any, TypeVar

from kafold import daemon_api, kafka_clients, tokens
from kafold.config import AggregateConfig, KafkaConfig
from kafold.consumer_loop import take
from kafold.daemon_api import ANSWER_MAX_BYTES, REDIRECT_CODES, Backoff, NotVisible, Reply, Unreachable, origin
from kafold.errors import KafoldError, RetriableError
from kafold.messages import Command, Result
from kafold.request_reply import (
    PARTITIONER,
    PRODUCER_SETTINGS,
    Commands,
    NoToken,
    ResultTimeout,
    results_in,
    token_to_wait_on,
)
from kafold.tokens import BadToken

__all__ = ["PARTITIONER", "BadToken", "CommandClient", "DaemonClient", "Landed", "NoToken", "NotVisible",
           "ResultTimeout", "http_get", "origin", "run_flow"]

T = TypeVar("T")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows redirects with every header of the request, the bearer token included, to any host:
    kafold.daemon_api.get follows them itself."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _hop(hop: daemon_api.Hop) -> Reply | Unreachable:
    req = urllib.request.Request(hop.url)
    if hop.bearer is not None:
        req.add_header("Authorization", f"Bearer {hop.bearer}")
    try:
        with _OPENER.open(req, timeout=hop.timeout) as resp:
            return Reply(resp.status, resp.read(ANSWER_MAX_BYTES + 1), resp.headers, hop.url)
    except urllib.error.HTTPError as e:  # every status but 2xx, redirects included (not followed here)
        with e:
            body = b"" if e.code in REDIRECT_CODES else e.read(ANSWER_MAX_BYTES + 1)
            return Reply(e.code, body, e.headers, hop.url)
    except OSError as e:
        return Unreachable.of(e)


def run_flow(flow: daemon_api.Flow[T]) -> T:
    """Drive a kafold.daemon_api flow with urllib (blocking)."""
    outcome: Reply | Unreachable | None = None
    while True:
        done, step = daemon_api.resume(flow, outcome)
        if done:
            return step
        if isinstance(step, Backoff):
            time.sleep(step.seconds)
            outcome = None
        else:
            outcome = _hop(step)


def http_get(url: str, token: str | None, timeout: float) -> tuple[int, bytes, Any, str]:
    """GET `url` (status, body, headers, the URL that answered), following redirects the token-safe way
    (kafold.daemon_api.get: `token` only to `url`'s origin, at most REDIRECTS_MAX, http(s) only, an answer of at
    most ANSWER_MAX_BYTES; KafoldError otherwise). OSError when nothing answers."""
    try:
        reply = run_flow(daemon_api.get(url, token, timeout))
    except Unreachable as e:
        assert e.__cause__ is not None
        raise e.__cause__ from None
    return reply.status, reply.body, reply.headers, reply.url


class DaemonClient(daemon_api.Endpoint):
    """The daemon's HTTP API as a service needs it: `wait` until a connector covers a token, `state` of an
    aggregate.

    `url`: the daemon's base URL (e.g. http://127.0.0.1:8083); `token`: its `[daemon].api_token`, if set (sent
    as a bearer token). `for_config` takes both from a kafold.toml's [daemon]."""

    def wait(self, connector: str, token: str, timeout: float = 10.0) -> None:
        """Return once `connector`'s committed checkpoint covers `token`. NotVisible after `timeout` seconds;
        BadToken when the token is refused (checked here, then by the daemon against the connector's topics);
        KafoldError for an unknown connector, or a daemon that did not answer within `timeout` (a daemon
        restarting is asked again until then)."""
        run_flow(self.wait_flow(connector, token, timeout))

    def state(self, aggregate: str, aggregate_id: str, min_version: int | None = None,
              timeout: float = 10.0, version: int | None = None) -> dict[str, Any]:
        """The daemon's answer to `GET /aggregates/{aggregate}/{id}` (kafold.daemon_api.Endpoint.state_flow)."""
        return run_flow(self.state_flow(aggregate, aggregate_id, min_version, timeout, version))


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
        self._commands = Commands(agg, tracer_provider)
        self.tracer = self._commands.tracer
        self.daemon = daemon
        self.commands, self.results = self._commands.commands, self._commands.results
        self.producer = kafka_clients.producer(kafka, **PRODUCER_SETTINGS)
        self.kafka = kafka
        self._reader: Any = None

    def command(self, aggregate_id: str, type: str, data: dict[str, Any] | None = None, *,
                expected_version: int | None = None, command_id: str | None = None) -> Command:
        return self._commands.command(aggregate_id, type, data, expected_version=expected_version,
                                      command_id=command_id)

    def send(self, command: Command, *, wait: bool = True, timeout: float = 30.0) -> Result | None:
        """Send one command; with `wait`, its Result (ResultTimeout if none arrives within `timeout`)."""
        results = self.send_many([command], wait=wait, timeout=timeout)
        return results.get(command.command_id) if wait else None

    def send_many(self, commands: Iterable[Command], *, wait: bool = True,
                  timeout: float = 30.0) -> dict[str, Result]:
        """Send commands (in order per aggregate) and, with `wait`, collect one result per command id."""
        cmds = list(commands)
        starts = self._commands.result_ends(self._results_reader()) if wait else {}
        partitions = self._produce(cmds)
        if not wait:
            return {}
        return self._collect({c.command_id for c in cmds}, {p: starts[p] for p in set(partitions.values())},
                             timeout)

    def wait_visible(self, result: Result, connector: str, timeout: float = 10.0) -> None:
        """Return once `connector` (e.g. a projection of this aggregate's events) has committed `result`'s
        events: a read of its table after this sees them. At once when the command wrote nothing (rejected, or
        no events); NotVisible after `timeout` s; NoToken when it wrote events but carries no token."""
        token = token_to_wait_on(result)
        if token is None:
            return
        if self.daemon is None:
            raise KafoldError("waiting on a connector needs CommandClient(..., daemon=DaemonClient(url, token))")
        self.daemon.wait(connector, token, timeout)

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
                key, value, headers, span = self._commands.record(c)
                if span is not None:
                    spans.append(span)
                kafka_clients.produce(self.producer, self.commands, value, key, headers,
                                      on_delivery=delivered(c.command_id))
            if self.producer.flush(30) or failed:
                raise RetriableError(f"{self.commands}: commands not acknowledged: {failed[:1] or 'timeout'}")
        finally:
            for span in spans:
                span.end()
        return placed

    def _results_reader(self) -> Any:
        if self._reader is None:
            self._reader = self._commands.reader(self.kafka)
        return self._reader

    def _collect(self, wanted: set[str], starts: dict[int, int], timeout: float) -> dict[str, Result]:
        reader = self._results_reader()
        self._commands.assign(reader, starts)
        found: dict[str, Result] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(found) < len(wanted):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResultTimeout(f"{len(wanted) - len(found)} of {len(wanted)} results not received within "
                                        f"{timeout:.1f}s from {self.results!r}")
                # at once: no wait for 1,000 results
                for cid, result in results_in(take(reader, 1000, min(left, 0.2)), wanted):
                    found.setdefault(cid, result)
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
