"""The built-in `log` sink passes the sink contract and logs batch summaries without payloads."""

from __future__ import annotations

from structlog.testing import capture_logs

from kafold.connectors.api import TopicPartition
from tests.support import SinkTaskContract, make_event


class TestLogSinkContract(SinkTaskContract):
    connector_ref = "log"
    config = {"level": "info", "sample_types": True}


def test_log_sink_logs_offsets_and_type_counts_but_never_payloads() -> None:
    contract = TestLogSinkContract()
    task, _ = contract.started_task()
    tp = TopicPartition("t", 3)
    records = [r.__class__(r.topic, r.partition, r.offset, r.key, make_event(r.key, 1, secret="SECRET-123"),
                           r.timestamp_ms) for r in contract.records(tp, 40, 3)]
    with capture_logs() as logs:
        task.put(records)
    assert logs == [{"event": "log_sink.events_received", "log_level": "info", "connector": "contract", "task": 0,
                     "topic": "t", "partition": 3, "first_offset": 40, "last_offset": 42, "count": 3,
                     "types": {"ThingHappened": 3}}]
    assert "SECRET-123" not in repr(logs)
