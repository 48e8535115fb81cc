"""The SparkSession for snapshot jobs: a Java 17/21 runtime found (or a clear error), workers on our Python."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kafold import logs
from kafold.errors import FatalError

log = logs.get(__name__)

SUPPORTED_JAVA = (17, 21)
INSTALL_HINT = ("install a Java runtime for Spark: apt-get install openjdk-17-jre-headless "
                "(or set JAVA_HOME to a JDK 17/21)")


class JavaNotFoundError(FatalError):
    """No Java runtime Spark 4 can use (17 or 21) was found."""


def _major(java: Path) -> int | None:
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return None
    found = re.search(r'version "(\d+)', out.stderr + out.stdout)
    return int(found.group(1)) if found else None


def _candidates() -> list[Path]:
    homes: list[Path] = []
    if os.environ.get("JAVA_HOME"):
        homes.append(Path(os.environ["JAVA_HOME"]))
    on_path = shutil.which("java")
    if on_path:
        homes.append(Path(on_path).resolve().parent.parent)
    jvm = Path("/usr/lib/jvm")
    if jvm.is_dir():
        homes.extend(sorted(p for p in jvm.iterdir() if p.is_dir() and not p.is_symlink()))
    return homes


def find_java_home() -> str:
    """JAVA_HOME, else the `java` on PATH, else /usr/lib/jvm/*: the first with Java 17 or 21."""
    seen: list[str] = []
    for home in _candidates():
        java = home / "bin" / "java"
        if not java.is_file():
            continue
        major = _major(java)
        seen.append(f"{home} (Java {major})")
        if major in SUPPORTED_JAVA:
            return str(home)
    found = f"; found only: {', '.join(seen)}" if seen else ""
    raise JavaNotFoundError(f"Spark 4 needs Java 17 or 21 and none was found{found}. {INSTALL_HINT}")


def session(master: str | None = "local[*]", conf: Mapping[str, str] | None = None,
            app: str = "kafold-snapshots") -> Any:
    """A SparkSession (shared: getOrCreate) whose Python workers run this interpreter."""
    try:
        # pyspark: kafold[spark], only where a Spark job runs
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise FatalError("snapshot jobs need pyspark: pip install 'kafold[spark]'") from e
    if not (os.environ.get("JAVA_HOME") and _major(Path(os.environ["JAVA_HOME"]) / "bin" / "java") in SUPPORTED_JAVA):
        os.environ["JAVA_HOME"] = find_java_home()
    # Workers must import pyarrow, orjson and kafold: run them with the project's interpreter.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    began = time.monotonic()
    builder = SparkSession.builder.appName(app)
    if master is not None:  # None: spark-submit (or spark-defaults) chose it
        builder = builder.master(master)
    builder = (builder
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")  # kafold reports progress itself
               .config("spark.sql.execution.arrow.maxRecordsPerBatch", "50000")
               .config("spark.python.worker.reuse", "true")
               .config("spark.sql.shuffle.partitions", "4"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    log.info("spark.session", master=master, java_home=os.environ["JAVA_HOME"],
             startup_s=round(time.monotonic() - began, 2))
    return spark
