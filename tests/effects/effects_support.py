"""Helpers for the effect tests: an effect connector under the real SinkRunner in a thread, a daemon config."""

from __future__ import annotations

import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig, PostgresConfig
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner
from tests.support import ROOT, kafka_toml


@dataclass
class EffectRun:
    runner: SinkRunner
    stop: threading.Event
    thread: threading.Thread
    extra: dict[str, Any] = field(default_factory=dict)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)
        # A helper module: pytest does not rewrite its asserts, so the message says where the runner is stuck
        # (seen once in CI after a lost-partitions test; not reproduced since).
        assert not self.thread.is_alive(), f"the runner did not stop within 30 s:\n{_stacks()}"


def _stacks() -> str:
    """Every thread's stack, named, as a failed stop's message."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in sys._current_frames().items())


def start_effects(kafka: KafkaConfig, pg: PostgresConfig, name: str, topic: str, cls: str, config: dict[str, Any],
                  *, batch: int = 50) -> EffectRun:
    """Run an effect connector under the real SinkRunner in a thread."""
    settings = ConnectorConfig(name=name, connector_class=cls, topics=[topic], config=config)
    connector = instantiate(settings, Path("."))
    daemon = DaemonConfig(group_prefix="kt", batch_max_records=batch, batch_max_wait_ms=50, shutdown_grace_s=5)
    stop = threading.Event()
    runner = SinkRunner(connector, connector.task_configs(1)[0].with_services(kafka, pg), kafka=kafka,
                        daemon=daemon, stop=stop)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    return EffectRun(runner, stop, thread)


def daemon_config(path: Path, kafka: KafkaConfig, pg_url: str, schema: str, group_prefix: str, topic: str,
                  kind: str, effect_toml: str, *, port: int = 0, migrate: bool = True,
                  task_processes: bool = False) -> Path:
    """A kafold.toml with one effect connector `only` (config = `effect_toml`, an inline table)."""
    path.write_text(f"""
{kafka_toml(kafka)}
[postgres]
url = "{pg_url}"
schema = "{schema}"
migrate_on_start = {str(migrate).lower()}

[daemon]
group_prefix = "{group_prefix}"
http_port = {port}
shutdown_grace_s = 4.0
batch_max_wait_ms = 100
python_path = ["{ROOT}"]
task_processes = {str(task_processes).lower()}

[[connectors]]
name = "only"
class = "{kind}"
topics = ["{topic}"]
config = {effect_toml}
""")
    return path
