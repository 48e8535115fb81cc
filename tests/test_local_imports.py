"""An import inside a function says why it is not at the top of its module (a cycle, a heavy or optional dependency,
a layer rule) in a comment on its line or just above its block of imports; confluent_kafka, a hard dependency of the
core, is always imported at the top. Checked on the source with `ast`."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kafold", "daemon", "connectors", "spark_jobs")
Import = ast.Import | ast.ImportFrom


def _module(node: Import) -> str:
    return (node.module or "") if isinstance(node, ast.ImportFrom) else node.names[0].name


def local_imports(source: str, filename: str) -> Iterator[tuple[Import, Import]]:
    """Each import inside a function, with the first import of the run of imports it belongs to."""
    tree = ast.parse(source, filename)
    seen: set[int] = set()  # a nested function's imports are walked from its outer function too
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            for field in ("body", "orelse", "finalbody", "handlers"):
                stmts = getattr(node, field, None)
                if not isinstance(stmts, list):
                    continue
                first: Import | None = None
                for stmt in stmts:
                    if isinstance(stmt, Import):
                        first = first or stmt
                        if stmt.lineno not in seen:
                            seen.add(stmt.lineno)
                            yield stmt, first
                    else:
                        first = None


def unexplained(source: str, name: str) -> Iterator[str]:
    """What is wrong with the imports inside functions of `source` (a module's text, `name` its path)."""
    lines = source.splitlines()
    for node, first in local_imports(source, name):
        where = f"{name}:{node.lineno}"
        if _module(node).split(".")[0] == "confluent_kafka" and not _module(node).startswith(
                "confluent_kafka.schema_registry"):
            yield f"{where}: confluent_kafka is a hard dependency: import it at the top of the module"
            continue
        own = "#" in lines[(node.end_lineno or node.lineno) - 1]
        above = lines[first.lineno - 2].strip().startswith("#") if first.lineno > 1 else False
        if not (own or above or "#" in lines[node.lineno - 1]):
            yield f"{where}: `{ast.unparse(node)}` inside a function without a comment saying why"


def test_every_import_inside_a_function_says_why() -> None:
    """(The registry's deserializers, confluent_kafka.schema_registry, need kafold[registry]: an optional one.)"""
    found = [p for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for p in unexplained(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_the_check_sees_an_unexplained_import_and_accepts_a_reason() -> None:
    bare = "def f():\n    import psycopg\n    return psycopg\n"
    said = "def f():\n    # psycopg: kafold[daemon], not in the core\n    import psycopg\n    import psycopg.rows\n"
    top = "def f():\n    from confluent_kafka import Consumer  # no reason makes this right\n"
    assert [n.lineno for n, _ in local_imports(bare, "x")] == [2]
    assert len(list(unexplained(bare, "bare"))) == 1
    assert list(unexplained(said, "said")) == []
    assert "hard dependency" in next(unexplained(top, "top"))
