"""What the test folders share: kafold.testing's helpers (the sink contract, topics, producing, the one `wait_for`
and `free_port`), the repository's paths and the environment a child process needs to import `tests.…`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kafold.config import KafkaConfig
from kafold.testing import (
    LocalContext,
    SinkTaskContract,
    committed,
    create_topic,
    free_port,
    make_event,
    new_producer,
    produce,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]  # the repository: examples/, docs/, deploy/ and the tests package
EXAMPLES = ROOT / "examples"

__all__ = ["EXAMPLES", "ROOT", "LocalContext", "SinkTaskContract", "child_env", "committed", "create_topic",
           "free_port", "kafka_toml", "make_event", "new_producer", "produce", "wait_for"]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH, so that a child process (a daemon, a
    runtime, a task process) imports test modules by the same `tests.…` names as the tests that start it."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(extra or {})}


def kafka_toml(kafka: KafkaConfig) -> str:
    """The `[kafka]` table of a daemon under test: the test broker, and group timeouts short enough that a daemon
    killed or stopped hands its partitions over within seconds, not the default 45 s."""
    return f"""[kafka]
bootstrap_servers = "{kafka.bootstrap_servers}"
session_timeout_ms = 6000
rebalance_timeout_ms = 6000
heartbeat_interval_ms = 1000
"""
