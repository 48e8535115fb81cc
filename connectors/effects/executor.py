"""The ordered-per-key executor: an asyncio loop in its own thread runs effects concurrently across keys and
strictly in order within a key, retries with backoff, and parks a key whose head event ran out of retries.

Every attempt first passes the endpoint's circuit (connectors.effects.circuit): while the endpoint is down the
keys' head events wait there (no request, no attempt counted) instead of retrying on their own; a key whose head
waited or retried past `max_age_s` is parked. Parked keys are released on request (`kafold effects parked retry`)
and, with `parked_retry_every_s`, on that schedule.

Note on offsets
---------------
The task `add`s every record to the OffsetTracker before handing it over; the executor marks it done only when
its effect succeeded, the ledger showed it already finished, or its parking is durable (Ledger.on_durable). A
key's later events are parked behind a parked head — complete as soon as their parked rows are durable — so the
partition offset keeps moving while the key waits for `parked retry|skip`. Completions of a partition that was
revoked meanwhile (an older `epoch`) are ignored: the new owner re-reads them from the last commit.

The same completions are the task's half of the offset accounting (`outcomes`, kafold.daemon.accounting): an effect
that succeeded is applied, one the ledger showed finished a duplicate, one parked (head or behind it) dead-lettered;
a record still in flight is counted by none of them yet (unaccounted), and a revoked one's completion not at all.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from kafold import logs, tracing
from kafold.connectors.api import Outcomes, SinkRecord, TopicPartition
from kafold.connectors.effects.circuit import CLOSED, Circuit
from kafold.connectors.effects.drivers import Effect
from kafold.connectors.effects.ledger import DeliveryStatus, Ledger, LedgerUpdate, Parking, now, parked_event
from kafold.connectors.effects.policy import RetriableEffectError, RetryPolicy, describe, retriable
from kafold.connectors.effects.tracker import OffsetTracker
from kafold.envelope import Event
from kafold.errors import RecordError
from kafold.retry import retrying_async

NONE, APPLIED, DUPLICATE, DEAD_LETTERED = Outcomes(), Outcomes(applied=1), Outcomes(duplicates=1), \
    Outcomes(dead_lettered=1)
log = logs.get("kafold.connectors.effects")

TICK_S = 0.1
INTAKE_MAX = 5000  # events checked against the ledger in one read (the runner's largest batch by default)


@dataclass(slots=True)
class Item:
    record: SinkRecord
    epoch: int
    attempts: int = 0
    first_at: datetime | None = None
    started: float = 0.0


@dataclass(slots=True)
class Attempted:
    ok: bool
    outcome: LedgerUpdate
    error: BaseException | None = None


@dataclass
class KeyState:
    tp: TopicPartition
    queue: deque[Item] = field(default_factory=deque)
    running: bool = False
    parked: bool = False
    releasing: bool = False
    arrivals: int = 0  # events parked behind while a release was reading the parked rows


class Executor:
    """Runs one task's effects; the public methods are called from the runner thread."""

    def __init__(self, name: str, effect: Effect, policy: RetryPolicy, ledger: Ledger, tracker: OffsetTracker,
                 concurrency: int, request_poll_s: float, on_progress: Callable[[], None],
                 on_tick: Callable[[], None] | None = None, circuit: Circuit | None = None,
                 parked_retry_every_s: float = 0.0) -> None:
        self.name = name
        self.effect = effect
        self.policy = policy
        self.circuit = circuit or Circuit(name, effect.endpoint, ratio=0, window=1, probe_initial_s=1,
                                          probe_max_s=1)
        self.parked_retry_every_s = parked_retry_every_s
        self.ledger = ledger
        self.tracker = tracker
        self.concurrency = concurrency
        self.request_poll_s = request_poll_s
        self.on_progress = on_progress
        self.on_tick = on_tick
        self.epochs: dict[TopicPartition, int] = {}  # written by the runner thread only
        self.keys: dict[str, KeyState] = {}
        self.rng = random.Random()
        self.counts = {"succeeded": 0, "failed_attempts": 0, "parked": 0, "deduplicated": 0, "released": 0}
        # Per partition, what became of the records handed over (see the module note); completions come from the
        # loop's thread and the ledger's writer, reads from the runner's.
        self._outcomes: dict[TopicPartition, Outcomes] = {}
        self._outcomes_lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"kafold-effects-{name}", daemon=True)
        self._ready: Future[None] = Future()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- runner-thread API ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ready.result(30)

    def submit(self, records: Sequence[SinkRecord]) -> None:
        """Hand over records already added to the tracker (in offset order per partition)."""
        items = [Item(r, self.epochs.get(r.tp, 0)) for r in records]
        self.loop.call_soon_threadsafe(self._intake.put_nowait, items)

    def open(self, tps: Sequence[TopicPartition], parked: list[tuple[str, str, int]]) -> None:
        for tp in tps:
            self.epochs[tp] = self.epochs.get(tp, 0) + 1
        wanted = set(tps)
        mine = [(k, TopicPartition(t, p)) for k, t, p in parked if TopicPartition(t, p) in wanted]
        self._call(self._load_parked, mine)

    def close(self, tps: Sequence[TopicPartition]) -> None:
        for tp in tps:
            self.epochs[tp] = self.epochs.get(tp, 0) + 1
            self.tracker.drop(tp)
        self._call(self._drop, set(tps))

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        try:
            fut.result(timeout)
        except Exception as e:
            log.warning("effects.executor_stop_failed", connector=self.name, error=str(e))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        async def run() -> None:
            fn(*args)
        asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    # ---- the loop thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._boot())
        except BaseException as e:
            self._ready.set_exception(e)
            return
        self._ready.set_result(None)
        self.loop.run_forever()
        self.loop.close()

    async def _boot(self) -> None:
        self._intake: asyncio.Queue[list[Item]] = asyncio.Queue()
        self._sem = asyncio.Semaphore(self.concurrency)
        await self.effect.start()
        self._spawn(self._intake_loop())
        self._spawn(self._request_loop())
        if self.on_tick is not None:
            self._spawn(self._tick_loop(self.on_tick))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.error("effects.executor_task_failed", connector=self.name, error=describe(error))

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.effect.close()
        await self.ledger.close_async()

    async def _intake_loop(self) -> None:
        """Natural batching: one ledger read for everything handed over since the last one (the runner's batches
        are small at a low rate, and each read is a PostgreSQL round trip); nothing waits for more."""
        while True:
            items = list(await self._intake.get())  # a copy: the lists handed over are the runner's
            while len(items) < INTAKE_MAX and not self._intake.empty():
                items.extend(self._intake.get_nowait())
            ids = [i.record.event.event_id for i in items]
            finished = await self._finished(ids)
            for item in items:
                if self.epochs.get(item.record.tp) != item.epoch:
                    continue  # revoked while waiting
                if item.record.event.event_id in finished:
                    self.counts["deduplicated"] += 1
                    self._complete(item, DUPLICATE)
                else:
                    self._accept(item)

    async def _finished(self, ids: list[str]) -> set[str]:
        """Which of `ids` the ledger has finished. PostgreSQL away (restarting): wait and ask again, however long
        it takes; nothing runs before the ledger answers."""
        def warn(e: Exception, delay: float) -> None:
            log.warning("effects.ledger_read_retrying", connector=self.name, error=describe(e),
                        retry_in_s=delay)

        return await retrying_async(lambda: self.ledger.finished_ids(ids), within_s=float("inf"),
                                    on_retry=warn, first_delay=0.1, errors=(Exception,))

    def _accept(self, item: Item) -> None:
        key = item.record.key
        st = self.keys.get(key)
        if st is None:
            st = self.keys[key] = KeyState(item.record.tp)
        if st.parked:
            st.arrivals += 1
            self._park(item, head=False, error="parked behind the key's head event")
            return
        st.queue.append(item)
        if not st.running:
            st.running = True
            self._spawn(self._drain(key, st))

    async def _drain(self, key: str, st: KeyState) -> None:
        try:
            while st.queue and not st.parked:
                item = st.queue[0]
                result = await self._attempt(item)
                # While the attempt ran, a revocation may have cleared the queue and a new assignment of the
                # partition queued the key's events again (this same state, so they wait for this attempt and
                # keep their order): only the attempted item leaves the queue.
                if st.queue and st.queue[0] is item:
                    st.queue.popleft()
                if self.epochs.get(item.record.tp) != item.epoch:
                    continue
                if result.ok:
                    self.counts["succeeded"] += 1
                    self.ledger.outcome(result.outcome)
                    self._complete(item, APPLIED)
                    continue
                st.parked = True
                self._park(item, head=True, error=result.outcome.error or "failed", exc=result.error,
                           outcome=result.outcome)
                log.warning("effects.key_parked", connector=self.name, key=key, topic=item.record.topic,
                            partition=item.record.partition, offset=item.record.offset,
                            event_id=item.record.event.event_id, attempts=item.attempts, error=result.outcome.error)
                while st.queue:
                    self._park(st.queue.popleft(), head=False, error="parked behind the key's head event")
        finally:
            st.running = False
            if not st.queue and not st.parked and not st.releasing:
                self.keys.pop(key, None)

    async def _attempt(self, item: Item) -> Attempted:
        """Attempt until success or until the policy says park; failed attempts go to the ledger as they happen.
        Each attempt waits for the circuit first; a transient failure while the circuit is open waits there (for
        the probe that closes it) rather than on the key's own backoff."""
        while True:
            item.started = item.started or time.monotonic()
            try:
                probe = await self.circuit.admit(item.started + self.policy.max_age_s)
            except TimeoutError:
                at = now()
                item.first_at = item.first_at or at
                error = (f"endpoint {self.circuit.endpoint} unavailable (circuit open) past max_age_s "
                         f"({self.policy.max_age_s:g}s)")
                return Attempted(False, LedgerUpdate(item.record, DeliveryStatus.PARKED, 0, item.first_at, at, None,
                                                     error), RetriableEffectError(error))
            at = now()
            item.first_at = item.first_at or at
            t0 = time.perf_counter()
            try:
                async with self._sem:
                    tracer = tracing.tracer()
                    if tracer is None:
                        await self.effect.run(item.record.event)
                    else:
                        await self._run_traced(tracer, item)
            except asyncio.CancelledError:
                if probe:  # the probe's answer never came: the next one goes out after the backoff
                    self.circuit.record(True, probe=True)
                raise
            except Exception as e:
                self.circuit.record(retriable(e), probe=probe, retry_after_s=getattr(e, "retry_after_s", None))
                item.attempts += 1
                self.counts["failed_attempts"] += 1
                latency = (time.perf_counter() - t0) * 1000
                wait = self.policy.next_delay(item.attempts, time.monotonic() - item.started, e, self.rng)
                status = DeliveryStatus.RETRYING if wait is not None else DeliveryStatus.PARKED
                outcome = LedgerUpdate(item.record, status, 1, item.first_at, at, latency, describe(e))
                if wait is None:
                    return Attempted(False, outcome, e)
                self.ledger.outcome(outcome)
                if self.circuit.state == CLOSED:
                    await asyncio.sleep(wait)
                continue
            self.circuit.record(False, probe=probe)
            item.attempts += 1
            latency = (time.perf_counter() - t0) * 1000
            return Attempted(True, LedgerUpdate(item.record, DeliveryStatus.SUCCEEDED, 1, item.first_at, at, latency,
                                                None, now()))

    async def _run_traced(self, tracer: Any, item: Item) -> None:
        """The effect in a span, child of its record's trace context (noted by the runner); a webhook request
        carries the span's `traceparent` (drivers.py)."""
        r = item.record
        with tracer.start_as_current_span(f"effect {self.name}", context=tracing.extract(
                tracing.recall(r.topic, r.partition, r.offset)), attributes={
                    "kafold.connector": self.name, "kafold.event_id": r.event.event_id,
                    "kafold.attempt": item.attempts + 1}):
            await self.effect.run(r.event)
        tracing.forget(r.topic, r.partition, r.offset)  # delivered: no later attempt needs it

    def _complete(self, item: Item, outcome: Outcomes) -> None:
        """Any thread: the record's offset may be committed now, and its outcome counted (unless its partition was
        revoked)."""
        tp = item.record.tp
        if self.epochs.get(tp) != item.epoch:
            return
        with self._outcomes_lock:
            self._outcomes[tp] = self._outcomes.get(tp, NONE) + outcome
        if self.tracker.done(tp, item.record.offset):
            self.on_progress()

    def outcomes(self) -> dict[TopicPartition, Outcomes]:
        """Per partition, the outcomes counted so far (a copy; any thread)."""
        with self._outcomes_lock:
            return dict(self._outcomes)

    def _park(self, item: Item, *, head: bool, error: str, exc: BaseException | None = None,
              outcome: LedgerUpdate | None = None) -> None:
        self.counts["parked"] += 1
        o = outcome or LedgerUpdate(item.record, DeliveryStatus.PARKED, 0, None, None, None, error)
        o.status, o.completed_at = DeliveryStatus.PARKED, now()
        self.ledger.outcome(o)
        self.ledger.park(Parking(item.record, head, error, lambda: self._complete(item, DEAD_LETTERED), exc))

    # ---- parked keys: load, drop, retry / skip ------------------------------------------------------------------
    def _load_parked(self, mine: list[tuple[str, TopicPartition]]) -> None:
        for key, tp in mine:
            st = self.keys.setdefault(key, KeyState(tp))
            st.parked = True

    def _drop(self, tps: set[TopicPartition]) -> None:
        for key, st in list(self.keys.items()):
            if st.tp in tps:
                st.queue.clear()
                if not st.running and not st.releasing:
                    self.keys.pop(key, None)
                else:
                    st.parked = False

    async def _tick_loop(self, tick: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            tick()

    async def _request_loop(self) -> None:
        """Operators' `parked retry|skip` requests, and the `parked_retry_every_s` schedule (a retry of every
        parked key of this task)."""
        scheduled = time.monotonic()
        while True:
            await asyncio.sleep(self.request_poll_s)
            due = self.parked_retry_every_s > 0 and time.monotonic() - scheduled >= self.parked_retry_every_s
            if due:
                scheduled = time.monotonic()
                keys = [k for k, st in self.keys.items() if st.parked and not st.releasing]
                if keys:
                    log.info("effects.parked_retry_scheduled", connector=self.name, keys=len(keys))
                for key in keys:
                    self._release_key(key, skip=False)
            try:
                requests = await asyncio.to_thread(self.ledger.requests)
            except Exception as e:
                log.warning("effects.park_requests_unread", connector=self.name, error=describe(e))
                continue
            for key, action in requests:
                self._release_key(key, skip=action == "skip")

    def _release_key(self, key: str, *, skip: bool) -> None:
        st = self.keys.get(key)
        if st is not None and st.parked and not st.releasing and st.tp in self.epochs:
            st.releasing = True
            self._spawn(self._release(key, st, skip=skip))

    def status(self) -> dict[str, Any]:
        """The endpoint's circuit and the keys' state, for /metrics and /status (read from any thread)."""
        keys = list(self.keys.values())
        return {"endpoint": self.circuit.endpoint, "circuit": self.circuit.state,
                "circuit_changes": self.circuit.changes, "waiting": self.circuit.waiting,
                "keys": len(keys), "parked_keys": sum(1 for st in keys if st.parked), "counts": dict(self.counts)}

    async def _release(self, key: str, st: KeyState, *, skip: bool) -> None:
        """Re-run a parked key's events in order (after dropping the head for `skip`); unpark it when none is left."""
        released = 0
        try:
            while True:
                await asyncio.wrap_future(self.ledger.barrier())
                st.arrivals = 0
                rows = await asyncio.to_thread(self.ledger.parked_events, key)
                if skip and rows:
                    await asyncio.to_thread(self.ledger.settle, key, rows[0][0], DeliveryStatus.SKIPPED,
                                            None)
                    log.info("effects.parked_head_skipped", connector=self.name, key=key, event_id=rows[0][0])
                    rows, skip = rows[1:], False
                if not rows and st.arrivals == 0:
                    st.parked = False  # from here on, new events of the key run normally
                    await asyncio.to_thread(self.ledger.unpark, key)
                    log.info("effects.key_released", connector=self.name, key=key, events=released)
                    return
                for event_id, topic, partition, offset, body in rows:
                    try:
                        event = parked_event(body, self.ledger.protector)
                    except RecordError as e:  # a stored value that does not open: parked again, never sent
                        at = now()
                        record = SinkRecord(topic, partition, offset, key, Event(**orjson.loads(body)))
                        await asyncio.to_thread(self.ledger.repark, key, event_id, describe(e), LedgerUpdate(
                            record, DeliveryStatus.PARKED, 0, at, at, None, describe(e)))
                        log.warning("effects.key_parked_again", connector=self.name, key=key, event_id=event_id,
                                    error=describe(e))
                        return
                    item = Item(SinkRecord(topic, partition, offset, key, event), epoch=-1)
                    result = await self._attempt(item)
                    if not result.ok:
                        await asyncio.to_thread(self.ledger.repark, key, event_id, result.outcome.error or "failed",
                                                result.outcome)
                        log.warning("effects.key_parked_again", connector=self.name, key=key, event_id=event_id,
                                    error=result.outcome.error)
                        return
                    await asyncio.to_thread(self.ledger.settle, key, event_id, DeliveryStatus.SUCCEEDED,
                                            result.outcome)
                    released += 1
                    self.counts["released"] += 1
        finally:
            st.releasing = False
            if st.queue and not st.running:
                st.running = True
                self._spawn(self._drain(key, st))
            elif not st.queue and not st.parked and not st.running:
                self.keys.pop(key, None)
