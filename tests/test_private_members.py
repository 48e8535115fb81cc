"""No product module uses a private member (`x._name`, `from m import _name`) that it does not define itself: what
starts with one underscore belongs to the module that defines it. A subclass in another module uses its base's
declared, public extension surface (e.g. connectors/projection/writer.py's, for shadow_writer.py), never its
privates. Checked on the source with `ast`: a name counts as the module's own when the module defines it (a
function, class, assignment, attribute set or parameter), so an access the check lets through may still read
another class's attribute of the same name; what it reports is always a real reach into another module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kafold", "daemon", "connectors", "spark_jobs")

# Underscored names that are public API of the libraries they come from.
LIBRARY_API = frozenset({
    # librdkafka's local error codes (KafkaError)
    "_PARTITION_EOF", "_TIMED_OUT", "_TRANSPORT", "_FENCED", "_DESTROY_BROKER", "_FATAL",
    "_replace", "_asdict", "_fields", "_make",  # namedtuple's methods
    "_current_frames", "_getframe", "_exit",  # sys and os, documented
})

# Reaches allowed, each named `path: member`, with why. The test fails on an entry that no longer matches anything,
# so this list only shrinks.
KNOWN: frozenset[str] = frozenset({
    # third-party internals with no public equivalent: mode's worker's stop time and signal hook (a signal handler
    # override), aiohttp's TCPSite server (the bench receiver's socket), argparse's subparsers type (for typing)
    "daemon/host.py: _signal_stop_time", "daemon/host.py: _schedule_shutdown",
    "kafold/tools/bench/receiver.py: _server",
    "kafold/tools/commands/subjects.py: _SubParsersAction",
})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.AST) -> set[str]:
    """The names `tree` defines: its functions, classes, assignments, attributes it sets, parameters, keywords."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store | ast.Del):
            names.add(n.attr)
        elif isinstance(n, ast.arg | ast.keyword) and n.arg:
            names.add(n.arg)
    return names


def _super(node: ast.expr) -> bool:
    """`super()`: an override calling its base's private method reaches into the base (another module's, as a
    rule), even though the override defines the name here."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def reaches(source: str, name: str) -> Iterator[tuple[str, str]]:
    """(where, member) for each private member `source` (the module at path `name`) uses without defining it."""
    tree = ast.parse(source, name)
    own = {n for n in _defined(tree) if _private(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    yield f"{name}:{node.lineno}: imports {alias.name} from {node.module}", alias.name
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr) \
                and (node.attr not in own or _super(node.value)) and node.attr not in LIBRARY_API:
            yield f"{name}:{node.lineno}: {ast.unparse(node)[:80]}", node.attr


def _found() -> dict[str, list[str]]:
    """`path: member` -> where, over the product code."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for where, member in reaches(path.read_text(), rel):
                found.setdefault(f"{rel}: {member}", []).append(where)
    return found


def test_no_module_uses_a_private_member_of_another() -> None:
    found = _found()
    new = [w for key, wheres in sorted(found.items()) if key not in KNOWN for w in wheres]
    assert not new, "private members used outside their module:\n" + "\n".join(new)


def test_the_known_reaches_are_still_there() -> None:
    """An entry of KNOWN whose reach was mended is removed, so the list shows what is left."""
    gone = sorted(KNOWN - set(_found()))
    assert not gone, f"mended (remove from KNOWN): {gone}"


def test_the_check_sees_a_reach_and_accepts_the_module_s_own() -> None:
    reach = "from m import _hidden\n\ndef f(w):\n    return w._turns\n"
    own = "class A:\n    def __init__(self):\n        self._n = 1\n\n    def f(self, other):\n        return other._n\n"
    assert [m for _, m in reaches(reach, "reach")] == ["_hidden", "_turns"]
    override = "class B(A):\n    def _f(self):\n        return super()._f()\n"
    assert [m for _, m in reaches(override, "override")] == ["_f"]
    assert list(reaches(own, "own")) == []
    assert list(reaches("def f(e):\n    return e.code() == e._PARTITION_EOF\n", "lib")) == []
