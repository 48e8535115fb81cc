"""`kafold bench AREA`: each area is a module here exposing add_arguments(parser) and run(args) -> dict of figures."""

from __future__ import annotations

import contextlib
import os
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


# HotSpot names its JIT compiler threads "C1 CompilerThread0", "C2 CompilerThread1", … (cut to 15 characters in
# /proc's comm). A broker started for a bench compiles through the whole run (measured on Apache Kafka at 1,000
# events/s: 0.2 to 0.35 of a core for the 80 s of `bench latency`, half the broker's CPU), a cost a broker that has run
# for a while no longer pays; `jit_cpu_s` lets a bench show it apart.
JIT_THREAD_PREFIXES = ("C1 CompilerThre", "C2 CompilerThre")


def jit_cpu_s(procs: list[Any]) -> float | None:
    """User + system CPU seconds so far of the JIT compiler threads (JIT_THREAD_PREFIXES) of `procs` (psutil
    processes; a process or thread gone since is left out: HotSpot starts and ends compiler threads as the work
    asks); None where /proc is not there to name the threads."""
    if not Path("/proc/self/task").is_dir():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in procs:
        for task in Path(f"/proc/{p.pid}/task").glob("*"):
            try:
                if not (task / "comm").read_text().startswith(JIT_THREAD_PREFIXES):
                    continue
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (proc(5): fields 14 and 15)
    return total / tick


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
