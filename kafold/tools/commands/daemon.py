"""`kafold daemon -c FILE`: the Faust sidecar hosting the configured connectors and aggregates until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

from kafold import config, devstack
from kafold.daemon import signals
from kafold.tools.cli import add_config_arg


def register(sub: Any) -> None:
    p = sub.add_parser("daemon", help="run the configured connectors and aggregates until SIGTERM/SIGINT")
    add_config_arg(p)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    signals.catch_early()  # before the imports and checks below: a supervisor's SIGTERM now still stops gracefully
    loaded = config.load_file(args.config)
    # The task processes' interpreters first: they import while this one imports Faust (no Faust in that module).
    from kafold.daemon import task_process

    task_process.prestart(loaded.config.connectors, loaded.config.daemon)
    from kafold.daemon.host import services_needed  # after catch_early: Faust's imports take a second or two

    return run(devstack.effective(loaded.config, need=services_needed(loaded)), loaded.base, config_path=loaded.path)


def run(cfg: config.KafoldConfig, base: Path, stop: threading.Event | None = None,
        config_path: Path | None = None) -> int:
    """Run until SIGTERM/SIGINT (main thread), `stop` is set, or a task fails (fail fast: exit code 1).

    Returns 0 after a clean stop, 1 when a task failed or did not stop within `daemon.shutdown_grace_s`.
    """
    from kafold.daemon.host import DaemonHost  # lazy: Faust's imports take a second or two (see handle)
    from kafold.daemon.task_process import release_prestarted  # lazy, as DaemonHost

    try:
        host = DaemonHost(cfg, base, stop, config_path)
    finally:
        release_prestarted()  # those no task took (DaemonHost took one per task process)
    return host.run()
