"""How much many long-poll waiters (`GET /connectors/{name}/wait`) lag the daemon's event loop.

`python -m kafold.tools.bench.waiters --waiters 5000`: one `Watch` (daemon/visibility.py) over an in-memory read whose
committed offset moves on at every read, N waiters on tokens spread over the offsets ahead, arriving 50 a
millisecond, and a ticker that sleeps 10 ms at a time and notes how late it wakes: the loop's lag while they wait
and as they are released, and the process's CPU time meanwhile. No broker, no PostgreSQL: what is measured is the
waiting itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from kafold.daemon.visibility import Watch

TICK_S = 0.01
ARRIVALS = 50


async def _inline(fn: Any, *args: Any) -> Any:
    """How a Watch runs its blocking read (here a dict copy, so inline; the daemon uses its executor)."""
    return fn(*args)


async def run(waiters: int, partitions: int, spread: int) -> dict[str, Any]:
    committed = {("t", p): 0 for p in range(partitions)}

    def read() -> dict[tuple[str, int], int]:
        for tp in committed:
            committed[tp] += 1
        return dict(committed)

    watch = Watch("bench", read, 0.005, lambda: None, _inline)
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append((time.perf_counter() - t - TICK_S) * 1000)

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.1)
    started, cpu = time.perf_counter(), time.process_time()
    calls = []
    for i in range(waiters):  # arriving as requests do, a batch at a time, not all in one turn of the loop
        calls.append(asyncio.ensure_future(watch.wait({("t", i % partitions): 1 + (i * 7) % spread}, 30.0)))
        if i % ARRIVALS == ARRIVALS - 1:
            await asyncio.sleep(0.001)
    results = await asyncio.gather(*calls)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    stop.set()
    await tick
    if watch.task is not None:
        watch.task.cancel()
    lags.sort()
    return {"waiters": waiters, "covered": sum(results), "released_in_s": round(elapsed, 3), "cpu_s": round(cpu, 3),
            "loop_lag_ms_max": round(lags[-1], 1), "loop_lag_ms_p99": round(lags[int(len(lags) * 0.99)], 1),
            "loop_lag_ms_median": round(statistics.median(lags), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=5000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--spread", type=int, default=400, help="offsets ahead the tokens are spread over")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.waiters, args.partitions, args.spread))))


if __name__ == "__main__":
    main()
