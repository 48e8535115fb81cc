"""`pip install kafold` with no extra, in a fresh venv: a service imports the client, the envelope and the domain test
kit without the daemon's dependencies, and the CLI names the extra it needs instead of a traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kafold.extras import EXTRA_OF
from tests.support import ROOT

HEAVY = ("faust", "pyspark", "alembic", "sqlalchemy", "psycopg", "aiohttp", "prometheus_client", "psutil",
         "opentelemetry.sdk", "fastavro", "pgserver")


@pytest.mark.slow
def test_the_core_install_imports_the_client_and_the_testing_kit(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                              ".*_cache", "tests"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(wheels), str(tree)], check=True, capture_output=True)
    (wheel,) = wheels.glob("kafold-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
                             capture_output=True, text=True, timeout=600, check=False)
    assert install.returncode == 0, install.stderr
    probe = f"""
import importlib.util, sys
import kafold.client, kafold.envelope, kafold.codec, kafold.testing, kafold.aio
from kafold.testing import DomainFixture
import kafold
assert kafold.__file__.startswith({str(venv)!r}), kafold.__file__
try:
    kafold.aio.DaemonClient("http://127.0.0.1:1")
except kafold.errors.KafoldError as e:
    assert "pip install 'kafold[aio]'" in str(e), e
else:
    raise AssertionError("kafold.aio.DaemonClient without aiohttp")
print(",".join(m for m in {HEAVY!r} if importlib.util.find_spec(m.partition(".")[0]) is not None))
"""
    res = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"installed without an extra: {res.stdout.strip()}"
    shipped = subprocess.run([str(py), "-c", "import importlib.resources as r; "
                              "print(r.files('kafold').joinpath('py.typed').is_file())"],
                             capture_output=True, text=True, cwd=tmp_path, check=True)
    assert shipped.stdout.strip() == "True"
    cli = subprocess.run([str(venv / "bin" / "kafold"), "daemon", "-c", "kafold.toml"], capture_output=True,
                         text=True, cwd=tmp_path, check=False)
    assert cli.returncode == 2, cli.stdout + cli.stderr
    assert "pip install 'kafold[daemon]'" in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr


def test_every_extra_module_names_an_extra_that_exists() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRA_OF.values()) <= set(extras)
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.split(">")[0].split("[")[0] in ("faust-streaming", "pyspark", "alembic", "opentelemetry-sdk")
                   for d in core)
