"""The example plugin in examples/plugin, installed from its own folder with pip, is found through its entry point
and passes kafold.testing's sink contract in its own test suite (run by a separate pytest, as its author would)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kafold.testing import SinkTaskContract
from tests.support import EXAMPLES

PLUGIN = EXAMPLES / "plugin"


def test_the_example_plugin_installs_registers_and_passes_the_contract(tmp_path: Path, kafka_bootstrap: str) -> None:
    source, site = tmp_path / "plugin", tmp_path / "site"
    # A copy: building writes build/ and *.egg-info beside the sources. --target: a folder of its own, so the test
    # never changes the environment it runs in; no build isolation, so no network (setuptools is a dev dependency).
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, timeout=300)
    # Not the outer run's PYTEST_ADDOPTS: its --basetemp (a parent of the plugin's folder) would refuse the run.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, "PYTHONPATH": str(site),
           "KAFOLD_TEST_BOOTSTRAP": kafka_bootstrap}

    found = subprocess.run([sys.executable, "-c", "from kafold.connectors.registry import available, resolve; "
                            "import sys; print(available()); print(sys.modules[resolve('jsonl').__module__].__file__)"],
                           env=env, capture_output=True, text=True, check=True, timeout=120)
    assert "'jsonl'" in found.stdout and str(site / "kafold_jsonl_sink") in found.stdout  # the installed copy

    # Its own tests, run as its author would: a separate pytest in the plugin's folder (kafold's pytest
    # configuration and conftest do not apply there).
    tests = source / "tests"
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--rootdir", str(tests),
                          str(tests)], cwd=tests, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = {line.split("::")[-1].split()[0] for line in run.stdout.splitlines() if " PASSED" in line}
    contract = {name for name in dir(SinkTaskContract) if name.startswith("test_")}
    assert contract <= passed, run.stdout[-3000:]  # every contract test, the broker one included
    assert "test_a_redelivered_batch_is_written_once_and_open_resumes_after_the_file" in passed
