"""The `postgres-projection` connector: validates its settings, hands each task the same projection and exports
its metrics (rebuild progress and held keys, read from PostgreSQL)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from kafold import logs
from kafold.config import ConnectorConfig
from kafold.connectors.api import Connector, Metric, Sample, TaskConfig, TaskView
from kafold.connectors.projection import rebuild_state
from kafold.connectors.projection.config import ProjectionConfig
from kafold.connectors.projection.holds import held_keys
from kafold.connectors.projection.task import ProjectionSinkTask

log = logs.get(__name__)

CACHE_S = 10.0  # a scrape reads PostgreSQL at most this often
# rebuild_state's phases (its check constraint) and "never" for a projection never rebuilt
REBUILD_PHASES = ("never", "copying", "catching-up", "swapped", "abandoned")


class ProjectionConnector(Connector[ProjectionConfig]):
    """Keeps a PostgreSQL table equal to a fold of the source events (exactly once, see writer.py)."""

    config_class = ProjectionConfig
    task_class = ProjectionSinkTask
    uses_postgres = True
    # `kafold projection rebuild` runs apart from the daemon: its progress is read from PostgreSQL, as the held keys.
    metrics = (
        Metric("kafold_rebuild_active", "1 while a blue-green rebuild of the projection is copying or catching up."),
        Metric("kafold_rebuild_phase", "1 for the phase of the projection's last rebuild: never, copying, catching-up, "
               "swapped (the rebuilt table is the live one) or abandoned.", ("connector", "phase")),
        Metric("kafold_rebuild_offsets_covered", "Offsets the rebuild's shadow table covers."),
        Metric("kafold_rebuild_offsets_behind", "Offsets the shadow table is behind the live connector (0 once "
               "swapped)."),
        Metric("kafold_projection_held_keys", "Row keys whose events wait behind a dead letter (kafold dlq replay "
               "or discard releases them)."),
    )

    def __init__(self, settings: ConnectorConfig, config: ProjectionConfig) -> None:
        super().__init__(settings, config)
        self._sampled: tuple[float, list[Sample]] = (float("-inf"), [])

    def task_configs(self, max_tasks: int) -> list[TaskConfig[ProjectionConfig]]:
        # Tasks share the consumer group and split the partitions; each row key lives in one partition.
        return [TaskConfig(i, self.config, self.settings.dlq_topic) for i in range(max_tasks)]

    def sample_metrics(self, tasks: Sequence[TaskView]) -> Iterable[Sample]:
        at, samples = self._sampled
        if time.monotonic() - at < CACHE_S:
            return samples
        pgc = next((t.config.postgres for t in tasks if t.config.postgres is not None), None)
        if pgc is None:
            return []
        try:
            progress = rebuild_state.progress(pgc, self.name)
            holding = held_keys(pgc, self.name).get(self.name, 0)
        except Exception as e:  # PostgreSQL away: the scrape still answers, without these gauges
            log.debug("projection.rebuild_progress_unread", connector=self.name, error=str(e))
            return []
        phase, covered, behind = progress if progress is not None else ("never", 0, 0)
        labels = (self.name,)
        samples = [("kafold_rebuild_active", labels, 1.0 if phase in rebuild_state.ACTIVE else 0.0),
                   ("kafold_rebuild_offsets_covered", labels, float(covered)),
                   ("kafold_rebuild_offsets_behind", labels, float(behind)),
                   ("kafold_projection_held_keys", labels, float(holding))]
        samples += [("kafold_rebuild_phase", (self.name, p), 1.0 if p == phase else 0.0) for p in REBUILD_PHASES]
        self._sampled = (time.monotonic(), samples)
        return samples
