"""A rebuild's copy of the history split over worker processes: which partitions each copies (`shares`, planned
from where the shadow and the live connector stand) and the processes run and watched (`run`). rebuild.py's
Rebuild decides when, and a worker is its `_copier` (a Rebuild of the worker's partitions)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kafold.connectors.api import TopicPartition
from kafold.errors import FatalError

WATCH_S = 0.5  # how often the coordinator reports the workers' progress, and a worker looks for its parent
WORKER_STOP_S = 60.0  # a stopped worker finishes its batch in flight within this, else it is terminated


def shares(targets: Mapping[TopicPartition, int], positions: Mapping[TopicPartition, int], workers: int,
           max_tail: int) -> list[list[TopicPartition]]:
    """The partitions more than `max_tail` behind the live connector, split over at most `workers` workers by the
    records each has to copy (greedy: each partition, the furthest behind first, to the least loaded); [] when
    fewer than two would get any (the copy then runs in the rebuild's own process)."""
    far = sorted((tp for tp, off in targets.items() if off - positions.get(tp, 0) > max_tail),
                 key=lambda tp: positions.get(tp, 0) - targets[tp])
    n = min(workers, len(far))
    if n < 2:
        return []
    out: list[list[TopicPartition]] = [[] for _ in range(n)]
    load = [0] * n
    for tp in far:
        i = load.index(min(load))
        out[i].append(tp)
        load[i] += targets[tp] - positions.get(tp, 0)
    return out


def run(name: str, split: list[list[TopicPartition]], copier: Callable[..., None], args: tuple[Any, ...],
        stop: threading.Event, watch: Callable[[int], None]) -> None:
    """Run one worker process per share, `copier(share, halt, applied, *args)`: it copies `share` until near the
    live connector, stops early once `halt` is set, and keeps the events it applied in `applied` (a shared
    integer). Spawned: a fresh interpreter, never a fork of librdkafka's threads. `watch(events applied by all)`
    is called every WATCH_S until every worker is done; `stop` tells them to finish their batch in flight. A
    worker that fails is a FatalError (the run is resumable)."""
    ctx = multiprocessing.get_context("spawn")
    halt = ctx.Event()
    applied = [ctx.Value("q", 0) for _ in split]
    procs = [ctx.Process(target=copier, name=f"kafold-rebuild-{name}-{i}", daemon=True,
                         args=(tuple(share), halt, applied[i], *args))
             for i, share in enumerate(split)]
    try:
        for proc in procs:
            proc.start()
        while True:
            running = [proc for proc in procs if proc.exitcode is None]
            failed = [proc for proc in procs if proc.exitcode not in (None, 0)]
            if failed:
                raise FatalError(f"rebuild of {name!r}: copy worker {failed[0].name} exited with code "
                                 f"{failed[0].exitcode} (see its log); run the rebuild again to resume")
            watch(sum(int(v.value) for v in applied))
            if not running:
                return
            if stop.is_set():
                halt.set()
            time.sleep(WATCH_S)
    finally:
        halt.set()
        for proc in procs:
            if proc.pid is not None:
                proc.join(WORKER_STOP_S)
                if proc.is_alive():
                    proc.terminate()  # its transaction in flight rolls back: resumable
                    proc.join()
