"""A daemon subprocess for crash tests: one SinkRunner driving an effect connector until SIGTERM (or kill -9).

argv[1] is a JSON object: bootstrap, pg_url, schema, name, topic, class, config, group_prefix, batch.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import orjson

from kafold import logs
from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig, PostgresConfig
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner


def main() -> int:
    spec = orjson.loads(sys.argv[1])
    logs.configure("warning", "json")
    kafka = KafkaConfig(bootstrap_servers=spec["bootstrap"], session_timeout_ms=spec.get("session_ms", 6000),
                        rebalance_timeout_ms=spec.get("session_ms", 6000), heartbeat_interval_ms=500)
    pg = PostgresConfig(url=spec["pg_url"], schema=spec["schema"])
    settings = ConnectorConfig(name=spec["name"], connector_class=spec["class"], topics=[spec["topic"]],
                               config=spec["config"])
    connector = instantiate(settings, Path("."))
    daemon = DaemonConfig(group_prefix=spec["group_prefix"], batch_max_records=spec.get("batch", 100),
                          batch_max_wait_ms=50, shutdown_grace_s=5)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    runner = SinkRunner(connector, connector.task_configs(1)[0].with_services(kafka, pg), kafka=kafka,
                        daemon=daemon, stop=stop)
    runner.run()
    return 1 if runner.error else 0


if __name__ == "__main__":
    sys.exit(main())
