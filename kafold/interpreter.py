"""CPython's settings for a kafold process's batch work: the GIL switch interval, the cyclic GC's young threshold,
and what start-up made frozen out of the collector; process-wide, only ever moved in one direction."""

from __future__ import annotations

import gc
import sys

# Two busy threads (a sink runner decoding, a projection's writer folding) share the GIL; the writer gives it up at
# each PostgreSQL round trip and waits up to the switch interval (default 5 ms) to get it back: 5 ms -> 0.5 ms took
# 200k events from 11.4 s to 8.7 s. Each batch allocates ~10 tracked objects per event (events, payloads, rows), so
# the default gen-0 threshold (700) runs the cyclic GC dozens of times per batch: 50,000 took 7.6 s to 6.1 s. In the
# daemon's process, whatever it hosts: with the projections in processes of their own (`task_processes`), the
# webhook connector's threads left at 700 paused 91 times in 30 s at 1,000 events/s, up to 209 ms
# (docs/benchmarks.md, latency).
SWITCH_INTERVAL_S = 0.0005
GC_GEN0_THRESHOLD = 50_000


def tune_interpreter() -> None:
    """Apply SWITCH_INTERVAL_S and GC_GEN0_THRESHOLD to this process (only ever in that direction)."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    threshold = gc.get_threshold()
    if threshold[0] < GC_GEN0_THRESHOLD:
        gc.set_threshold(GC_GEN0_THRESHOLD, *threshold[1:])


def freeze_startup() -> None:
    """Collect once, then keep what exists now (the imports, the configuration, the clients) for the process's life:
    frozen out of the cyclic collector. Each full collection would otherwise walk all of it again, and an aggregate's
    LRU turning its entries over (each loaded one outlives the young generations) triggers one every few thousand
    commands: ~10 % of a worker's time at 1M accounts with a 10k cache (docs/benchmarks.md, issue 56). Only the
    collector skips them; they are freed by reference counting as ever. Called again later, it adds what was made
    since."""
    gc.collect()
    gc.freeze()


def set_up() -> None:
    """A kafold process's start, whatever it hosts (the daemon, a task's child process): tune_interpreter, then
    freeze_startup."""
    tune_interpreter()
    freeze_startup()
