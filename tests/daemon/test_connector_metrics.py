"""Connectors' own metrics on the daemon's /metrics: declared on the class, sampled per scrape, one family per name."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig
from kafold.connectors.api import Metric, Sample, TaskView
from kafold.connectors.log import LogSinkConnector
from kafold.connectors.registry import instantiate
from kafold.daemon.metrics import DaemonMetrics
from kafold.daemon.tasks import ConnectorGroup, TaskSlot


class CountingConnector(LogSinkConnector):
    """A log sink that exports how many tasks it runs, and (when told to) a sample it never declared."""

    metrics = (Metric("kafold_test_tasks", "Tasks of the connector.", ("connector", "task")),
               Metric("kafold_test_scrapes", "Scrapes seen.", kind="counter"))
    scrapes = 0
    sneak = False
    fail = False

    def sample_metrics(self, tasks: Sequence[TaskView]) -> Iterable[Sample]:
        if self.fail:
            raise RuntimeError("cannot tell")
        self.scrapes += 1
        for task in tasks:
            yield "kafold_test_tasks", (self.name, str(task.task_id)), 1.0
        yield "kafold_test_scrapes", (self.name,), float(self.scrapes)
        if self.sneak:
            yield "kafold_test_undeclared", (self.name,), 1.0


def group(kafka: KafkaConfig, name: str, tasks: int) -> ConnectorGroup:
    """The connector's group as the daemon builds it (its runners are never started)."""
    settings = ConnectorConfig(name=name, connector_class=f"{__name__}:CountingConnector", topics=["t"], config={})
    connector = instantiate(settings, Path("."))
    slots = [TaskSlot(connector, cfg, kafka, DaemonConfig()) for cfg in connector.task_configs(tasks)]
    return ConnectorGroup(connector, slots)


def scrape(groups: list[ConnectorGroup]) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = generate_latest(DaemonMetrics(lambda: groups).registry).decode()
    return {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
            for f in text_string_to_metric_families(text) if f.name.startswith("kafold_test")}


def test_connectors_of_one_class_share_a_family_each_with_its_own_samples(kafka_config: KafkaConfig) -> None:
    a, b = group(kafka_config, "a", 2), group(kafka_config, "b", 1)
    seen = scrape([a, b])
    assert seen["kafold_test_tasks"] == {(("connector", "a"), ("task", "0")): 1.0,
                                         (("connector", "a"), ("task", "1")): 1.0,
                                         (("connector", "b"), ("task", "0")): 1.0}
    assert seen["kafold_test_scrapes"] == {(("connector", "a"),): 1.0, (("connector", "b"),): 1.0}
    assert scrape([a, b])["kafold_test_scrapes"][(("connector", "a"),)] == 2.0  # sampled again at every scrape


def test_an_undeclared_sample_is_dropped_and_a_failing_connector_leaves_the_others_on_the_scrape(
        kafka_config: KafkaConfig) -> None:
    sneaky, failing, fine = (group(kafka_config, name, 1) for name in ("sneaky", "failing", "fine"))
    sneaky.connector.sneak = True  # type: ignore[attr-defined]
    failing.connector.fail = True  # type: ignore[attr-defined]
    seen = scrape([sneaky, failing, fine])
    assert "kafold_test_undeclared" not in seen
    assert set(seen["kafold_test_scrapes"]) == {(("connector", "sneaky"),), (("connector", "fine"),)}


def test_the_built_in_effect_connector_samples_each_started_tasks_status() -> None:
    settings = ConnectorConfig(name="hooks", connector_class="webhook", topics=["t"],
                               config={"url": "http://127.0.0.1:1/hook", "allow_http": True})
    connector: Any = instantiate(settings, Path("."))
    status = {"endpoint": "http://127.0.0.1:1/hook", "circuit": "open", "circuit_changes": 3, "in_flight": 7,
              "fetch_paused": True, "parked_keys": 2,
              "counts": {"succeeded": 5, "failed_attempts": 4, "parked": 1, "deduplicated": 0, "released": 0}}
    samples = list(connector.sample_metrics([TaskView(0, status, {}), TaskView(1, {}, {})]))
    labels = ("hooks", "0", "http://127.0.0.1:1/hook")
    assert samples == [("kafold_effect_circuit_open", labels, 1.0), ("kafold_effect_circuit_changes", labels, 3.0),
                       ("kafold_effect_in_flight", labels, 7.0), ("kafold_effect_fetch_paused", labels, 1.0),
                       ("kafold_effect_parked_keys", labels, 2.0),
                       ("kafold_effect_events", (*labels, "succeeded"), 5.0),
                       ("kafold_effect_events", (*labels, "parked"), 1.0),
                       ("kafold_effect_events", (*labels, "deduplicated"), 0.0),
                       ("kafold_effect_events", (*labels, "released"), 0.0),
                       ("kafold_effect_failed_attempts", labels, 4.0)]  # task 1 has not started: nothing of it
    assert {m.name for m in connector.metrics} == {name for name, _, _ in samples}
