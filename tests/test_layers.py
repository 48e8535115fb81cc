"""The core and the tools (docs/architecture.md): pyproject's core contract names every module of the core, no module
of the project imports a tool's old name, and each old name (kafold/moved.py) is the very module of its new home."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from kafold import moved

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kafold", "daemon", "connectors", "spark_jobs")


def _core_modules() -> set[str]:
    """kafold/'s modules and packages outside the testing kit and the tools, as import-linter names them."""
    names = {f"kafold.{p.stem}" for p in (ROOT / "kafold").glob("*.py") if p.stem != "__init__"}
    names |= {f"kafold.{p.parent.name}" for p in (ROOT / "kafold").glob("*/__init__.py")}
    return names - {"kafold.testing", "kafold.tools"}


def test_the_core_contract_names_every_module_of_the_core() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    core = next(c for c in contracts if c["name"].startswith("the core imports no"))
    assert set(core["source_modules"]) == _core_modules()
    assert "kafold.tools" in core["forbidden_modules"]


def _imported(path: Path) -> Iterator[str]:
    """The modules `path` imports (its import statements, at any depth)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_no_module_of_the_project_imports_an_old_name() -> None:
    found = [f"{path.relative_to(ROOT)}: {name}" for package in PACKAGES
             for path in sorted((ROOT / package).rglob("*.py")) for name in _imported(path)
             if moved.new_name(name) is not None]
    assert found == []


def test_an_old_name_is_the_module_of_its_new_home() -> None:
    # in a fresh interpreter: which of the two names is imported first must not matter
    code = ("from kafold import cli; from kafold.bench import aggregates as A; import kafold.testing.fixtures as F\n"
            "import kafold.tools.cli, kafold.tools.bench.aggregates, kafold.tools.dev.fixtures as G\n"
            "assert cli is kafold.tools.cli and A is kafold.tools.bench.aggregates and F is G\n"
            "assert A.__spec__.name == 'kafold.tools.bench.aggregates', A.__spec__\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert importlib.import_module("kafold.commands.dev") is importlib.import_module("kafold.tools.commands.dev")
    assert moved.new_name("kafold.bench.aggregates") == "kafold.tools.bench.aggregates"
    assert moved.new_name("kafold.benchmarks") is None and moved.new_name("kafold.config") is None


def test_python_m_runs_an_old_name() -> None:
    done = subprocess.run([sys.executable, "-m", "kafold.cli", "--version"], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    assert done.stdout.startswith("kafold ")
