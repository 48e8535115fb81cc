"""Request/reply and read-your-writes for asyncio services (FastAPI, aiohttp, anyio on asyncio): kafold.client's
protocol (kafold.request_reply, kafold.daemon_api) driven without a thread per call.

Choices, and why:
- Kafka: confluent-kafka's Producer and Consumer block, so each client has ONE thread (`_Pump`) that serves its
  producer's delivery reports and reads its results topic, and hands what it found to the event loop with one
  `loop.call_soon_threadsafe` per batch, where the callers' futures are resolved. `confluent_kafka.aio`'s
  AIOProducer is not used: it refuses record headers (a command carries its id and trace context in headers) and
  sends every batch through a thread pool; its AIOConsumer too hands each poll to a pool.
- Results: the reader is assigned to every results partition from its end offset, taken once at start (the
  offset note of kafold.request_reply), and reads on from there; a send registers its future under its command id
  before it produces, so its result (written after the command was read) cannot pass unseen.
- HTTP to the daemon: aiohttp, one session (connection pool) per DaemonClient. It is the `aio` extra
  (`pip install 'kafold[aio]'`): the core install imports this module and sends commands without it, and a daemon
  call names the missing extra (kafold.extras). urllib in a thread pool would be a thread per concurrent wait; a
  hand-written HTTP/1.1 client over asyncio streams would be one more place for a redirect or TLS bug.
- Cancellation: a cancelled `send`/`wait` takes its future out of the client's tables on its way out (nothing
  left to resolve later); a record already handed to librdkafka is still delivered (like a timed-out sync send,
  the command may apply). `aclose()` (or leaving `async with`) stops the thread after a bounded flush and fails
  every caller still waiting with ClientClosed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from typing import Any, Self, TypeVar

from kafold import daemon_api, kafka_clients, logs, tokens
from kafold.config import AggregateConfig, KafkaConfig
from kafold.consumer_loop import take
from kafold.daemon_api import ANSWER_MAX_BYTES, Backoff, NotVisible, Reply, Unreachable
from kafold.envelope import Event, encode
from kafold.errors import KafoldError, RetriableError
from kafold.extras import missing_extra
from kafold.messages import Command, Result
from kafold.request_reply import PRODUCER_SETTINGS, Commands, NoToken, ResultTimeout, results_in, token_to_wait_on
from kafold.retry import retrying
from kafold.tokens import BadToken

try:
    import aiohttp
    import yarl
except ImportError as e:  # the `aio` extra; DaemonClient says so when it is made
    aiohttp = None  # type: ignore[assignment]
    _NO_AIOHTTP: str | None = missing_extra(e, extra="aio")
else:
    _NO_AIOHTTP = None

__all__ = ["BadToken", "ClientClosed", "CommandClient", "DaemonClient", "EventProducer", "NoToken", "NotVisible",
           "ResultTimeout"]

log = logs.get(__name__)
T = TypeVar("T")

ACK_TIMEOUT_S = 30.0  # as the sync client's flush: a record not acknowledged by then is reported, not awaited on
CLOSE_FLUSH_S = 10.0
START_WITHIN_S = 30.0
IDLE_POLL_S = 0.05  # nobody waits for a result: block on delivery reports, glance at the results between
RESULTS_SLICE_S = 0.01  # someone waits: read results, and serve delivery reports at least this often
BATCH = 1000
FULL_QUEUE_PAUSE_S = 0.01


class ClientClosed(KafoldError):
    """The client was closed (or its thread stopped on an error) while this call waited; a command sent may still
    apply."""


class _Pump:
    """A client's one thread: it polls the producer (delivery reports) and reads the results topic (when there is
    a reader), and passes both to the event loop in batches. Futures are only touched on the loop's thread."""

    def __init__(self, name: str, producer: Any, commands: Commands | None = None, kafka: KafkaConfig | None = None
                 ) -> None:
        self.loop = asyncio.get_running_loop()
        self.producer, self.commands, self.kafka = producer, commands, kafka
        # command id -> the futures of the sends waiting for its result. Written on the loop's thread only; the
        # thread only asks `cid in waiters` (one dict lookup, atomic) to skip decoding results nobody wants. A send
        # registers before it produces, so a result is never read before its waiter is there.
        self.waiters: dict[str, list[asyncio.Future[Result]]] = {}
        self.reports: list[tuple[asyncio.Future[Any], Any, Any, Any]] = []  # the thread's, between two hand-overs
        self.started: asyncio.Future[None] = self.loop.create_future()
        self.stopped: asyncio.Future[None] = self.loop.create_future()
        self.failure: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"kafold-aio-{name}", daemon=True)
        self.thread.start()

    def delivered(self, future: asyncio.Future[Any], span: Any = None) -> Any:
        """An on_delivery callback for one record: collected on the thread, settled on the loop."""
        def report(err: Any, msg: Any) -> None:
            self.reports.append((future, err, msg, span))
        return report

    def _run(self) -> None:
        reader = None
        try:
            commands = self.commands
            if commands is not None:
                assert self.kafka is not None
                reader = commands.reader(self.kafka)
                # a results topic just created has no leader yet for a moment (NOT_LEADER_FOR_PARTITION)
                ends = retrying(lambda: commands.result_ends(reader), within_s=START_WITHIN_S,
                                stop=self.stopping, on_retry=lambda e, delay: log.info(
                                    "aio.results_not_ready", error=str(e), retry_in_s=delay))
                commands.assign(reader, ends)
            self._post(_settle, self.started, None, None)
            while not self.stopping.is_set():
                self.producer.poll(0 if self.waiters else IDLE_POLL_S)
                found: list[tuple[str, Result]] = []
                if reader is not None:
                    batch = take(reader, BATCH, RESULTS_SLICE_S if self.waiters else 0, self.stopping)
                    found = list(results_in(batch, self.waiters))
                self._hand_over(found)
            kafka_clients.close_producer(self.producer, CLOSE_FLUSH_S)  # what is left is reported (maybe purged)
        except BaseException as e:
            log.error("aio.client_failed", error=str(e), error_type=type(e).__name__)
            self.failure = e
            self.stopping.set()  # a send from now on is refused at once (ClientClosed), not queued for nobody
            kafka_clients.close_producer(self.producer, 0)
            self._post(self._fail_waiters)  # without waiting for their timeouts or for aclose()
        finally:
            self._hand_over([])
            if reader is not None:
                reader.close()
            self._post(_settle, self.started, None, self.failure)
            self._post(_settle, self.stopped, None, None)

    def _hand_over(self, found: list[tuple[str, Result]]) -> None:
        if self.reports or found:
            reports, self.reports = self.reports, []
            self._post(self._resolve, reports, found)

    def _post(self, fn: Any, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (the application left without closing the client): stop
            self.stopping.set()

    def _resolve(self, reports: list[tuple[asyncio.Future[Any], Any, Any, Any]],
                 found: list[tuple[str, Result]]) -> None:
        for future, err, msg, span in reports:
            if span is not None:
                span.end()
            _settle(future, msg, None if err is None else RetriableError(f"{msg.topic()}: not acknowledged: {err}"))
        for cid, result in found:
            for future in self.waiters.pop(cid, ()):
                _settle(future, result, None)

    def expect(self, cid: str) -> asyncio.Future[Result]:
        future: asyncio.Future[Result] = self.loop.create_future()
        self.waiters.setdefault(cid, []).append(future)
        return future

    def forget(self, cid: str, future: asyncio.Future[Result]) -> None:
        """Take a waiter out (answered, timed out or cancelled): nothing resolves it later."""
        waiting = self.waiters.get(cid)
        if waiting is not None and future in waiting:
            waiting.remove(future)
            if not waiting:
                del self.waiters[cid]
        if future.done() and not future.cancelled():
            future.exception()  # retrieved: a failure the caller already met is not reported again at collection
        future.cancel()

    async def stop(self) -> None:
        """Stop the thread (a bounded flush of what is queued first) and fail whoever still waits."""
        self.stopping.set()
        await asyncio.shield(self.stopped)
        # `stopped` is posted by the thread's last statement: the join returns at once, and after it the thread is
        # gone from threading.enumerate() (what a caller counting threads sees)
        self.thread.join(1.0)
        self._fail_waiters()

    def closed(self) -> ClientClosed:
        return ClientClosed("the client was closed" if self.failure is None else
                            f"the client stopped on an error: {self.failure}")

    def _fail_waiters(self) -> None:
        closed = self.closed()
        for futures in self.waiters.values():
            for future in futures:
                _settle(future, None, closed)
        self.waiters.clear()

    async def produce(self, topic: str, value: bytes, key: bytes | None, headers: Any, span: Any = None
                      ) -> asyncio.Future[Any]:
        """Hand a record to librdkafka (non-blocking); the future resolves to its delivered Message."""
        if self.stopping.is_set():
            raise self.closed()
        future: asyncio.Future[Any] = self.loop.create_future()
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers,
                                      on_delivery=self.delivered(future, span))
                return future
            except BufferError:  # librdkafka's queue is full: the thread's polls make room
                await asyncio.sleep(FULL_QUEUE_PAUSE_S)


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return  # cancelled meanwhile
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


async def _acknowledged(pending: list[asyncio.Future[Any]], what: str) -> list[Any]:
    """The delivered Messages of `pending`; RetriableError when one failed or was not acknowledged in time."""
    try:
        async with asyncio.timeout(ACK_TIMEOUT_S):
            return list(await asyncio.gather(*pending))
    except TimeoutError:
        raise RetriableError(f"{what}: not acknowledged within {ACK_TIMEOUT_S:.0f}s") from None
    finally:
        for future in pending:
            future.cancel()  # a no-op for the delivered; the others are settled by nobody now


class _Client:
    """Start on first use or `async with`; `aclose` stops the client's thread."""

    _pump: _Pump | None = None

    def _make_pump(self) -> _Pump:
        raise NotImplementedError

    async def start(self) -> None:
        """Start the client's thread (and, for commands, position its results reader); idempotent."""
        if self._pump is None:
            self._pump = self._make_pump()
        await asyncio.shield(self._pump.started)

    async def _started(self) -> _Pump:
        await self.start()
        assert self._pump is not None
        return self._pump

    async def aclose(self) -> None:
        if self._pump is not None:
            await self._pump.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class CommandClient(_Client):
    """kafold.client.CommandClient for asyncio: the same arguments and results (command ids, expected_version,
    idempotency, timeouts), one thread per client whatever the number of concurrent sends.

    Create it inside the running loop (an application's startup or lifespan) and share it: `async with
    CommandClient(cfg.kafka, agg, daemon) as client`. `daemon`: a kafold.aio.DaemonClient (for wait_visible), which
    the caller closes."""

    def __init__(self, kafka: KafkaConfig, agg: AggregateConfig, daemon: DaemonClient | None = None, *,
                 tracer_provider: Any = None) -> None:
        self.kafka, self.agg, self.daemon = kafka, agg, daemon
        self._commands = Commands(agg, tracer_provider)

    def _make_pump(self) -> _Pump:
        return _Pump(f"commands.{self.agg.name}", kafka_clients.producer(self.kafka, **PRODUCER_SETTINGS),
                     self._commands, self.kafka)

    def command(self, aggregate_id: str, type: str, data: dict[str, Any] | None = None, *,
                expected_version: int | None = None, command_id: str | None = None) -> Command:
        return self._commands.command(aggregate_id, type, data, expected_version=expected_version,
                                      command_id=command_id)

    async def send(self, command: Command, *, wait: bool = True, timeout: float = 30.0) -> Result | None:
        """Send one command once it is acknowledged; with `wait`, its Result (ResultTimeout if none arrives
        within `timeout` s after the acknowledgement)."""
        results = await self.send_many([command], wait=wait, timeout=timeout)
        return results.get(command.command_id) if wait else None

    async def send_many(self, commands: Iterable[Command], *, wait: bool = True,
                        timeout: float = 30.0) -> dict[str, Result]:
        """Send commands (in order per aggregate) and, with `wait`, collect one result per command id."""
        cmds = list(commands)
        pump = await self._started()
        expected = [(c.command_id, pump.expect(c.command_id)) for c in cmds] if wait else []
        try:
            sent = []
            for c in cmds:
                key, value, headers, span = self._commands.record(c)
                sent.append(await pump.produce(self._commands.commands, value, key, headers, span))
            await _acknowledged(sent, f"{self._commands.commands}: commands")
            if not expected:
                return {}
            _, pending = await asyncio.wait([f for _, f in expected], timeout=timeout)
            if pending:
                raise ResultTimeout(f"{len(pending)} of {len(expected)} results not received within {timeout:.1f}s "
                                    f"from {self._commands.results!r}")
            return {cid: future.result() for cid, future in expected}
        finally:
            for cid, future in expected:
                pump.forget(cid, future)

    async def wait_visible(self, result: Result, connector: str, timeout: float = 10.0) -> None:
        """Return once `connector` has committed `result`'s events (kafold.client.CommandClient.wait_visible)."""
        token = token_to_wait_on(result)
        if token is None:
            return
        if self.daemon is None:
            raise KafoldError("waiting on a connector needs kafold.aio.CommandClient(..., "
                              "daemon=kafold.aio.DaemonClient(url, token))")
        await self.daemon.wait(connector, token, timeout)


class EventProducer(_Client):
    """Writes envelope Events and awaits their delivery: `await producer.produce(topic, event)` returns the
    consistency token of the record (for DaemonClient.wait; kafold.tokens.merge covers several)."""

    def __init__(self, kafka: KafkaConfig, **settings: Any) -> None:
        self.kafka = kafka
        # linger.ms 1: each produce is awaited (see kafold.request_reply.PRODUCER_SETTINGS)
        self.settings = {"enable.idempotence": True, "acks": "all", "linger.ms": 1, **settings}

    def _make_pump(self) -> _Pump:
        return _Pump("events", kafka_clients.producer(self.kafka, **self.settings))

    async def produce(self, topic: str, event: Event) -> str:
        pump = await self._started()
        key, value, headers = encode(event)
        (msg,) = await _acknowledged([await pump.produce(topic, value, key, headers)], f"{topic}: event")
        return tokens.encode_one(msg.topic(), msg.partition(), msg.offset())


class _WaitBatch:
    """Waits on one connector sharing one request: their tokens, the longest timeout, the request's task."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.timeout = 0.0
        self.task: asyncio.Future[bool] | None = None


class DaemonClient(daemon_api.Endpoint):
    """kafold.client.DaemonClient for asyncio over aiohttp (the `aio` extra): `wait`, `state`. One connection
    pool (`connections`) per client; `async with` or `aclose()` closes it."""

    def __init__(self, url: str, token: str | None = None, *, connections: int = 100) -> None:
        super().__init__(url, token)
        if _NO_AIOHTTP is not None:
            raise KafoldError(f"kafold.aio.DaemonClient: {_NO_AIOHTTP}")
        self.connections = connections
        self._session: Any = None
        self._batches: dict[str, _WaitBatch] = {}  # connector -> the waits joining in this turn of the loop

    async def wait(self, connector: str, token: str, timeout: float = 10.0) -> None:
        """Return once `connector`'s committed checkpoint covers `token` (kafold.client.DaemonClient.wait).

        Waits on one connector begun in the same turn of the loop share one request, for their merged token (the
        highest offset per partition, kafold.tokens.merge): a service resolving a batch of results and waiting on
        each makes one request, not one per result (at 1,000 commands/s, one a command was most of the loop's
        work). A shared wait that fails is tried again by each of its waiters alone, so one waiter's bad token or
        longer lag is never another's error."""
        tokens.parse(token)  # a malformed token is this caller's error, before it joins anyone
        batch = self._batches.get(connector)
        if batch is None:
            batch = self._batches[connector] = _WaitBatch()
            batch.task = asyncio.ensure_future(self._wait_batch(connector, batch))
            # retrieved here, whether or not a waiter is still there to see it (all may have timed out)
            batch.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        batch.tokens.append(token)
        batch.timeout = max(batch.timeout, timeout)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            async with asyncio.timeout(timeout):
                assert batch.task is not None
                shared_ok = await asyncio.shield(batch.task)
        except TimeoutError:
            raise NotVisible(f"connector {connector!r} did not cover the token within {timeout:.1f}s") from None
        if not shared_ok:
            left = deadline - asyncio.get_running_loop().time()
            await self._run(self.wait_flow(connector, token, max(0.0, left)))

    async def _wait_batch(self, connector: str, batch: _WaitBatch) -> bool:
        """The shared wait of `batch` (begun after this turn of the loop, when its waiters have joined): True
        when it returned, False when it failed (each waiter then waits alone)."""
        await asyncio.sleep(0)
        if self._batches.get(connector) is batch:
            del self._batches[connector]  # later waits start a batch of their own
        if len(batch.tokens) == 1:
            await self._run(self.wait_flow(connector, batch.tokens[0], batch.timeout))
            return True
        merged = tokens.merge(*batch.tokens)
        assert merged is not None
        try:
            await self._run(self.wait_flow(connector, merged, batch.timeout))
        except KafoldError:
            return False
        return True

    async def state(self, aggregate: str, aggregate_id: str, min_version: int | None = None,
                    timeout: float = 10.0, version: int | None = None) -> dict[str, Any]:
        """The daemon's answer to `GET /aggregates/{aggregate}/{id}` (kafold.daemon_api.Endpoint.state_flow)."""
        return await self._run(self.state_flow(aggregate, aggregate_id, min_version, timeout, version))

    async def _run(self, flow: daemon_api.Flow[T]) -> T:
        outcome: Reply | Unreachable | None = None
        try:
            while True:
                done, step = daemon_api.resume(flow, outcome)
                if done:
                    return step
                if isinstance(step, Backoff):
                    await asyncio.sleep(step.seconds)
                    outcome = None
                else:
                    outcome = await self._hop(step)
        finally:
            flow.close()  # cancelled mid-way: the flow's generator ends here, not in the garbage collector

    async def _hop(self, hop: daemon_api.Hop) -> Reply | Unreachable:
        if self._session is None:
            # made on first use: a session belongs to the running loop
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections))
        headers = {} if hop.bearer is None else {"Authorization": f"Bearer {hop.bearer}"}
        try:
            async with self._session.get(yarl.URL(hop.url, encoded=True), headers=headers, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=hop.timeout)) as resp:
                body = bytearray()  # at most one byte over the cap: the flow refuses the answer then
                while len(body) <= ANSWER_MAX_BYTES and (chunk := await resp.content.read(ANSWER_MAX_BYTES + 1)):
                    body += chunk
                return Reply(resp.status, bytes(body), resp.headers, hop.url)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return Unreachable.of(e)

    async def aclose(self) -> None:
        for batch in self._batches.values():
            if batch.task is not None:
                batch.task.cancel()  # its waiters see CancelledError; no request outlives the session
        self._batches.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> DaemonClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
