"""An example kafold sink connector: each partition's events appended to a JSON-lines file, exactly once.

Note on offsets and commits
---------------------------
The file is the truth. Every line carries the Kafka offset of its event, and `open` seeks each partition to the
offset after its file's last line, whatever the consumer group committed: a crash between a write and Kafka's
commit re-reads records the file already has, and `put` skips every record at or below the file's last offset, so
each event is written once. `pre_commit` fsyncs and then lets the runner commit the same offsets to Kafka, only so
that consumer lag shows in the usual tools.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kafold.connectors.api import Connector, Offsets, SinkRecord, SinkTask, SinkTaskContext, TaskConfig, TopicPartition
from kafold.envelope import encode
from kafold.errors import RecordError, RetriableError
from kafold.schema import setting


@dataclass(frozen=True)
class JsonlSinkConfig:
    directory: str = setting(doc="Folder of the files, one `<topic>-<partition>.jsonl` per partition.")
    max_line_bytes: int = setting(65536, doc="A longer line is dead-lettered instead of written.", minimum=64)


class JsonlSinkTask(SinkTask):
    """Appends events to one file per assigned partition; offsets live in the files (see the module note)."""

    def start(self, task_config: TaskConfig[JsonlSinkConfig], context: SinkTaskContext) -> None:
        self.config = task_config.config
        self.context = context
        self.files: dict[TopicPartition, IO[str]] = {}
        self.last: dict[TopicPartition, int] = {}  # offset of each file's last line (-1: empty)
        Path(self.config.directory).mkdir(parents=True, exist_ok=True)

    def path(self, tp: TopicPartition) -> Path:
        return Path(self.config.directory) / f"{tp.topic}-{tp.partition}.jsonl"

    def open(self, partitions: Collection[TopicPartition]) -> None:
        for tp in partitions:
            self.last[tp] = last_offset(self.path(tp))
            self.files[tp] = self.path(tp).open("a", encoding="utf-8")
            self.context.offset(tp, self.last[tp] + 1)  # resume after the file's last line

    def put(self, records: Sequence[SinkRecord]) -> None:
        for r in records:
            tp = r.tp
            if tp not in self.files:
                self.open([tp])
            if r.offset <= self.last[tp]:
                continue  # already in the file: at-least-once delivery made idempotent
            line = json.dumps({"offset": r.offset, "key": r.key, "event": json.loads(encode(r.event)[1])},
                              separators=(",", ":"))
            if len(line.encode()) > self.config.max_line_bytes:
                # Dead-lettered by the runner; the rest of the batch is offered again (and skipped up to here).
                raise RecordError(f"event line of {len(line.encode())} bytes exceeds max_line_bytes", raw=r,
                                  reason="too-large")
            try:
                self.files[tp].write(line + "\n")
            except OSError as e:  # a full or read-only disk: back off and get the batch again
                raise RetriableError(f"writing {self.path(tp)}: {e}") from e
            self.last[tp] = r.offset

    def pre_commit(self, offsets: Offsets) -> Offsets:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        return {tp: off for tp, off in offsets.items() if tp in self.files}

    def close(self, partitions: Collection[TopicPartition]) -> None:
        for tp in partitions:
            f = self.files.pop(tp, None)
            if f is not None:
                f.close()
            self.last.pop(tp, None)

    def stop(self) -> None:
        self.close(list(self.files))


def last_offset(path: Path) -> int:
    """The offset of the file's last complete line; -1 for a missing or empty file (a torn last line is cut off)."""
    if not path.exists():
        return -1
    data = path.read_bytes()
    end = data.rfind(b"\n")
    if end + 1 != len(data):  # a crash mid-line: drop the torn tail, it is read again from Kafka
        with path.open("r+b") as f:
            f.truncate(end + 1)
    if end < 0:
        return -1
    start = data.rfind(b"\n", 0, end) + 1
    return int(json.loads(data[start:end])["offset"])


class JsonlSinkConnector(Connector[JsonlSinkConfig]):
    """Events into JSON-lines files, one per partition, each event once."""

    config_class = JsonlSinkConfig
    task_class = JsonlSinkTask

    def task_configs(self, max_tasks: int) -> list[TaskConfig[JsonlSinkConfig]]:
        return [TaskConfig(i, self.config, self.settings.dlq_topic) for i in range(max_tasks)]
