"""WholeReader: a whole-row batch read straight from its Kafka records into its plan, no Event nor SinkRecord a record.

The writer's one-statement path (whole_rows.py) needs of a batch only the last row of each key, the version of
its first event, and per partition the offsets it covers. Decoding each record into an Event and a SinkRecord, then
keying, collapsing and reading the rows back out of them cost the runner's thread about as much again as the
envelope's own parse (docs/benchmarks.md, issue 52). So the projection task offers the runner a reader
(SinkTask.batch_reader) for a batch that may go that way: each record's envelope body is checked by the envelope's
own fast-path checks (envelope.record_body, through Intake.peek: the very rules `decode` applies, the very values its
Event would hold), keyed by the mapping, and collapsed by the rule WholeRows.plan applies (whole_rows.Collapse).
Anything else (a record in doubt, of a type not made whole, a key the mapping refuses, a version going back, a record
with a consumer error) ends the reading and the runner decodes the whole batch record by record as always, which
decides each record (dead letters, skips, the careful fold). No second decoder: only the one check, the one key, the
one collapse.

WholeBatch is what `put` receives: a Sequence[SinkRecord] whose records are made (Intake.record, from the records
kept) only when something reads them one by one, which the writer does only on the careful way (a redo, held keys,
records below a stored checkpoint, a row the table refuses). Its transaction's offsets come from the batch itself
(`next_offsets`, and `below` for the fence's check of records already applied), so the note on offsets and commits
of writer.py holds unchanged: the checkpoints move in the transaction that writes the rows, from where this writer
last stored them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, overload

from kafold.connectors.api import BatchReader, SinkRecord, TopicPartition
from kafold.connectors.intake import Intake
from kafold.connectors.projection.mapping import Mapping, MappingError
from kafold.connectors.projection.whole_rows import Collapse, WholePlan
from kafold.envelope import epoch_ms
from kafold.errors import FatalError


class WholeBatch(Sequence[SinkRecord]):
    """A batch a WholeReader took: its plan, and per (topic, partition) its first offset, next offset and last event
    time; its SinkRecords made on the first read of one."""

    def __init__(self, msgs: list[Any], intake: Intake, plan: WholePlan,
                 parts: dict[tuple[str, int], list[Any]]) -> None:
        self.msgs, self.intake, self.plan, self.parts = msgs, intake, plan, parts
        self._records: list[SinkRecord] | None = None
        self._lock = threading.Lock()  # the runner's and the writer's threads may both read it (never at once today)

    def __len__(self) -> int:
        return len(self.msgs)

    @overload
    def __getitem__(self, i: int) -> SinkRecord: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[SinkRecord]: ...

    def __getitem__(self, i: int | slice) -> SinkRecord | Sequence[SinkRecord]:
        return self.decoded()[i]

    def __iter__(self) -> Iterator[SinkRecord]:
        return iter(self.decoded())

    @property
    def opened(self) -> bool:
        """Whether its records were made (something read them one by one)."""
        return self._records is not None

    def decoded(self) -> list[SinkRecord]:
        """The batch's SinkRecords, as the runner's record-by-record decode makes them (Intake.record)."""
        with self._lock:
            if self._records is None:
                record, out = self.intake.record, []
                for m in self.msgs:
                    r = record(m, m.topic(), m.partition(), m.offset())
                    if r is None:  # Intake.peek took it: the intake cannot skip it now
                        raise FatalError(f"a record the whole-row reader took is skipped by its intake "
                                         f"({m.topic()}[{m.partition()}]@{m.offset()})")
                    out.append(r)
                self._records = out
            return self._records

    def next_offsets(self) -> dict[TopicPartition, int]:
        """The next offset of every partition the batch covers (fold.next_offsets of its records)."""
        return {TopicPartition(*tp): part[1] for tp, part in self.parts.items()}

    def below(self, floor: dict[tuple[str, int], int]) -> bool:
        """Whether a record of the batch is below its partition's offset in `floor` (a stored checkpoint)."""
        return any(part[0] < floor.get(tp, -1) for tp, part in self.parts.items())


class WholeReader(BatchReader):
    """Takes a batch's records for the one-statement path (module note)."""

    def __init__(self, mapping: Mapping, intake: Intake) -> None:
        self.intake, self.key, self.collapse = intake, mapping.key, Collapse(mapping)
        self.msgs: list[Any] = []
        # per (topic, partition): [first offset, next offset, last event's time]; records come in runs per partition
        self.parts: dict[tuple[str, int], list[Any]] = {}
        self.run: list[Any] = [None, None, None]
        self.run_tp: tuple[str, int] | None = None

    def take(self, m: Any, topic: str, partition: int, offset: int) -> bool:
        body = self.intake.peek(m)
        if body is None:
            return False
        try:
            if not self.collapse.add(body, self.key(body), topic, partition):
                return False
        except (MappingError, TypeError):  # TypeError: a key value that is no dict key; the usual way decides
            return False
        self.msgs.append(m)
        run = self.run
        if self.run_tp is None or self.run_tp != (topic, partition):
            tp = self.run_tp = (topic, partition)
            run = self.run = self.parts.setdefault(tp, [offset, offset + 1, None])
        run[1], run[2] = offset + 1, body.occurred_at
        return True

    def records(self) -> WholeBatch:
        return WholeBatch(self.msgs, self.intake, self.collapse.plan(), self.parts)

    def event_times(self) -> dict[TopicPartition, int]:
        return {TopicPartition(*tp): epoch_ms(part[2]) for tp, part in self.parts.items()}
