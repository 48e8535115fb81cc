"""The set-up of the benches that run `kafold daemon` processes: where they run, their config's tables, start, ready."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafold import db
from kafold.schema import toml_value
from kafold.tools.bench import services, short_group

READY_WITHIN_S = 180.0  # how long a daemon may take to answer /ready (its start-up: imports, topics, migrations)


@dataclass(frozen=True)
class DaemonStack:
    """Where the benchmark's daemons run: [kafka] and [postgres] as the daemon's kafold.toml gives them, the
    environment it adds (the embedded PostgreSQL's URL, kept out of the file), the same settings loaded for the
    bench's own clients (`kafka` with the short group timeouts), a scratch folder for the configs and logs, and the
    run's id (`name`: the prefix of the run's topics and groups)."""

    kafka_raw: dict[str, Any]
    postgres_raw: dict[str, Any]
    env: dict[str, str]
    kafka: Any
    postgres: Any
    workdir: Path
    area: str = "bench"
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def name(self) -> str:
        return f"kafold.bench.{self.area}.{self.run_id}"


def daemon_stack(stack: contextlib.ExitStack, area: str, config: str | None, broker: str | None = None
                 ) -> DaemonStack:
    """Where a bench's daemons run: the configuration given (`-c`), else the dev stack (started if needed, and
    stopped with `stack`); a scratch folder removed with `stack`. kafold's tables are upgraded here, before the
    bench's daemons start (which upgrade too): the bench polls the checkpoints and keeps data keys in them."""
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kafold-bench-{area}-")))
    kafka, pg = services(stack, area, config, broker)
    db.upgrade(pg)
    if config:
        raw = tomllib.loads(Path(config).read_text())
        return DaemonStack(raw.get("kafka", {}), raw.get("postgres", {}), {}, short_group(kafka), pg, workdir, area)
    return DaemonStack({"bootstrap_servers": kafka.bootstrap_servers}, {}, {"KAFOLD_POSTGRES__URL": pg.url},
                       short_group(kafka), pg, workdir, area)


def toml_table(header: str, body: dict[str, Any]) -> str:
    """One table of a kafold.toml: `header` (`[daemon]`, `[[connectors]]`) and its keys."""
    return f"{header}\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in body.items()) + "\n"


@contextlib.contextmanager
def daemon_process(stack: DaemonStack, conf: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`kafold daemon -c conf` in its own process, its log beside `conf`; stopped by SIGTERM on leaving."""
    with open(conf.with_suffix(".log"), "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c",
                                 "import sys; from kafold.tools.cli import main; sys.exit(main())",
                                 "--log-format", "json", "daemon", "-c", str(conf)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **stack.env})
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], port: int, conf: Path, timeout: float = READY_WITHIN_S) -> None:
    """Until the daemon of `daemon_process(…, conf)` answers /ready on `port`; an error naming its log if it exits or
    is not ready within `timeout` seconds."""
    log_path = conf.with_suffix(".log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kafold daemon exited with code {proc.returncode}; see {log_path}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"bench: the daemon was not ready within {timeout:.0f} s; see {log_path}")
