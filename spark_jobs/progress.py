"""Progress of a running snapshot job: partitions done (Spark's status tracker) and events folded (accumulator)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kafold import logs

log = logs.get(__name__)

LOG_EVERY_S = 5.0
Reporter = Callable[[int, int, int], None]  # (partitions done, partitions total, events folded so far)


def _done(spark: Any) -> int:
    tracker = spark.sparkContext.statusTracker()
    done = 0
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id)
        if info is not None:
            done = max(done, info.numCompletedTasks)
    return done


@contextlib.contextmanager
def watch(spark: Any, total: int, counter: Any, reporter: Reporter | None, every_s: float = 0.5) -> Iterator[None]:
    """While the body runs, report progress every `every_s` (and log it every LOG_EVERY_S)."""
    stop = threading.Event()
    began = time.monotonic()

    def loop() -> None:
        last_log = began
        done = 0
        while not stop.wait(every_s):
            try:
                done = max(done, _done(spark))
                events = int(counter.value)
            except Exception:  # the session is shutting down: stop reporting, the job reports its own end
                return
            if reporter is not None:
                reporter(done, total, events)
            now = time.monotonic()
            if now - last_log >= LOG_EVERY_S:
                last_log = now
                log.info("snapshot.progress", partitions_done=done, partitions=total, events_read=events,
                         events_per_s=round(events / (now - began)))

    thread = threading.Thread(target=loop, name="kafold-snapshot-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        if reporter is not None:
            reporter(total, total, int(counter.value))
