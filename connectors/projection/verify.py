"""`kafold projection verify`: fold a projection's topics into a scratch table up to the live checkpoints and
compare it with the live table, row by row.

Note on offsets and consistency
-------------------------------
One REPEATABLE READ transaction reads the live connector's checkpoints and copies the live table into an unlogged
scratch table: both from one snapshot, and every live write stores its rows with its checkpoints in one
transaction (writer.py), so the copy holds exactly the events below those checkpoints, whatever the live connector
commits meanwhile. The fold is the rebuild's catch-up (rebuild.py: its consumer loop, shadow writer, intake and
holds) into a second scratch table under its own checkpoint key and tracking namespace (`<name>:verify`), with its
targets fixed at the checkpoints read instead of re-read: partition by partition it applies exactly the offsets
below them, never past. It is never swapped: the two tables are compared in SQL (a full outer join on the
projection's key, IS DISTINCT FROM per column) and both are dropped at the end with the fold's bookkeeping,
whatever happened (scratch.py). Nothing is committed to Kafka; the live table and its bookkeeping are only read.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from kafold import db
from kafold.connectors.api import TopicPartition
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.config import VERSION_COLUMN
from kafold.connectors.projection.rebuild import Plan, Progress, source_partitions
from kafold.connectors.projection.rebuild_state import offsets
from kafold.connectors.projection.scratch import Scratch, ScratchPlan
from kafold.errors import FatalError
from kafold.interpreter import tune_interpreter

__all__ = ["Difference", "Report", "Verify", "VerifyPlan"]


@dataclass(frozen=True)
class VerifyPlan(ScratchPlan):
    """A rebuild's Plan pointed at the verify's scratch tables and bookkeeping key."""

    @property
    def shadow(self) -> str:
        return f"{self.config.table[:44]}_kafold_expected"

    @property
    def copy(self) -> str:
        """The live table as of the snapshot."""
        return f"{self.config.table[:44]}_kafold_live_copy"

    @property
    def key(self) -> str:
        return f"{self.name}:verify"

    @property
    def tables(self) -> tuple[str, ...]:
        return (self.shadow, self.copy)


@dataclass(frozen=True)
class Difference:
    """A row that differs: `changed` (one per column: the live and the expected value, as text), `missing` (no live
    row; `expected` is the row as JSON) or `extra` (no expected row; `live` is the row as JSON)."""

    kind: str
    key: dict[str, str]
    column: str | None = None
    live: str | None = None
    expected: str | None = None


@dataclass
class Report:
    """The outcome: clean when `completed` and no row differs."""

    name: str
    table: str
    checkpoints: dict[TopicPartition, int]
    completed: bool = False
    events: int = 0
    live_rows: int = 0
    expected_rows: int = 0
    rows_differing: int = 0
    differences: list[Difference] = field(default_factory=list)  # at most `limit` rows' worth

    @property
    def clean(self) -> bool:
        return self.completed and self.rows_differing == 0

    def as_json(self) -> dict[str, Any]:
        return {"projection": self.name, "table": self.table, "clean": self.clean, "completed": self.completed,
                "checkpoints": [{"topic": tp.topic, "partition": tp.partition, "next_offset": off}
                                for tp, off in sorted(self.checkpoints.items())],
                "events": self.events, "live_rows": self.live_rows, "expected_rows": self.expected_rows,
                "rows_differing": self.rows_differing,
                "differences": [dataclasses.asdict(d) for d in self.differences]}


class Verify(Scratch):
    """Runs one verify: snapshot, fold up to it, compare, drop; `stop` ends it early (nothing compared)."""

    kind = "verify"
    plan_type = VerifyPlan

    def __init__(self, plan: Plan, *, batch: int = 5000, limit: int = 1000,
                 on_progress: Callable[[Progress], None] | None = None, stop: threading.Event | None = None) -> None:
        super().__init__(plan, batch=batch, on_progress=on_progress, stop=stop)
        self.limit = limit
        self.fixed: dict[TopicPartition, int] = {}  # the live checkpoints of the snapshot: the targets
        self.columns: list[str] = []  # compared: the configured ones and the version column, as the live table has

    # The rebuild's hooks: fixed targets, scratch tables of its own.
    def _targets(self) -> dict[TopicPartition, int]:
        self.behind = self.count_behind(self.fixed)
        return dict(self.fixed)

    def begin(self) -> bool:
        """The scratch tables afresh, and the snapshot: the live checkpoints and the live rows, in one snapshot."""
        p, c = self.plan, self.plan.config
        assert isinstance(p, VerifyPlan)
        live = q.qualified(c.schema, c.table)
        with db.connect(p.pgc) as conn, conn.transaction():
            found = {r[0] for r in conn.execute(q.CATALOG_COLUMNS, (q.regclass_text(c.schema, c.table),))}
            if not found:
                raise FatalError(f"projection {p.name!r}: table {c.schema}.{c.table} does not exist")
            self.columns = [col for col in (*c.columns, VERSION_COLUMN) if col in found]
            self.drop_scratch(conn)
            # The live table's shape with its CHECK and NOT NULL constraints and unique indexes: the fold refuses
            # (dead-letters, holds) what the live writer refused, so a user's own rule is no difference.
            conn.execute(sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                                 "INCLUDING INDEXES)").format(q.qualified(c.schema, p.shadow), live))
        with db.connect(p.pgc, autocommit=False) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            with conn.transaction():
                self.fixed = self.ours(offsets(p.pgc, p.name, conn))  # the snapshot starts here
                conn.execute(sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {}").format(
                    q.qualified(c.schema, p.copy), q.ids(self.columns), live))
        return False

    def run(self) -> Report:  # type: ignore[override]
        """Snapshot, fold up to it, compare; the scratch tables and bookkeeping are dropped in every case."""
        p = self.plan
        tune_interpreter()
        with self.scratch():
            self.begin()
            report = Report(p.name, f"{p.config.schema}.{p.config.table}", dict(self.fixed))
            self.log.info("verify.started", checkpoints={str(tp): off for tp, off in sorted(self.fixed.items())})
            consumer = self.new_consumer()
            try:
                for tp in source_partitions(consumer, self.plan):
                    self.positions.setdefault(tp, 0)
                self.report_progress(0, sum(self.fixed.values()))
                self.catch_up(consumer)
            finally:
                self.close_consumer(consumer)
            report.events = self.events
            if not self.stop.is_set() and self.caught_up(self.fixed):
                self.phase = "comparing"
                self.report_progress(0, sum(self.fixed.values()))
                self._compare(report)
                report.completed = True
            self.log.info("verify.done", completed=report.completed, rows_differing=report.rows_differing,
                          live_rows=report.live_rows, expected_rows=report.expected_rows, events=report.events)
            return report

    def _compare(self, report: Report) -> None:
        """The full outer join of the live copy and the expected table on the key; differing rows only."""
        p, c = self.plan, self.plan.config
        assert isinstance(p, VerifyPlan)
        keys, values = list(c.key_columns), [col for col in self.columns if col not in c.key_columns]
        live, expected = q.qualified(c.schema, p.copy), q.qualified(c.schema, p.shadow)

        def col(alias: str, name: str) -> sql.Composed:
            return sql.SQL("{}.{}").format(sql.Identifier(alias), sql.Identifier(name))

        on = sql.SQL(" AND ").join(sql.SQL("{} = {}").format(col("l", k), col("e", k)) for k in keys)
        distinct = [sql.SQL("{} IS DISTINCT FROM {}").format(col("l", v), col("e", v)) for v in values]
        select = [*(sql.SQL("COALESCE({}, {})::text").format(col("l", k), col("e", k)) for k in keys),
                  sql.SQL("{} IS NULL").format(col("l", keys[0])), sql.SQL("{} IS NULL").format(col("e", keys[0])),
                  sql.SQL("row_to_json(l)::text"), sql.SQL("row_to_json(e)::text"),
                  *(part for i, v in enumerate(values) for part in (
                      distinct[i], sql.SQL("{}::text").format(col("l", v)), sql.SQL("{}::text").format(col("e", v))))]
        where = sql.SQL(" OR ").join([sql.SQL("{} IS NULL").format(col("l", keys[0])),
                                      sql.SQL("{} IS NULL").format(col("e", keys[0])), *distinct])
        query = sql.SQL("SELECT {} FROM {} l FULL OUTER JOIN {} e ON {} WHERE {} ORDER BY {}").format(
            sql.SQL(", ").join(select), live, expected, on, where,
            sql.SQL(", ").join(sql.SQL("{}").format(sql.Literal(i + 1)) for i in range(len(keys))))
        count = sql.SQL("SELECT (SELECT count(*) FROM {}), (SELECT count(*) FROM {})").format(live, expected)
        n = len(keys)
        with db.connect(p.pgc) as conn:
            counted = conn.execute(count).fetchone()
            assert counted is not None
            report.live_rows, report.expected_rows = int(counted[0]), int(counted[1])
            with conn.transaction(), conn.cursor(name="kafold_verify") as cur:  # server-side: streamed
                cur.execute(query)
                for row in cur:
                    report.rows_differing += 1
                    if report.rows_differing > self.limit:
                        continue
                    key = dict(zip(keys, row[:n], strict=True))
                    no_live, no_expected, live_row, expected_row = row[n:n + 4]
                    if no_live:
                        report.differences.append(Difference("missing", key, expected=expected_row))
                    elif no_expected:
                        report.differences.append(Difference("extra", key, live=live_row))
                    else:
                        rest = row[n + 4:]
                        report.differences += [Difference("changed", key, v, rest[3 * i + 1], rest[3 * i + 2])
                                               for i, v in enumerate(values) if rest[3 * i]]
