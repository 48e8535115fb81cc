"""The local state store's open (a restart on the same host) against the history it holds; no broker needed.

One partition's store (daemon/aggregates/local.py) is filled as a runtime fills it, committed batch by committed
batch: `--accounts` aggregates' states and one accepted outcome per command (with its expiry index entry) for
each of `--events` commands within the idempotency window. Then, for each size, the store is closed and timed:
`open_s`, the open a restart pays per partition (what it checks: the meta record); `full_check_s`, a crc32 check of
every record, which is what the open paid before it read one record only; `load_p99_ms`, a state read of an
uncached account (its record verified as it is read). The files stay in the page cache between the fill and the
open (as on a restart of the process, not of the host).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import lmdb

from kafold.config import AggregateConfig
from kafold.daemon.aggregates.local import LocalStates
from kafold.daemon.aggregates.store import Entry
from kafold.daemon.aggregates.window import accepted
from kafold.domain import AggregateDomain

BANK = Path(__file__).resolve().parents[3] / "examples" / "bank"
DAY_MS = 86_400_000
FILL_BATCH = 20_000  # commands per committed batch while filling (one LMDB transaction each)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", default="1000000,10000000",
                   help="comma-separated history sizes: commands within the window held by one partition's store, "
                        "each filled on top of the previous size")
    p.add_argument("--accounts", type=int, default=250_000, help="aggregates of the partition (1M accounts over 4 "
                   "partitions: 250,000)")
    p.add_argument("--reads", type=int, default=1000, help="state reads of random accounts timed after each open")
    p.add_argument("--dir", default="", help="where the store is built (default: a temporary directory, deleted)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    agg = AggregateConfig(name="bench.localstore", initial="bank_domain:initial", evolve="bank_domain:evolve",
                          decide="bank_domain:decide", partitions=1)
    domain = AggregateDomain.load(agg, [str(BANK)])
    root = Path(tempfile.mkdtemp(prefix="kafold-bench-localstore-", dir=args.dir or None))
    sizes = sorted(int(s) for s in args.events.split(","))
    out: dict[str, Any] = {"accounts": args.accounts}
    try:
        local = LocalStates(root, domain, agg.state_schema_version, DAY_MS)
        local.open(0, 0, 0)
        local.seal(0, [], 0, None)
        filled, t0, state = 0, int(time.time() * 1000) - DAY_MS // 2, domain.initial()
        for size in sizes:
            began = time.monotonic()
            local.open(0, 0, filled)  # trusted to where the previous size ended (the first: just sealed at 0)
            while filled < size:
                n = min(FILL_BATCH, size - filled)
                touched = []
                for i in range(filled, filled + n):
                    aid, version = f"acc-{i % args.accounts:07d}", i // args.accounts + 1
                    entry = Entry(state, version, 0)
                    entry.recent[f"cmd-{i}"] = accepted(t0 + i // 1000, version, 1)
                    touched.append((aid, entry, [f"cmd-{i}"]))
                filled += n
                local.committed({0: touched}, {0: filled}, cutoff=0)
            fill_s = time.monotonic() - began
            local.close_all()
            out.update(_measure(local, root / "0", filled, args))
            out[f"fill_s_{size}"] = round(fill_s, 1)
        local.close_all()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _measure(local: LocalStates, path: Path, events: int, args: argparse.Namespace) -> dict[str, Any]:
    """The figures of one size (the store closed): best of three opens, the full check, reads after the open."""
    opens = []
    for _ in range(3):
        began = time.perf_counter()
        trusted = local.open(0, 0, events)
        opens.append(time.perf_counter() - began)
        assert trusted is not None and trusted.offset == events, "the bench's store was not trusted"
        local.close(0)
    began = time.perf_counter()
    records = _full_check(path)
    full_s = time.perf_counter() - began
    local.open(0, 0, events)
    rng, reads = random.Random(56), []
    for _ in range(args.reads):
        aid = f"acc-{rng.randrange(args.accounts):07d}"
        began = time.perf_counter()
        found = local.load(0, aid)
        reads.append(time.perf_counter() - began)
        assert found is not None
    local.close(0)
    reads.sort()
    return {f"records_{events}": records, f"open_s_{events}": round(min(opens), 4),
            f"full_check_s_{events}": round(full_s, 2),
            f"load_p99_ms_{events}": round(reads[int(len(reads) * 0.99) - 1] * 1000, 3) if reads else None}


def _full_check(path: Path) -> int:
    """Every record's crc32 checked, as the open did before (local.py's module note): the records checked."""
    env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, max_dbs=0)
    n = 0
    try:
        with env.begin() as txn:
            for _, value in txn.cursor():
                if zlib.crc32(value[4:]).to_bytes(4, "big") != value[:4]:
                    raise ValueError(f"{path}: a record failed its check")
                n += 1
    finally:
        env.close()
    return n
