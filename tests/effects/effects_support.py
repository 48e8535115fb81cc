"""Helpers for the effect tests: run an effect connector under the real SinkRunner in a thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig, PostgresConfig
from kafold.connectors.effects.task import with_services
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner


@dataclass
class EffectRun:
    runner: SinkRunner
    stop: threading.Event
    thread: threading.Thread
    extra: dict[str, Any] = field(default_factory=dict)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def start_effects(kafka: KafkaConfig, pg: PostgresConfig, name: str, topic: str, cls: str, config: dict[str, Any],
                  *, batch: int = 50) -> EffectRun:
    """Run an effect connector under the real SinkRunner in a thread."""
    settings = ConnectorConfig(name=name, connector_class=cls, topics=[topic], config=config)
    connector = instantiate(settings, Path("."))
    daemon = DaemonConfig(group_prefix="kt", batch_max_records=batch, batch_max_wait_ms=50, shutdown_grace_s=5)
    stop = threading.Event()
    runner = SinkRunner(connector, with_services(connector.task_configs(1)[0], kafka, pg), kafka=kafka,
                        daemon=daemon, stop=stop)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    return EffectRun(runner, stop, thread)
