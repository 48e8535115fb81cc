"""The benches' figures from a run too small to time (issue 56's `kafold bench privacy --events 2000`): what cannot
be computed is absent (None), never a ZeroDivisionError and never 0."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kafold.tools.bench import jit_cpu_s
from kafold.tools.bench.figures import median, median_ratio, per, rounded
from kafold.tools.bench.projection import projection_figures


def _marks(first: float, last: float, covered: int) -> dict[str, Any]:
    """`_watch`'s marks: the daemon tree's CPU 1.0 s -> 1.5 s, PostgreSQL's 2.0 -> 2.25, no broker measured."""
    return {"first": first, "last": last, "covered": covered, "tree": ["daemon", "task"], "pg": ["postmaster"],
            "broker": [], "cpu0": 1.0, "cpu1": 1.5, "pg0": 2.0, "pg1": 2.25, "broker0": 0.0, "broker1": 0.0,
            "peak": 0.0, "rss": 80.4, "pss": 60.6}


def test_a_run_whose_first_checkpoint_covered_everything_has_absent_rates() -> None:
    got = projection_figures(_marks(5.0, 5.0, 2000), 2000, 2000)
    assert (got["events"], got["seconds"], got["events_per_s"]) == (0, 0.0, None)
    assert got["cpu_us_per_event"] == {"kafold": None, "postgres": None, "broker": None}
    assert got["cores_busy"] == {"kafold": None, "postgres": None, "broker": None}
    assert (got["rss_mb"], got["pss_mb"], got["processes"], got["rows_changed"]) == (80, 61, 2, 2000)


def test_a_timed_run_has_its_figures() -> None:
    got = projection_figures(_marks(5.0, 7.0, 1000), 3000, 3000)
    assert got["events_per_s"] == 1000.0
    assert got["cpu_us_per_event"] == {"kafold": 250.0, "postgres": 125.0, "broker": None}
    assert got["cores_busy"] == {"kafold": 0.25, "postgres": 0.12, "broker": None}


def test_per_is_absent_over_nothing_or_of_nothing_known() -> None:
    assert per(10, 0) is None
    assert per(10, -1.0) is None
    assert per(None, 2) is None
    assert per(10, None) is None
    assert per(0, 2) == 0.0
    assert per(3, 2, 1e6) == 1.5e6


def test_medians_and_ratios_skip_absent_rounds() -> None:
    assert median([None, 3.0, 1.0, None, 2.0]) == 2.0
    assert median([None, None]) is None
    assert median_ratio([2.0, None, 4.0], [2.0, 2.0]) == 1.5
    assert median_ratio([None], [2.0]) is None
    assert median_ratio([2.0], [None]) is None
    assert median_ratio([2.0], [0.0]) is None
    assert rounded(None) is None
    assert rounded(2.567, 2) == 2.57
    assert rounded(2.5) == 2


def test_the_broker_jit_share_counts_the_compiler_threads_only() -> None:
    """`jit_cpu_s` adds up the threads named as HotSpot names its JIT compilers, and nothing else: a thread of this
    process renamed so (through /proc, as the JVM names its own) and one left unnamed each burn CPU."""
    # psutil: kafold[daemon], which the tests install
    import psutil

    if not Path("/proc/self/task").is_dir():
        assert jit_cpu_s([psutil.Process()]) is None
        return
    before = jit_cpu_s([psutil.Process()])
    assert before == 0.0  # no thread of the test process is named so yet
    burnt: dict[str, float] = {}

    def burn(name: str | None) -> None:
        if name is not None:
            Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name)
        while time.thread_time() < 0.2:  # CPU of this thread, whatever the machine's load
            sum(range(1000))
        burnt[name or "plain"] = time.thread_time()
        done.wait()

    done = threading.Event()
    threads = [threading.Thread(target=burn, args=(n,)) for n in ("C2 CompilerThread0", None)]
    for t in threads:
        t.start()
    try:
        while len(burnt) < 2:
            time.sleep(0.01)
        got = jit_cpu_s([psutil.Process()])
    finally:
        done.set()
        for t in threads:
            t.join()
    assert got is not None
    # /proc counts in clock ticks (10 ms): the named thread's own CPU to within a few, not the plain one's as well
    assert burnt["C2 CompilerThread0"] - 0.05 <= got <= burnt["C2 CompilerThread0"] + 0.05
