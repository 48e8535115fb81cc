"""The built-in `log` sink: one line per partition per batch (offsets and event types, never payloads)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kafold import logs
from kafold.connectors.api import Connector, SinkRecord, SinkTask, SinkTaskContext, TaskConfig, TopicPartition
from kafold.schema import setting

_LEVELS = ("debug", "info", "warning")


@dataclass(frozen=True)
class LogSinkConfig:
    level: str = setting("info", doc="Level of the per-batch lines.", choices=_LEVELS)
    sample_types: bool = setting(True, doc="Include the count of each event type in the line.")


class LogSinkTask(SinkTask):
    """Logs what it receives; keeps no state, so every offset it is offered can be committed."""

    def start(self, task_config: TaskConfig[LogSinkConfig], context: SinkTaskContext) -> None:
        self.config = task_config.config
        self.log = logs.get("kafold.connectors.log").bind(
            connector=context.connector_name, task=context.task_id)

    def put(self, records: Sequence[SinkRecord]) -> None:
        groups: dict[TopicPartition, list[SinkRecord]] = {}
        for r in records:
            groups.setdefault(r.tp, []).append(r)
        emit = getattr(self.log, self.config.level)
        for tp, group in groups.items():
            fields: dict[str, Any] = {"topic": tp.topic, "partition": tp.partition,
                                      "first_offset": group[0].offset, "last_offset": group[-1].offset,
                                      "count": len(group)}
            if self.config.sample_types:
                fields["types"] = dict(Counter(r.event.type for r in group))
            emit("log_sink.events_received", **fields)

    def open(self, partitions: Collection[TopicPartition]) -> None:
        self.log.debug("log_sink.partitions_opened", partitions=sorted(str(tp) for tp in partitions))

    def close(self, partitions: Collection[TopicPartition]) -> None:
        self.log.debug("log_sink.partitions_closed", partitions=sorted(str(tp) for tp in partitions))

    def stop(self) -> None:
        pass


class LogSinkConnector(Connector[LogSinkConfig]):
    """Proves the contract end to end: a sink that only logs batch summaries."""

    config_class = LogSinkConfig
    task_class = LogSinkTask

    def task_configs(self, max_tasks: int) -> list[TaskConfig[LogSinkConfig]]:
        return [TaskConfig(i, self.config, self.settings.dlq_topic) for i in range(max_tasks)]
