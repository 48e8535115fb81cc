"""The committed positions behind GET /connectors/{name}/wait (the view: wait_view.py): a wait until a connector's
committed position covers a consistency token.

What "covered" means (kafold/tokens.py): for every partition the token names, the connector's committed next
offset is past the token's offset. Committed where the connector's truth is: a projection's checkpoint in
PostgreSQL (written in the same transaction as its rows, so the rows then include the writes); any other sink's
committed offset in its Kafka consumer group (this daemon's own runners first, then the group's offsets as the
broker has them, for partitions another instance holds). Both only grow, so an answer of 200 stays true.

One `Watch` per connector polls while someone waits on it — one query per interval however many wait — without
blocking the event loop (the reads run in the executor), and wakes each waiter its read covers. It lingers for
IDLE_S after the last waiter, so a steady trickle of waits keeps its connection and a new wait is answered at once.

A projection whose tasks are this daemon's threads does not wait for that poll: each task tells the daemon the
checkpoints it has just committed (`TaskConfig.on_stored`, called after the transaction's commit, so they are
visible to any reader), and `Watches.stored` wakes the waiters they cover at once, with no read. The poll then only
finds what this daemon did not write (another instance's partitions), every PG_FALLBACK_S. A projection whose tasks
run as child processes (`task_processes`) is read every PG_POLL_S, as before.

Waiting is cheap however many wait: each waiter is filed under the first partition its token needs, in a heap by
offset, so a read that moves a partition on looks only at the waiters it releases (or files them under their next
partition), and a read that moves nothing looks at none; a timeout is one timer, not a task. Waits beyond
`daemon.max_waits` at once are answered 503 with `Retry-After`: each one holds a connection and a file descriptor.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import TopicPartition as KafkaTP
from psycopg import sql

from kafold import db, kafka_clients, logs, tokens
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.projection.connector import ProjectionConnector
from kafold.daemon import offsets
from kafold.daemon.aggregates.routing import Call
from kafold.daemon.tasks import ConnectorGroup
from kafold.tokens import Positions

log = logs.get(__name__)

PG_POLL_S = 0.005  # one small primary-key read per interval while someone waits: ~2.5 ms added on average
PG_FALLBACK_S = 0.05  # the same read where this daemon's own commits wake the waiters: only other instances' wait
KAFKA_POLL_S = 0.05  # an OffsetFetch to the group coordinator, only for partitions no local runner has committed
IDLE_S = 30.0
ADMIN_TIMEOUT_S = 5.0
LIST_S = 30.0


@dataclass
class Watch:
    """Committed next offsets of one connector, read while waiters exist."""

    name: str
    read: Callable[[], dict[tuple[str, int], int]]  # blocking: run in the executor
    interval_s: float
    close: Callable[[], None]
    call: Call  # runs `read` off the event loop (the host's executor)
    seen: dict[tuple[str, int], int] = field(default_factory=dict)
    error: str | None = None
    # (topic, partition) -> heap of (offset wanted there, tie-breaker, waiter); a released or timed-out waiter's
    # entry is dropped when it comes to the top, or by `_sweep`
    pending: dict[tuple[str, int], list[tuple[int, int, Waiter]]] = field(default_factory=dict)
    waiting: int = 0
    filed: int = 0  # entries in `pending`, the stale ones included
    order: itertools.count[int] = field(default_factory=itertools.count)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)  # one read at a time (one connection)
    task: asyncio.Task[None] | None = None

    async def wait(self, wanted: Positions, timeout_s: float) -> bool:
        if tokens.covers(self.seen, wanted):  # positions only grow: an earlier read covering it still holds
            return True
        if timeout_s <= 0:  # a check, not a wait: one fresh read
            await self._poll()
            return tokens.covers(self.seen, wanted)
        loop = asyncio.get_running_loop()
        waiter = Waiter(wanted, loop.create_future())
        self._file(waiter)
        if waiter.fut.done():
            return True
        self.waiting += 1
        self.arrived.set()
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run())
        timer = loop.call_later(timeout_s, _expire, waiter.fut)
        try:
            return await waiter.fut
        finally:
            timer.cancel()
            self.waiting -= 1
            if self.filed > 2 * self.waiting + 1024:
                self._sweep()

    def _file(self, waiter: Waiter) -> None:
        """File `waiter` under the first partition it still needs, or release it."""
        for tp, offset in waiter.wanted.items():
            if self.seen.get(tp, -1) <= offset:
                heapq.heappush(self.pending.setdefault(tp, []), (offset, next(self.order), waiter))
                self.filed += 1
                return
        if not waiter.fut.done():
            waiter.fut.set_result(True)

    def _sweep(self) -> None:
        """Drop the entries of waiters that are gone (timed out on a partition that did not move)."""
        for tp, heap in list(self.pending.items()):
            live = [e for e in heap if not e[2].fut.done()]
            heapq.heapify(live)
            if live:
                self.pending[tp] = live
            else:
                del self.pending[tp]
        self.filed = sum(len(h) for h in self.pending.values())

    async def _run(self) -> None:
        try:
            while True:
                if not self.waiting:
                    self.arrived.clear()
                    try:
                        await asyncio.wait_for(self.arrived.wait(), IDLE_S)
                    except TimeoutError:
                        return
                await self._poll()
                if self.waiting:
                    await asyncio.sleep(self.interval_s)
        finally:
            self.close()  # quick (a socket close); also reached when the daemon's loop cancels this task

    async def _poll(self) -> None:
        try:
            async with self.reading:
                found = await self.call(self.read)
        except Exception as e:  # PostgreSQL or the coordinator away: waiters keep waiting, 503 if it lasts
            if self.error is None:
                log.warning("visibility.read_failed", connector=self.name, error=str(e))
            self.error = f"{type(e).__name__}: {e}"
            return
        self.error = None
        self.advance(found)

    def advance(self, found: Mapping[tuple[str, int], int]) -> None:
        """Take committed next offsets (a read's, or a commit this daemon made): release the waiters they cover."""
        for tp, off in found.items():
            if off > self.seen.get(tp, -1):
                self.seen[tp] = off
                heap = self.pending.get(tp)
                while heap and heap[0][0] < off:  # covered here: released, or filed under its next partition
                    waiter = heapq.heappop(heap)[2]
                    self.filed -= 1
                    if not waiter.fut.done():
                        self._file(waiter)
                if heap is not None and not heap:
                    del self.pending[tp]


@dataclass(eq=False)
class Waiter:
    wanted: Positions
    fut: asyncio.Future[bool]


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class Watches:
    """The watches of one daemon, by connector name (made on first use; a reload keeps them), and how many waits
    are in progress over all of them."""

    def __init__(self, kafka: KafkaConfig, postgres: PostgresConfig, group: Callable[[str], ConnectorGroup | None],
                 call: Call) -> None:
        self.kafka, self.postgres, self.group, self.call = kafka, postgres, group, call
        self.by_name: dict[str, Watch] = {}
        self.active = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # the views' loop, known from the first wait

    def get(self, name: str, group: ConnectorGroup) -> Watch:
        self.loop = asyncio.get_running_loop()
        watch = self.by_name.get(name)
        if watch is None:
            watch = self.by_name[name] = self._new(name, group)
        return watch

    def _new(self, name: str, group: ConnectorGroup) -> Watch:
        if isinstance(group.connector, ProjectionConnector):
            pgc = next((s.task_config.postgres for s in group.slots if s.task_config.postgres is not None),
                       self.postgres)
            checkpoints = Checkpoints(pgc, name)
            told = all(s.task_config.on_stored is not None for s in group.slots)  # every task reports its commits
            return Watch(name, checkpoints.read, PG_FALLBACK_S if told else PG_POLL_S, checkpoints.close, self.call)
        committed = GroupCommitted(self.kafka, self.group, name)
        return Watch(name, committed.read, PG_POLL_S, committed.close, self.call)

    def stored(self, name: str, found: dict[tuple[str, int], int]) -> None:
        """Connector `name` committed `found` (next offsets) in this daemon; called from the task's thread. Nothing
        to do before anyone waited on it: a first wait reads the checkpoints."""
        loop = self.loop
        if loop is None or name not in self.by_name:
            return
        try:
            loop.call_soon_threadsafe(self._advance, name, found)
        except RuntimeError:  # the loop is closed: the daemon is stopping, nobody waits any more
            pass

    def _advance(self, name: str, found: dict[tuple[str, int], int]) -> None:
        watch = self.by_name.get(name)
        if watch is not None:
            watch.advance(found)


class Checkpoints:
    """A projection's checkpoints in PostgreSQL (kafold.checkpoints), on one autocommit connection."""

    def __init__(self, pgc: PostgresConfig, connector: str) -> None:
        self.pgc, self.connector = pgc, connector
        self.query = sql.SQL("SELECT topic, partition, next_offset FROM {} WHERE connector = %s").format(
            db.table(pgc, "checkpoints"))
        self.conn: Any = None

    def read(self) -> dict[tuple[str, int], int]:
        if self.conn is None or self.conn.closed:
            self.conn = db.connect(self.pgc, autocommit=True)
        try:
            rows = self.conn.execute(self.query, (self.connector,)).fetchall()
        except Exception:
            self.close()
            raise
        return {(t, p): o for t, p, o in rows}

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as e:
                log.debug("visibility.close_failed", connector=self.connector, error=str(e))


class GroupCommitted:
    """A sink's committed offsets: its runners' in this daemon (no I/O), then the group's (OffsetFetch, at most
    every KAFKA_POLL_S) for the partitions the local ones do not show."""

    def __init__(self, kafka: KafkaConfig, group: Callable[[str], ConnectorGroup | None], connector: str) -> None:
        self.kafka, self.group, self.connector = kafka, group, connector
        self.reader: Any = None
        self.remote: dict[tuple[str, int], int] = {}
        self.asked_at = float("-inf")
        self.partitions: list[KafkaTP] = []
        self.listed_at = float("-inf")

    def read(self) -> dict[tuple[str, int], int]:
        group = self.group(self.connector)
        if group is None:
            return {}
        found: dict[tuple[str, int], int] = dict(self.remote)
        for slot in group.slots:
            for p in list(slot.runner.progress.snapshot.values()):
                tp = (p.tp.topic, p.tp.partition)
                if p.committed is not None and p.committed > found.get(tp, -1):
                    found[tp] = p.committed
        if group.slots and time.monotonic() - self.asked_at >= KAFKA_POLL_S:
            self.asked_at = time.monotonic()
            self.remote = self._group_offsets(group.slots[0].runner.group_id, list(group.connector.settings.topics))
            for tp, off in self.remote.items():
                found[tp] = max(off, found.get(tp, -1))
        return found

    def _group_offsets(self, group_id: str, topics: list[str]) -> dict[tuple[str, int], int]:
        if self.reader is None:  # of the sink's group, never subscribed: it reads the group's offsets, never joins
            self.reader = kafka_clients.consumer(self.kafka, group_id)
        if time.monotonic() - self.listed_at >= LIST_S:  # partitions are added rarely: listed now and then
            meta = self.reader.list_topics(timeout=ADMIN_TIMEOUT_S)
            self.partitions = [KafkaTP(t, p) for t in topics if t in meta.topics
                               for p in sorted(meta.topics[t].partitions)]
            self.listed_at = time.monotonic()
        return offsets.committed(self.reader, self.partitions, ADMIN_TIMEOUT_S)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
