"""A configurable test sink connector (a daemon subprocess imports it: it needs nothing but kafold)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kafold.connectors.api import Connector, SinkRecord, SinkTask, SinkTaskContext, TaskConfig
from kafold.errors import FatalError
from kafold.schema import setting

GATES: dict[str, threading.Semaphore] = {}  # in-process tests hand out put permits one batch at a time
RECEIVED: dict[str, list[SinkRecord]] = {}


@dataclass(frozen=True)
class PluginConfig:
    gate: str = setting("", doc="Name of a semaphore in GATES: put takes one permit per batch.")
    record_file: str = setting("", doc="Append `partition offset` of every put record to this file.")
    fail: bool = setting(False, doc="put raises FatalError.")
    delay_s: float = setting(0.0, doc="put takes this long (so a stop request finds a batch in flight).")


class PluginTask(SinkTask):
    def start(self, task_config: TaskConfig[PluginConfig], context: SinkTaskContext) -> None:
        self.config = task_config.config
        self.name = context.connector_name

    def put(self, records: Sequence[SinkRecord]) -> None:
        if self.config.fail:
            raise FatalError("this test task always fails")
        if self.config.gate and records:
            while not GATES[self.config.gate].acquire(timeout=0.1):
                pass
        if self.config.delay_s:
            time.sleep(self.config.delay_s)
        RECEIVED.setdefault(self.name, []).extend(records)
        if self.config.record_file:
            with open(self.config.record_file, "a") as f:
                f.writelines(f"{r.partition} {r.offset}\n" for r in records)

    def stop(self) -> None:
        pass


class PluginConnector(Connector[PluginConfig]):
    config_class = PluginConfig
    task_class = PluginTask
