"""One batch in flight: a projection's PostgreSQL transaction runs in a worker thread while the runner decodes the next.

Note on offsets and commits
---------------------------
At most ONE write is in flight, and writes run in the order they were handed over, on one connection (the
writer's). What the next batch's transaction needs from Python (its decode, its tracking and row keys, and for a
whole-row batch its plan and the upsert's parameters: `Job.prepared`, `Job.ahead`) is computed by the runner's thread
while the write in flight is in PostgreSQL, so the worker sends the next transaction as soon as it gets it and the
server does not wait for the interpreter between two batches. That is work planned ahead, not a second write in
flight: the next transaction is sent only once the previous one committed (or failed), so two transactions of a
task never hold the checkpoints' rows at once, the fence always moves them from offsets already committed, and
the order of commits, and so of stored offsets, is the order of the batches. Besides that pure work (which reads
the connection's adapters, never runs a statement), the runner's thread never touches the writer while a write is
in flight: `settle` waits for it first.
The task's `stored` offsets (what `pre_commit` returns, so what is committed to Kafka) are updated only in the
runner's thread, from the result of a write that committed — so an offset reaches Kafka only after its
PostgreSQL commit, as before. A write that failed is kept (`failed`) and redone, synchronously and before any
newer batch, by the next `put`; see task.py for how that maps onto the runner's retry of the same batch.

The dead-letter reporter belongs to the runner's thread (its producer's bookkeeping is not thread-safe): when a
write in the worker needs to report rows the mapping or the database refused, it queues the request and waits;
the runner's thread serves it in `serve` (from `settle`, `put` and `pre_commit`) and hands back the outcome.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kafold.connectors.api import SinkRecord, TopicPartition
from kafold.connectors.projection.fold import BatchResult, Prepared
from kafold.connectors.projection.whole_rows import WholePlan
from kafold.connectors.projection.writer import DeadLetter, Report
from kafold.errors import RetriableError

POLL_S = 0.02


@dataclass
class Job:
    """One write: records to apply, dead letters to record, extra offsets to store (all in one transaction)."""

    records: Sequence[SinkRecord]  # a list, or a WholeBatch (whole_batch.py)
    dead: list[DeadLetter]
    offsets: dict[TopicPartition, int]
    prepared: Prepared | None = None  # ProjectionWriter.prepare of the records, computed on the runner's thread
    ahead: WholePlan | None = None  # WholeRows.ahead of exactly these records, on the runner's thread
    future: Future[BatchResult] | None = None
    started: float = field(default_factory=time.perf_counter)

    def without(self, tps: set[TopicPartition]) -> Job | None:
        """This job minus the partitions in `tps` (revoked: their records go to the new owner); None if empty."""
        records = [r for r in self.records if r.tp not in tps]
        offsets = {tp: off for tp, off in self.offsets.items() if tp not in tps}
        if not records and not self.dead and not offsets:
            return None
        # prepared is keyed by id(record): still valid for a subset; a plan made ahead is the whole batch's only
        return Job(records, self.dead, offsets, self.prepared)


@dataclass
class _ReportRequest:
    bad: Sequence[tuple[Any, BaseException]]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class WriteAhead:
    """Runs jobs one at a time in a worker thread; everything else is called from the runner's thread."""

    def __init__(self, name: str, write: Callable[[Job, Report], BatchResult], report: Report) -> None:
        self._write = write
        self._report_direct = report
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kafold-projection-{name}")
        self._owner = threading.get_ident()
        self._requests: queue.SimpleQueue[_ReportRequest] = queue.SimpleQueue()
        self._closing = threading.Event()
        self.inflight: Job | None = None

    def submit(self, job: Job) -> None:
        assert self.inflight is None, "one write in flight at most"
        job.future = self._pool.submit(self._write, job, self.report)
        self.inflight = job

    def run_here(self, job: Job) -> BatchResult:
        """Run `job` in the calling (runner's) thread; only when nothing is in flight."""
        assert self.inflight is None
        return self._write(job, self.report)

    def report(self, bad: Sequence[tuple[Any, BaseException]]) -> None:
        """Report to the DLQ topic and wait for the acknowledgement, always from the runner's thread."""
        if threading.get_ident() == self._owner:
            self._report_direct(bad)
            return
        request = _ReportRequest(bad)
        self._requests.put(request)
        while not request.done.wait(POLL_S):
            if self._closing.is_set():
                raise RetriableError("stopping: dead letters not reported; the batch will be delivered again")
        if request.error is not None:
            raise request.error

    def serve(self) -> None:
        """Serve the worker's report requests (runner's thread)."""
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return
            try:
                self._report_direct(request.bad)
            except BaseException as e:  # handed to the worker, which fails its write (retried later)
                request.error = e
            finally:
                request.done.set()

    def done(self) -> bool:
        return self.inflight is None or bool(self.inflight.future and self.inflight.future.done())

    def settle(self, timeout: float | None = None) -> Job | None:
        """Wait for the write in flight (serving report requests meanwhile); return it, finished, or None if
        there was none. With a timeout, returns None and leaves it in flight if it did not finish in time."""
        job = self.inflight
        if job is None:
            return None
        assert job.future is not None
        waited = 0.0
        while True:
            self.serve()
            try:
                job.future.exception(POLL_S)
                break
            except TimeoutError:
                waited += POLL_S
                if timeout is not None and waited >= timeout:
                    return None
        self.inflight = None
        return job

    def close(self) -> None:
        """Refuse further report requests and let the worker thread end (after any write still running)."""
        self._closing.set()
        self.serve()
        self._pool.shutdown(wait=False, cancel_futures=True)
