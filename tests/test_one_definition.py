"""One definition per name: no two classes of the product source share a name (a Protocol and its implementation,
or two meanings of `Plan`, read alike in a traceback, a log line or a grep). Checked on the source with `ast`."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kafold", "daemon", "connectors", "spark_jobs")
# kafold.aio is kafold.client's API for an event loop, the same classes under the same names in their own module
# (as `redis.asyncio.Redis` beside `redis.Redis`): a service imports one or the other.
TWINS = {"CommandClient": {"kafold/aio.py", "kafold/client.py"}, "DaemonClient": {"kafold/aio.py", "kafold/client.py"}}


def test_every_module_level_class_name_is_defined_once() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text(), str(path)).body:
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    twice = {name: places for name, places in where.items() if len(places) > 1
             and {p.partition(":")[0] for p in places} != TWINS.get(name)}
    assert not twice, twice
