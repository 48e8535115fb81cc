"""A child process (a sink task, an aggregate worker) loads neither aiohttp nor rich: each cost every child ~16 and
~8 MB of memory for code a child never runs (docs/benchmarks.md, issue 56), and its logs still work, tracebacks
included (structlog's plain ones)."""

from __future__ import annotations

import json
import subprocess
import sys

from kafold.daemon.task_process import CHILD_SETUP

CHILD = f"""{CHILD_SETUP}
import json
import kafold.daemon.task_process, kafold.daemon.aggregates.workers
from kafold import logs
logs.configure("info", "console")
try:
    raise ValueError("the child's traceback")
except ValueError:
    logs.get("child").exception("child.failed")
print(json.dumps(sorted(name for name, module in sys.modules.items() if module is not None)))
"""


def test_a_child_loads_neither_aiohttp_nor_rich_and_still_logs_a_traceback() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert {"kafold", "confluent_kafka", "structlog"} <= loaded
    unwanted = loaded & {"aiohttp", "yarl", "rich", "pygments", "faust"}
    assert not unwanted, sorted(unwanted)
    assert "child.failed" in done.stderr and "ValueError: the child's traceback" in done.stderr, done.stderr
