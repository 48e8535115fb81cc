"""`kafold daemon -c FILE`: run every configured sink connector (one thread per task) until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from kafold import config, devstack
from kafold.cli import add_config_arg
from kafold.connectors.api import Connector
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner
from kafold.errors import FatalError

log = structlog.get_logger("kafold.daemon")


def register(sub: Any) -> None:
    p = sub.add_parser("daemon", help="run the configured connectors until SIGTERM/SIGINT")
    add_config_arg(p)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    cfg = devstack.effective(loaded.config, need=("kafka",))
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("stop requested", signal=signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run(cfg, loaded.base, stop)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def build(cfg: config.KafoldConfig, base: Path, stop: threading.Event) -> tuple[list[Connector[Any]],
                                                                               list[SinkRunner]]:
    """Instantiate every connector through the registry and one SinkRunner per task config."""
    connectors: list[Connector[Any]] = []
    runners: list[SinkRunner] = []
    with config.python_path(cfg, base):
        for i, settings in enumerate(cfg.connectors):
            connector = instantiate(settings, base, f"connectors[{i}]")
            if not connector.is_sink():
                raise FatalError(f"connector {settings.name!r}: the daemon runs sink connectors only")
            connectors.append(connector)
            for task_config in connector.task_configs(settings.tasks_max)[: settings.tasks_max]:
                runners.append(SinkRunner(connector, task_config, kafka=cfg.kafka, daemon=cfg.daemon,
                                          stop=stop))
    return connectors, runners


def run(cfg: config.KafoldConfig, base: Path, stop: threading.Event) -> int:
    """Run until `stop` is set or a task fails (then stop the others: fail fast, let the supervisor restart).

    Returns 0 after a clean stop, 1 when a task failed or did not stop within `daemon.shutdown_grace_s`.
    """
    connectors, runners = build(cfg, base, stop)
    if not runners:
        log.warning("no connectors configured; nothing to run")
        return 0
    threads = [threading.Thread(target=r.run, name=f"kafold-{r.connector.name}-{r.context.task_id}",
                                daemon=True) for r in runners]
    for t in threads:
        t.start()
    log.info("daemon started", connectors=[c.name for c in connectors], tasks=len(runners))
    while not stop.is_set() and all(t.is_alive() for t in threads):
        stop.wait(0.5)
    stop.set()
    deadline = time.monotonic() + cfg.daemon.shutdown_grace_s + 5.0  # + time to leave the group and close
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    for c in connectors:
        try:
            c.stop()
        except Exception as e:
            log.error("connector stop failed", connector=c.name, error=str(e))
    failed = [f"{r.connector.name}[{r.context.task_id}]" for r in runners if r.error is not None]
    if stuck:
        log.error("tasks did not stop within the grace period; exiting anyway", tasks=stuck)
    log.info("daemon stopped", failed=failed)
    return 1 if failed or stuck else 0
