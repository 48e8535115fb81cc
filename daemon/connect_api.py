"""A Kafka Connect-compatible REST subset (same paths and JSON shapes), acting on the daemon's sink runners.

Control calls (pause, resume, restarts) are queued on the connector and applied one at a time in the order they
arrived (see `daemon.tasks.Control`): a restart answers once done (204, as in Connect; 202 with `includeTasks` or
`onlyFailed`, at once), a pause or resume answers 202 at once and applies after the calls before it.

Note on offsets: `GET /connectors/{name}/offsets` reports the connector's consumer-group committed offsets, read
from Kafka (as Connect does for sink connectors), so it shows what a restart would resume from. A connector that
keeps its offsets elsewhere (the projection keeps them in PostgreSQL and commits them to Kafka after the database
commit) shows the Kafka copy.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future
from typing import Any

from faust.web import Request, Response

from kafold import __version__
from kafold.daemon.http import HostView
from kafold.daemon.tasks import ConnectorGroup, TaskSlot


def connector_config(group: ConnectorGroup) -> dict[str, str]:
    """Connect's config map (every value a string); the connector's own keys as given in TOML."""
    s = group.connector.settings
    out = {"name": s.name, "connector.class": s.connector_class, "tasks.max": str(s.tasks_max),
           "topics": ",".join(s.topics), "errors.deadletterqueue.topic.name": s.dlq_topic,
           "errors.tolerance": "all", "kafold.on.unknown.type": s.on_unknown_type}
    for key, value in s.config.items():
        out[key] = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return out


def connector_info(group: ConnectorGroup) -> dict[str, Any]:
    return {"name": group.name, "config": connector_config(group),
            "tasks": [{"connector": group.name, "task": s.task_id} for s in group.slots], "type": "sink"}


def connector_status(group: ConnectorGroup, worker_id: str) -> dict[str, Any]:
    tasks = []
    for s in group.slots:
        task: dict[str, Any] = {"id": s.task_id, "state": s.state, "worker_id": worker_id}
        if s.runner.error is not None:
            task["trace"] = f"{type(s.runner.error).__name__}: {s.runner.error}"
        tasks.append(task)
    return {"name": group.name, "connector": {"state": group.state, "worker_id": worker_id}, "tasks": tasks,
            "type": "sink"}


def offsets_body(committed: dict[tuple[str, int], int]) -> dict[str, Any]:
    return {"offsets": [{"partition": {"kafka_topic": topic, "kafka_partition": partition},
                         "offset": {"kafka_offset": offset}}
                        for (topic, partition), offset in sorted(committed.items())]}


def _flag(request: Request, name: str) -> bool:
    return str(request.query.get(name, "false")).lower() == "true"


class _ConnectorView(HostView):
    def group(self, name: str) -> ConnectorGroup | None:
        return self.host.group(name)

    def missing(self, name: str) -> Response:
        return self.problem(404, f"Connector {name} not found")

    async def restarted(self, done: Future[bool], slots: list[TaskSlot]) -> Response:
        """204 once the queued restart of `slots` is done; 500 when a task did not stop in time."""
        try:
            ok = await asyncio.wrap_future(done)
        except Exception as e:
            return self.problem(500, f"restart failed: {type(e).__name__}: {e}")
        if not ok:
            return self.problem(500, f"tasks {[s.name for s in slots]} did not stop for the restart in time")
        return self.bytes(b"", status=204)


class Root(HostView):
    async def get(self, request: Request, **kwargs: Any) -> Response:
        return self.json({"version": __version__, "commit": "kafold", "kafka_cluster_id": None})


class Connectors(HostView):
    async def get(self, request: Request, **kwargs: Any) -> Response:
        groups = self.host.groups
        expand = request.query.getall("expand", []) if hasattr(request.query, "getall") else []
        if not expand:
            return self.json([g.name for g in groups])
        out: dict[str, Any] = {}
        for g in groups:
            entry: dict[str, Any] = {}
            if "status" in expand:
                entry["status"] = connector_status(g, self.host.worker_id)
            if "info" in expand:
                entry["info"] = connector_info(g)
            out[g.name] = entry
        return self.json(out)


class ConnectorInfo(_ConnectorView):
    async def get(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        return self.json(connector_info(g)) if g else self.missing(name)


class ConnectorConfigView(_ConnectorView):
    async def get(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        return self.json(connector_config(g)) if g else self.missing(name)


class ConnectorStatus(_ConnectorView):
    async def get(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        return self.json(connector_status(g, self.host.worker_id)) if g else self.missing(name)


class ConnectorTasks(_ConnectorView):
    async def get(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        if g is None:
            return self.missing(name)
        config = connector_config(g)
        return self.json([{"id": {"connector": g.name, "task": s.task_id},
                           "config": {**config, "task.id": str(s.task_id)}} for s in g.slots])


class Pause(_ConnectorView):
    async def put(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        if g is None:
            return self.missing(name)
        g.pause(True)
        return self.bytes(b"", status=202)


class Resume(_ConnectorView):
    async def put(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        if g is None:
            return self.missing(name)
        g.pause(False)
        return self.bytes(b"", status=202)


class Restart(_ConnectorView):
    """Without parameters (Connect: restart the connector) every task restarts, as the tasks are the connector
    here; `includeTasks` / `onlyFailed` behave as in Connect and answer 202 with the status."""

    async def post(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        if g is None:
            return self.missing(name)
        include, only_failed = _flag(request, "includeTasks"), _flag(request, "onlyFailed")
        slots = [s for s in g.slots if s.failed or not only_failed]
        done = g.restart(slots, self.host.restart_timeout)
        if include or only_failed:
            return self.json(connector_status(g, self.host.worker_id), status=202)
        return await self.restarted(done, slots)


class TaskRestart(_ConnectorView):
    async def post(self, request: Request, name: str = "", task: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        if g is None:
            return self.missing(name)
        slot = next((s for s in g.slots if str(s.task_id) == task), None)
        if slot is None:
            return self.problem(404, f"Task {name}-{task} not found")
        return await self.restarted(g.restart([slot], self.host.restart_timeout), [slot])


class Offsets(_ConnectorView):
    async def get(self, request: Request, name: str = "", **kwargs: Any) -> Response:
        g = self.group(name)
        if g is None:
            return self.missing(name)
        committed = await self.host.group_offsets(g)
        return self.json(offsets_body(committed))


ROUTES: dict[str, type[HostView]] = {
    "/": Root,
    "/connectors": Connectors,
    "/connectors/{name}": ConnectorInfo,
    "/connectors/{name}/config": ConnectorConfigView,
    "/connectors/{name}/status": ConnectorStatus,
    "/connectors/{name}/tasks": ConnectorTasks,
    "/connectors/{name}/pause": Pause,
    "/connectors/{name}/resume": Resume,
    "/connectors/{name}/restart": Restart,
    "/connectors/{name}/tasks/{task}/restart": TaskRestart,
    "/connectors/{name}/offsets": Offsets,
}
