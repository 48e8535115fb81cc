"""Prometheus gauges of projections read from PostgreSQL: rebuilds (`kafold projection rebuild` runs apart; its
progress is in PostgreSQL) and row keys held back behind a dead letter."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kafold import logs
from kafold.config import PostgresConfig
from kafold.connectors.projection import rebuild as rb
from kafold.connectors.projection.holds import held_keys
from kafold.connectors.projection.rebuild import ACTIVE
from kafold.daemon.tasks import ConnectorGroup

log = logs.get(__name__)

CACHE_S = 10.0  # a scrape reads PostgreSQL at most this often


Read = tuple[str, tuple[str, int, int] | None, int]  # connector, rebuild progress, held keys


class RebuildCollector(Collector):
    """Per postgres-projection connector: whether a rebuild is under way, offsets covered and still behind, and
    the row keys held back behind a dead letter."""

    def __init__(self, groups: Callable[[], list[ConnectorGroup]]) -> None:
        self.groups = groups
        self._cached: tuple[float, list[Read]] = (float("-inf"), [])

    def describe(self) -> list[Any]:
        return []  # dynamic: collected on each scrape

    def _read(self) -> list[Read]:
        at, rows = self._cached
        if time.monotonic() - at < CACHE_S:
            return rows

        rows = []
        for group in self.groups():
            if group.connector.settings.connector_class != "postgres-projection" or not group.slots:
                continue
            pgc = group.slots[0].task_config.get("postgres")
            if not isinstance(pgc, PostgresConfig):
                continue
            try:
                rows.append((group.name, rb.progress(pgc, group.name), held_keys(pgc, group.name).get(group.name, 0)))
            except Exception as e:  # PostgreSQL away: the scrape still answers, without these gauges
                log.debug("rebuild progress not readable", connector=group.name, error=str(e))
        self._cached = (time.monotonic(), rows)
        return rows

    def collect(self) -> Iterator[Any]:
        active = GaugeMetricFamily("kafold_rebuild_active", "1 while a blue-green rebuild of the projection is "
                                   "copying or catching up.", labels=("connector",))
        covered = GaugeMetricFamily("kafold_rebuild_offsets_covered", "Offsets the rebuild's shadow table "
                                    "covers.", labels=("connector",))
        behind = GaugeMetricFamily("kafold_rebuild_offsets_behind", "Offsets the shadow table is behind the live "
                                   "connector (0 once swapped).", labels=("connector",))
        held = GaugeMetricFamily("kafold_projection_held_keys", "Row keys whose events wait behind a dead letter "
                                 "(kafold dlq replay or discard releases them).", labels=("connector",))

        for name, got, holding in self._read():
            phase, done, lag = got if got is not None else ("never", 0, 0)
            active.add_metric([name], 1.0 if phase in ACTIVE else 0.0)
            covered.add_metric([name], float(done))
            behind.add_metric([name], float(lag))
            held.add_metric([name], float(holding))
        yield from (active, covered, behind, held)
