"""A cart runtime with a local state store for the crash tests, killed by itself at a chosen point:
`python -m tests.aggregates.local_proc BOOTSTRAP NAME STATE_DIR POINT N` — POINT `after_commit` (the N-th batch's
transaction committed, its store write not made), `before_commit` (the N-th batch decided and its events sent,
not committed) or `none`."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from kafold import logs
from kafold.config import AggregateConfig, DaemonConfig, KafkaConfig
from kafold.daemon.aggregates import AggregateRuntime
from kafold.daemon.aggregates.local import LocalStates
from kafold.daemon.aggregates.txn import TransactionalWriter
from kafold.domain import AggregateDomain
from tests.aggregates.agg_proc import KAFKA

M = "tests.aggregates.cart_domain"


def cart_config(name: str, partitions: int = 2, cache: int = 3) -> AggregateConfig:
    return AggregateConfig(name=name, initial=f"{M}:initial", evolve=f"{M}:evolve", decide=f"{M}:decide",
                           partitions=partitions, cache_max_aggregates=cache)


def _kill_on(cls: type, method: str, nth: int, before: bool) -> None:
    """Make `cls.method`'s `nth` call end this process with SIGKILL (before or after the real call)."""
    real, calls = getattr(cls, method), [0]

    def hooked(self: Any, *args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth and before:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kw)

    setattr(cls, method, hooked)


def main() -> None:
    bootstrap, name, state_dir, point, nth = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    logs.configure("info", "json")
    if point == "after_commit":  # the store is written right after the commit: dying there leaves it behind
        _kill_on(LocalStates, "committed", nth, before=True)
    elif point == "before_commit":
        _kill_on(TransactionalWriter, "commit", nth, before=True)
    kafka = KafkaConfig(bootstrap_servers=bootstrap, **KAFKA)  # type: ignore[arg-type]
    agg = cart_config(name)
    daemon = DaemonConfig(group_prefix="kt", batch_max_records=20, batch_max_wait_ms=20, state_dir=state_dir)
    AggregateRuntime(kafka, daemon, agg, AggregateDomain.load(agg), instance_id="crash").run()


if __name__ == "__main__":
    main()
