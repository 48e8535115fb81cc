"""Which tests pytest-xdist keeps together on one worker (`make test` runs the Apache Kafka stage with `-n 2 --dist
loadgroup`), decided from the collected items rather than from the test ids.

Every worker is its own pytest process with its own session broker and PostgreSQL, so a test that pauses or kills
them disturbs only its own worker. Groups run one after another on one worker:
- the `slow` tests (kill -9 loops, the chaos runs with their own three-node clusters): two of them never fight for
  the two cores at once; xdist hands out the units with the most tests first, one to each worker, so this one
  (the largest with the registry's) starts at once;
- the tests of a module sharing a module-scoped fixture (a scenario, a daemon, a Connect worker): set up once;
- the tests of an expensive session fixture (one Spark JVM, one Apicurio Registry; not one per worker), and the
  tests marked `spark` (Spark JVMs of their own) with the Spark fixture's;
- tests marked `xdist_group(name)`.

Why not only xdist's own `loadgroup`: it appends the group to `item._nodeid`, which pytest 9.2 no longer reads (node
ids live in `item._id`), so its groups are silently ignored. Here each worker writes the map test id -> group to a
file the controller names (`pytest_configure_node`), and the controller's scheduler reads the groups from it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

SERIAL_GROUP = "slow"
SHARED_SESSION_FIXTURES = ("spark", "registry_url")  # a JVM each: one per session, not one per worker
_KEY = "kafold_groups_dir"


def group_of(item: pytest.Item) -> str | None:
    """The group `item` runs in, None for a test of its own."""
    marked = item.get_closest_marker("xdist_group")
    if marked is not None:
        return str(marked.args[0] if marked.args else marked.kwargs.get("name", "default"))
    if item.get_closest_marker("slow") is not None:
        return SERIAL_GROUP
    if item.get_closest_marker("spark") is not None:  # its own Spark JVM(s): never two at once on the two cores
        return "spark"
    names = set(getattr(item, "fixturenames", ()))
    shared = [f for f in SHARED_SESSION_FIXTURES if f in names]
    if shared:
        return shared[0]
    # pytest's resolved fixture closure of the item (it has no public accessor)
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(d and d[-1].scope in ("module", "package", "class") for d in defs.values()):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller: tell each worker where to write its groups."""
    config = node.config
    if not hasattr(config, _KEY):
        setattr(config, _KEY, tempfile.mkdtemp(prefix="kafold-xdist-"))
    node.workerinput[_KEY] = getattr(config, _KEY)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker: write the groups of the tests it collected (every worker collects the same)."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or _KEY not in workerinput:
        return
    groups = {item.nodeid: g for item in items if (g := group_of(item)) is not None}
    path = Path(workerinput[_KEY]) / f"{workerinput['workerid']}.json"
    part = path.with_suffix(".part")
    part.write_text(json.dumps(groups))
    os.replace(part, path)  # whole or absent for the controller


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Controller, with `--dist loadgroup`: xdist's scope scheduler, the scopes being the groups above."""
    if config.getvalue("dist") != "loadgroup":
        return None
    # xdist is imported only when it runs this hook: a plain `pytest` needs no xdist installed.
    from xdist.scheduler import LoadScopeScheduling

    groups_dir = Path(getattr(config, _KEY))

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # every worker has collected by now (schedule() runs after that)
                self.groups = {}
                for f in sorted(groups_dir.glob("*.json")):
                    self.groups.update(json.loads(f.read_text()))
            group = self.groups.get(nodeid)
            return f"group:{group}" if group is not None else nodeid

    return GroupScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, _KEY):
        shutil.rmtree(getattr(config, _KEY), ignore_errors=True)
