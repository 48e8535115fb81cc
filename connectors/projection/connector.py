"""The `postgres-projection` connector: validates its settings and hands each task the same projection."""

from __future__ import annotations

from typing import Any

from kafold.connectors.api import Connector
from kafold.connectors.projection.config import ProjectionConfig
from kafold.connectors.projection.task import ProjectionSinkTask


class ProjectionConnector(Connector[ProjectionConfig]):
    """Keeps a PostgreSQL table equal to a fold of the source events (exactly once, see writer.py)."""

    config_class = ProjectionConfig
    task_class = ProjectionSinkTask
    uses_postgres = True

    def task_configs(self, max_tasks: int) -> list[dict[str, Any]]:
        # Tasks share the consumer group and split the partitions; each row key lives in one partition.
        return [{"task_id": i, "config": self.config, "dlq_topic": self.settings.dlq_topic}
                for i in range(max_tasks)]
