"""A runtime process for the crash tests, run until killed:
`python -m tests.aggregates.agg_proc BOOTSTRAP NAME PARTITIONS INSTANCE`."""

from __future__ import annotations

import sys

from kafold import logs
from kafold.config import KafkaConfig
from tests.aggregates.agg_support import bank_config, runtime

# Short group timeouts so a restarted process rejoins in seconds on the embedded broker (a dead member is
# only evicted after its session / rebalance timeout); production keeps Kafka's defaults.
KAFKA = dict(session_timeout_ms=2000, heartbeat_interval_ms=500, rebalance_timeout_ms=3000)


def main() -> None:
    bootstrap, name, partitions, instance = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    logs.configure("info", "json")
    kafka = KafkaConfig(bootstrap_servers=bootstrap, **KAFKA)  # type: ignore[arg-type]
    rt = runtime(kafka, bank_config(name, partitions=partitions), instance)
    rt.daemon = rt.daemon.__class__(group_prefix="kt", batch_max_records=100, batch_max_wait_ms=20)
    rt.run()


if __name__ == "__main__":
    main()
