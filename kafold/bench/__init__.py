"""`kafold bench AREA`: each area is a module here exposing add_arguments(parser) and run(args) -> dict of figures."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# area name -> module (kafold.bench.<module>); a module is imported only when its area runs.
AREAS: dict[str, str] = {"projection": "projection", "daemon": "daemon", "snapshots": "snapshots", "effects": "effects",
                        "aggregates": "aggregates", "rebuild": "rebuild"}

# Short group timeouts for the benches' consumers: a first JoinGroup waits for them on the embedded broker
# (ENVIRONMENT.md), and otherwise for the default rebalance timeout.
SHORT_GROUP_TIMEOUTS = {"session_timeout_ms": 6000, "rebalance_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


def short_group(kafka: Any) -> Any:
    """`kafka` (a KafkaConfig) with SHORT_GROUP_TIMEOUTS."""
    from kafold.config import KafkaConfig

    return KafkaConfig(**{**kafka.__dict__, **SHORT_GROUP_TIMEOUTS})


@contextlib.contextmanager
def embedded_stack(area: str) -> Iterator[tuple[str, str]]:
    """(bootstrap servers, PostgreSQL URL) of the running `kafold dev` stack, or of one started for this bench."""
    from kafold import devstack

    running = devstack.status()
    if running is not None:
        yield running.bootstrap_servers, running.postgres_url
        return
    state = Path(tempfile.mkdtemp(prefix=f"kafold-bench-{area}-"))
    try:
        stack = devstack.up(state)
        yield stack.bootstrap_servers, stack.postgres_url
    finally:
        devstack.down(state)
