"""The local stores' file pages mapped into the process, handed back to the page cache after each batch's reads and
write, and every few thousand records read one at a time.

LMDB reads (and finds the pages it writes) through a read-only shared memory map of its file, and every page the
process touched stays mapped, counted in its RSS, until the map is closed: a store of a million aggregates read at
random grows the process by its whole file (582 MB of a 964 MB RSS in `kafold bench aggregates --accounts 1000000`,
docs/benchmarks.md). The pages belong to the kernel's page cache either way; what is bounded here is how many of
them the process keeps mapped. The map is given `madvise(MADV_DONTNEED)`: the mappings go, the page cache keeps the
pages, and the next read of one maps it again from the cache (a minor fault, no disk read while it is cached). For a
read-only shared file map this drops nothing but the mappings (madvise(2): "repopulated from the up-to-date contents
of the underlying mapped file"); LMDB writes with pwrite, never through the map (the store is not opened with
`writemap`).

When: at the end of a batch's reads (`LocalStates.read_back`) and of each write transaction (`release`), so what a
batch maps (a read fault also maps the neighbouring pages already cached: up to 16 with Linux's fault-around, ~64 KB
a random record) is held while that batch reads or writes, not while it decides and commits nor between batches;
and after `RELEASE_RECORDS` records read one at a time (`touch`: state reads, evicted aggregates loaded). Until
2026-12-06 every release came from the count, read and written records alike, so up to 1,023 records' pages stayed
mapped per partition at any moment, between batches too (docs/benchmarks.md, issue 56).

A map is released under the lock its partition's close takes, so an address is never advised once its map is gone
(an address reused by another mapping would lose that mapping's memory). Off Linux (no /proc/self/maps) nothing is
released.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from kafold import libc, logs

log = logs.get(__name__)

RELEASE_RECORDS = 1024  # records read one at a time in a partition's store between two releases of its map (a read
# fault also maps the neighbouring pages already in the page cache: up to 16 with Linux's fault-around, 64 KB a record)
MADV_DONTNEED = 4  # Linux's value


def map_of(data_file: Path) -> int | None:
    """The start address of the process's largest mapping of `data_file` (its LMDB map), or None."""
    try:
        inode = os.stat(data_file).st_ino
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, int] | None = None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[4] != str(inode) or not fields[5].endswith(data_file.name):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if best is None or end - start > best[1]:
            best = (start, end - start)
    return None if best is None else best[0]


class MappedPages:
    """The maps of one aggregate's open stores: each released after a batch's reads or write (`release`), or after
    `RELEASE_RECORDS` records read one at a time (`touch`)."""

    def __init__(self) -> None:
        self.madvise = libc.function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
        self.lock = threading.Lock()
        self.maps: dict[int, tuple[int, Path]] = {}  # partition -> (map address, its data file)
        self.touched: dict[int, int] = {}
        self.releases = 0

    def opened(self, partition: int, data_file: Path) -> None:
        """Partition `partition`'s store was opened (its map is `data_file`'s)."""
        if self.madvise is None:
            return
        address = map_of(data_file)
        with self.lock:
            if address is not None:
                self.maps[partition] = (address, data_file)
            self.touched[partition] = 0

    def closing(self, partition: int) -> None:
        """Before the partition's store is closed: its map is not advised again."""
        with self.lock:
            self.maps.pop(partition, None)
            self.touched.pop(partition, None)

    def touch(self, partition: int, records: int) -> None:
        """`records` records of the partition were read one at a time (a state read for HTTP, an evicted aggregate
        loaded): its map is released when they add up to `RELEASE_RECORDS`."""
        if self.madvise is None:
            return
        with self.lock:
            n = self.touched.get(partition, 0) + records
            if n < RELEASE_RECORDS:
                self.touched[partition] = n
                return
            self._release(partition)

    def release(self, partition: int) -> None:
        """A batch's reads or its write in the partition's store are done: its map is released now, so what a batch
        maps is held while the batch reads or writes, not while it decides and commits, nor between batches."""
        if self.madvise is None:
            return
        with self.lock:
            self._release(partition)

    def _release(self, partition: int) -> None:
        self.touched[partition] = 0
        mapped, madvise = self.maps.get(partition), self.madvise
        if mapped is None or madvise is None:
            return
        address, data_file = mapped
        try:
            length = os.stat(data_file).st_size  # the file only grows while open; the map covers it
        except OSError:
            return
        if madvise(address, length, MADV_DONTNEED) != 0:
            log.warning("aggregate.local_store_release_failed", partition=partition, path=str(data_file),
                        error=libc.errno_text())
            self.maps.pop(partition, None)  # not tried again until reopened
            return
        self.releases += 1
