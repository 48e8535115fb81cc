"""What the daemon's views and status read of their host: `Host`, the seam between daemon/host.py and its parts.

The views (http.py, connect_api.py, wait_view.py, status_page.py) and the status report are typed by this protocol,
not by `DaemonHost`: the host imports them to serve them, and they import nothing of the host, so the daemon's
modules import one another one way only. The objects one daemon keeps for its reads (the state router, the
consistency watches, the history readers) are the host's own, made with it and handed to it as values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kafold.config import KafoldConfig
from kafold.daemon.aggregates.history import Histories
from kafold.daemon.aggregates.routing import StateRouter
from kafold.daemon.aggregates.trust import InstanceKey
from kafold.daemon.metrics import DaemonMetrics
from kafold.daemon.rates import Rates
from kafold.daemon.tasks import AggregateSlot, ConnectorGroup, TaskSlot
from kafold.daemon.visibility import Watches
from kafold.protect import Protector


class Host(Protocol):
    """One daemon as its views see it (kafold.daemon.host.DaemonHost)."""

    cfg: KafoldConfig
    base: Path
    worker_id: str
    token: str | None
    instance_key: InstanceKey | None
    restart_timeout: float
    metrics: DaemonMetrics
    rates: Rates
    protector: Protector | None
    groups: list[ConnectorGroup]
    aggregates: dict[str, AggregateSlot]
    router: StateRouter
    watches: Watches
    histories: Histories

    @property
    def slots(self) -> list[TaskSlot]: ...

    @property
    def failed(self) -> bool: ...

    def group(self, name: str) -> ConnectorGroup | None: ...

    def ready_report(self) -> tuple[bool, dict[str, Any]]: ...

    def reload(self) -> dict[str, list[str]]: ...

    async def group_offsets(self, group: ConnectorGroup) -> dict[tuple[str, int], int]: ...

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...
