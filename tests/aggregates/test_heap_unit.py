"""The runtime's native heap trim (daemon/aggregates/heap.py): at most once per interval, and memory given back."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

from kafold.daemon.aggregates.heap import HeapTrim


def _anon_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_a_trim_runs_at_most_once_per_interval() -> None:
    heap = HeapTrim(interval_s=3600)
    if heap.trim is None:
        pytest.skip("not glibc")
    for _ in range(100):
        heap.after_batch()
    assert heap.trims == 0  # the interval has not passed since it was made
    heap.interval_s = 0
    heap.after_batch()
    assert heap.trims == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_memory_freed_inside_the_heap_goes_back_to_the_os() -> None:
    """Blocks freed below a live one stay with the allocator (glibc returns only an arena's top on free); the trim
    gives their pages back."""
    heap = HeapTrim(interval_s=0)
    if heap.trim is None:
        pytest.skip("not glibc")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    blocks = [libc.malloc(16 * 1024) for _ in range(4096)]  # 64 MB below the mmap threshold: from the heap
    for b in blocks:
        libc.memset(b, 1, 16 * 1024)
    pinned = libc.malloc(16 * 1024)  # above them: the heap's top stays in use
    for b in blocks:
        libc.free(b)
    before = _anon_kb()
    heap.after_batch()
    after = _anon_kb()
    libc.free(pinned)
    assert heap.trims == 1
    assert after < before - 32 * 1024, (before, after)
