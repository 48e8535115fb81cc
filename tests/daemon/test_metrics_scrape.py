"""A running daemon's /metrics on a real broker, scraped as Prometheus does (with the API token): the process and
platform collectors, kafold_build_info, and sink counters that count what their names say."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kafold
from kafold.config import KafkaConfig
from kafold.connectors.api import SinkRecord
from kafold.envelope import encode
from kafold.testing import free_port
from tests.daemon.daemon_plugins import PluginConnector, PluginTask
from tests.daemon.daemon_support import daemon_in_process, write_config
from tests.support import committed, create_topic, make_event, produce, wait_for

IGNORED = "ThingIgnored"


class SkippingTask(PluginTask):
    """The test plugin's task, not interested in IGNORED events (they are skipped by rule)."""

    def handles(self, event_type: str) -> bool:
        return event_type != IGNORED

    def put(self, records: Sequence[SinkRecord]) -> None:
        assert all(r.event.type != IGNORED for r in records)
        super().put(records)


class SkippingConnector(PluginConnector):
    task_class = SkippingTask


@pytest.mark.parametrize("in_processes", [False, True], ids=["threads", "task-processes"])
def test_scraped_metrics_show_the_process_the_build_and_each_record_counted_once(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str, in_processes: bool) -> None:
    """6 events put, 3 of a type the task skips and 2 malformed records: processed 6, skipped 3, dead letters 2 (also
    counted by the daemon when the task runs in a child process, whose CPU and memory then show per task)."""
    topic, dlq = f"{unique}.events", f"{unique}.dlq"
    create_topic(kafka_config, topic)
    create_topic(kafka_config, dlq)
    items: list[tuple[int, bytes | None, bytes | None, object]] = []
    for v in range(1, 10):
        event = make_event("a", v)
        if v % 3 == 0:
            event = event.__class__.new(IGNORED, event.aggregate_type, event.aggregate_id, v, {"n": v})
        items.append((0, *encode(event)))
    items += [(0, b"a", b"{broken", None), (0, b"a", b"not json at all", None)]
    produce(kafka_config, topic, items)
    token = f"t0ken-{unique}"
    secret = tmp_path / "token"
    secret.write_text(token)
    secret.chmod(0o600)
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port(),
                        connector="tests.daemon.test_metrics_scrape:SkippingConnector",
                        daemon_extra=f'api_token_file = "{secret}"\ntask_processes = {str(in_processes).lower()}')
    path.write_text(path.read_text() + f'dead_letter_topic = "{dlq}"\n')  # still in the [[connectors]] table
    with daemon_in_process(path, token=token) as d:
        wait_for(lambda: committed(kafka_config, f"{unique}.sink", topic, 1) == {0: len(items)}, "the commit")
        assert d.get("/metrics", token=None)[0] == 401
        status, text = d.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert families["process_cpu_seconds"].samples[0].value > 0
    assert families["process_resident_memory_bytes"].samples[0].value > 10 * 2**20
    assert families["python_info"].samples and "python_gc_collections" in families
    (build,) = families["kafold_build_info"].samples  # the text format has no info type: a gauge of 1
    assert build.value == 1 and build.labels["version"] == kafold.__version__
    task = (("connector", "sink"), ("task", "0"))
    assert samples[("kafold_events_processed_total", task)] == 6
    assert samples[("kafold_events_skipped_total", task)] == 3
    assert samples[("kafold_dead_letters_total", task)] == 2
    child = ("kafold_task_process_resident_memory_bytes", task)
    if in_processes:
        assert samples[child] > 10 * 2**20 and samples[("kafold_task_process_cpu_seconds_total", task)] > 0
    else:
        assert child not in samples  # a thread of the daemon: its process is the daemon's (process_*)
