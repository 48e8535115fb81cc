"""The runtime's freed native memory handed back to the OS every few seconds (glibc's `malloc_trim`).

Why: most of an aggregate runtime's own memory (`RssAnon`) is not Python objects but memory freed in C and kept by
glibc's allocator: librdkafka's fetch and produce buffers and LMDB's write pages, allocated by librdkafka's threads
in arenas of their own, and Python's freed arenas. glibc returns memory to the OS only from the top of an arena;
`malloc_trim(0)` also releases the free pages inside every arena (docs/benchmarks.md, issue 56: what it took off the
two workers' RSS). It walks the arenas' free lists, so it runs at most every `TRIM_INTERVAL_S`, after a batch.
Off glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import time

from kafold import libc

TRIM_INTERVAL_S = 5.0


class HeapTrim:
    """`after_batch` trims the native heap when `TRIM_INTERVAL_S` passed since the last trim."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self.trim = libc.function("malloc_trim", (ctypes.c_size_t,))
        self.interval_s = interval_s
        self.last = time.monotonic()
        self.trims = 0

    def after_batch(self) -> None:
        if self.trim is None:
            return
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return
        self.trim(0)
        self.last = time.monotonic()
        self.trims += 1
