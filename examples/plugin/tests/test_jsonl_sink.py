"""The example sink passes kafold's connector contract, and writes each event once across a re-delivery."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from kafold.connectors.api import TopicPartition
from kafold.testing import LocalContext, SinkTaskContract


class TestJsonlSinkContract(SinkTaskContract):
    connector_ref = "jsonl"  # found through the entry point the package installs
    config = {"directory": tempfile.mkdtemp(prefix="jsonl-sink-")}


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_redelivered_batch_is_written_once_and_open_resumes_after_the_file() -> None:
    contract = TestJsonlSinkContract()
    directory = Path(tempfile.mkdtemp(prefix="jsonl-sink-"))
    contract.config = {"directory": str(directory)}
    tp = TopicPartition("orders", 2)
    task, ctx = contract.started_task()
    task.open([tp])
    assert ctx.seeks == {tp: 0}
    task.put(contract.records(tp, 0, 5))
    task.put(contract.records(tp, 3, 4))  # offsets 3..6: 3 and 4 again, as after a crash before the commit
    task.pre_commit({tp: 7})
    task.stop()
    assert [line["offset"] for line in lines(directory / "orders-2.jsonl")] == list(range(7))

    again, ctx = contract.started_task(LocalContext())
    again.open([tp])
    assert ctx.seeks == {tp: 7}  # the file, not the group's offset, says where to go on
    again.stop()
