"""`kafold bench AREA`: each area is a module here exposing add_arguments(parser) and run(args) -> dict of figures."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kafold.config import KafkaConfig, PostgresConfig, load_file
from kafold.tools.dev import stack as devstack

# area name -> module (kafold.tools.bench.<module>); a module is imported only when its area runs.
AREAS: dict[str, str] = {"projection": "projection", "daemon": "daemon", "snapshots": "snapshots", "effects": "effects",
                        "aggregates": "aggregates", "rebuild": "rebuild", "evolution": "evolution",
                        "latency": "latency", "privacy": "privacy", "history": "history",
                        "aio": "aio", "localstore": "localstore"}

# Short group timeouts for the benches' consumers: a first JoinGroup waits for them on the embedded broker
# (docs/brokers.md), and otherwise for the default rebalance timeout.
SHORT_GROUP_TIMEOUTS = {"session_timeout_ms": 6000, "rebalance_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


def short_group(kafka: Any) -> Any:
    """`kafka` (a KafkaConfig) with SHORT_GROUP_TIMEOUTS."""
    return KafkaConfig(**{**kafka.__dict__, **SHORT_GROUP_TIMEOUTS})


# What the last `embedded_stack` measured of its broker (kind, CPU seconds, wall seconds), for `kafold bench` to
# print beside the bench's own figures; empty when the bench ran on a configured (`-c`) broker.
BROKER_USAGE: dict[str, Any] = {}
# The running `embedded_stack`'s broker processes (psutil), for a bench to measure the broker over its own window
# (`cpu_s`); empty on a configured (`-c`) broker.
BROKER_PROCESSES: list[Any] = []


def cpu_s(procs: list[Any]) -> float:
    """User + system CPU seconds of `procs` (psutil processes) so far (a process gone since is left out)."""
    # psutil: kafold[daemon], not in the core install
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def services(stack: contextlib.ExitStack, area: str, config: str | None, broker: str | None = None
             ) -> tuple[KafkaConfig, PostgresConfig]:
    """[kafka] and [postgres] of the configuration given (`-c`), else of the dev stack (started if needed, and
    stopped with `stack`; see `embedded_stack`)."""
    if config:
        cfg = load_file(config).config
        return cfg.kafka, cfg.postgres
    bootstrap, url = stack.enter_context(embedded_stack(area, broker))
    return KafkaConfig(bootstrap_servers=bootstrap), PostgresConfig(url=url)


@contextlib.contextmanager
def embedded_stack(area: str, broker: str | None = None) -> Iterator[tuple[str, str]]:
    """(bootstrap servers, PostgreSQL URL) of the running `kafold dev` stack, or of one started for this bench;
    `broker` ("tansu" or "kafka"; None: the running stack's, else tansu) asks for that broker: a running stack
    with another one is left alone and a private stack is started. The broker's CPU time over the bench (its
    start-up excluded) goes to BROKER_USAGE."""
    BROKER_USAGE.clear()
    running = devstack.status()
    state: Path | None = None
    if running is not None and broker in (None, running.kind):
        stack = running
    else:
        state = Path(tempfile.mkdtemp(prefix=f"kafold-bench-{area}-"))
    try:
        if state is not None:
            stack = devstack.up(state, broker=broker or "tansu")
        brokers = [h for h in (b.handle() for b in stack.brokers) if h is not None]
        began, cpu = time.monotonic(), cpu_s(brokers)
        BROKER_PROCESSES[:] = brokers
        try:
            yield stack.bootstrap_servers, stack.postgres_url
        finally:
            BROKER_PROCESSES.clear()
            wall = time.monotonic() - began
            used = cpu_s(brokers) - cpu
            BROKER_USAGE.update({"broker": stack.kind, "broker_nodes": stack.nodes, "broker_cpu_s": round(used, 1),
                                 "broker_cores": round(used / wall, 2) if wall > 0 else 0.0})
    finally:
        if state is not None:
            devstack.down(state)
            shutil.rmtree(state, ignore_errors=True)  # a private stack's data (Apache Kafka's logs) goes with it
