"""`kafold projection refresh NAME --subject S`: the rows forgotten subjects' events made, folded again.

After `kafold subjects forget S` a protected field of S reads as the placeholder wherever it is read again, but rows
already projected still hold the clear values. A refresh folds the projection's topics into a scratch table (the
rebuild's machinery and one intake: decrypted, so S's protected fields give the placeholder) and notes the row keys
of S's events on the way (the subject of a protect rule: the aggregate id or a payload path). It then replaces
exactly those live rows with the scratch table's — every event of those rows folded, not only S's — and leaves every
other row alone. One run takes any number of subjects in one read of the topics (the subjects whose keys a re-apply
of the erasure log deleted: restored.py).

Note on offsets and consistency
-------------------------------
The replacement is the rebuild's swap transaction (rebuild.py `_converge`) with another last step: the live table
locked (ACCESS EXCLUSIVE: the live writer's batch in flight finishes first, the next one waits), the live
checkpoints re-read under the lock and the scratch table brought up to exactly them (the tail, applied while the
live writer waits), then the noted rows upserted into the live table (and deleted where the scratch table has none),
and committed. So the rows replaced hold exactly the events below the live checkpoints, as the live rows did, and no
live write is lost or rolled back; the live connector's checkpoints, tracking and dead letters are not touched. A row
key held behind a dead letter (by the live connector or in the scratch table) is left alone and reported: its live
row lacks the held events on purpose. The scratch table and its bookkeeping (`<name>:refresh`) are dropped at the
end, whatever happened (scratch.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg import sql

from kafold import db, protect
from kafold.connectors.api import SinkRecord
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.config import VERSION_COLUMN
from kafold.connectors.projection.held_keys import DeadLetter, hold_text
from kafold.connectors.projection.mapping import Mapping, MappingError
from kafold.connectors.projection.rebuild import Plan, Progress
from kafold.connectors.projection.scratch import Scratch, ScratchPlan
from kafold.errors import ConfigError, FatalError

__all__ = ["Refresh", "RefreshPlan", "Refreshed", "protected_types"]


def protected_types(mapping: Mapping, protector: protect.Protector) -> list[str]:
    """The event types with a protect rule that the projection folds (any aggregate: its topics decide which)."""
    return sorted({t for _, t in protector.rules if mapping.handles(t)})


@dataclasses.dataclass(frozen=True)
class RefreshPlan(ScratchPlan):
    """A rebuild's Plan pointed at the refresh's scratch table and bookkeeping key."""

    @property
    def shadow(self) -> str:
        return f"{self.config.table[:44]}_kafold_refresh"

    @property
    def key(self) -> str:
        return f"{self.name}:refresh"


@dataclasses.dataclass
class Refreshed:
    """The outcome: `completed` once the rows were replaced; `rows` replaced (upserted or deleted); `held` row keys
    of the subjects left alone (held behind a dead letter)."""

    name: str
    subjects: frozenset[str]
    completed: bool = False
    events: int = 0
    keys: int = 0
    rows: int = 0
    held: int = 0


class Refresh(Scratch):
    """Runs one refresh of the rows of `subjects` (one read of the topics for all); `stop` ends it early (nothing
    replaced)."""

    kind = "refresh"
    done_event = "done"  # the swap transaction committed, with the rows replaced (`refresh.rows_replaced`)
    plan_type = RefreshPlan

    def __init__(self, plan: Plan, subjects: Iterable[str], *, batch: int = 5000,
                 on_progress: Callable[[Progress], None] | None = None, stop: threading.Event | None = None) -> None:
        protector = plan.protector  # the caller's (rebuild.plan(..., protector))
        if protector is None or not protector.rules:
            raise ConfigError([f"connectors: {plan.name!r}: no aggregate has protect rules, so no row holds a "
                               "subject's protected fields (nothing to refresh)"])
        if not protected_types(plan.mapping, protector):
            raise ConfigError([f"connectors: {plan.name!r}: none of the event types it projects has protect rules "
                               f"(protected: {', '.join(sorted({t for _, t in protector.rules}))}), so no row holds "
                               "a subject's protected fields (nothing to refresh)"])
        # One process (see Scratch): the keys of the subjects' rows are noted as the records are read (see record_of).
        super().__init__(plan, batch=batch, on_progress=on_progress, stop=stop)
        self.subjects, self.protector = frozenset(subjects), protector
        self.touched: set[tuple[Any, ...]] = set()  # row keys of the subjects' events
        self.result = Refreshed(plan.name, self.subjects)

    # The rebuild's hooks: a scratch table of its own.
    def begin(self) -> bool:
        p, c = self.plan, self.plan.config
        with db.connect(p.pgc) as conn, conn.transaction():
            exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (q.regclass_text(c.schema, c.table),))
            row = exists.fetchone()
            if not row or not row[0]:
                raise FatalError(f"projection {p.name!r}: table {c.schema}.{c.table} does not exist")
            self.drop_scratch(conn)
            conn.execute(q.create_table(c.schema, p.shadow, c.columns, c.key_columns, VERSION_COLUMN))
        return False

    def record_of(self, m: Any, dead: list[DeadLetter], topic: str, part: int, off: int) -> SinkRecord | None:
        record = super().record_of(m, dead, topic, part, off)
        if record is not None and self._of_subject(record):
            try:
                self.touched.add(self.plan.mapping.key(record.event))
            except MappingError:
                pass  # no row key: the fold dead-letters it, and it made no row
        return record

    def _of_subject(self, record: SinkRecord) -> bool:
        e = record.event
        rule = self.protector.rules.get((e.aggregate_type, e.type))
        if rule is None:
            return False
        try:
            return rule.subject_of(e.aggregate_id, e.payload) in self.subjects
        except Exception:  # a payload without the subject's path: none of the subjects' (the fold decides the rest)
            return False

    def run(self) -> Refreshed:  # type: ignore[override]
        """Fold, converge under the lock, replace the subjects' rows; the scratch table is dropped in every case."""
        with self.scratch():
            progress = super().run()
        self.result.events = progress.events
        self.result.completed = progress.phase == "swapped"
        self.result.keys = len(self.touched) + self.result.held
        return self.result

    def finish(self, conn: psycopg.Connection[Any], live_exists: bool) -> None:
        """Under the lock, with the scratch table equal to the live checkpoints: the subjects' rows replaced."""
        self.writer.close()
        self.save("swapped", conn)
        p, c = self.plan, self.plan.config
        # A key held behind a dead letter, by the live connector or by the refresh, is left alone and reported: the
        # live row deliberately lacks the held events (replacing it would apply them behind the dead letters' back,
        # and batches fold differently: a refused intermediate row may not be refused in the scratch table), and the
        # scratch row of a key the refresh held is not a fold of its events. The live holds are read under the
        # holds lock taken by the swap transaction, so no live batch changes them meanwhile.
        held = {r[0] for r in conn.execute(sql.SQL(
            "SELECT DISTINCT hold_key FROM {} WHERE connector IN (%s, %s) AND hold_key IS NOT NULL AND status IN "
            "{}").format(db.table(p.pgc, "dead_letters"), q.OPEN), (p.key, p.name)).fetchall()}
        skipped = {key for key in self.touched if hold_text(key) in held}
        self.result.held = len(skipped)
        self.touched -= skipped
        if not self.touched:
            return
        live, scratch = q.qualified(c.schema, c.table), q.qualified(c.schema, p.shadow)
        keys = list(c.key_columns)
        cols = [*c.columns, VERSION_COLUMN]
        conn.execute(sql.SQL("CREATE TEMP TABLE kafold_refresh_keys ON COMMIT DROP AS SELECT {} FROM {} LIMIT 0")
                     .format(q.ids(keys), scratch))
        with conn.cursor().copy(sql.SQL("COPY kafold_refresh_keys ({}) FROM STDIN").format(q.ids(keys))) as copy:
            for key in self.touched:
                copy.write_row(key)
        on = sql.SQL(" AND ").join(sql.SQL("t.{k} = k.{k}").format(k=sql.Identifier(k)) for k in keys)
        in_scratch = sql.SQL(" AND ").join(sql.SQL("s.{k} = t.{k}").format(k=sql.Identifier(k)) for k in keys)
        deleted = conn.execute(sql.SQL(
            "DELETE FROM {live} t USING kafold_refresh_keys k WHERE {on} AND NOT EXISTS "
            "(SELECT 1 FROM {scratch} s WHERE {in_scratch})").format(
            live=live, on=on, scratch=scratch, in_scratch=in_scratch)).rowcount
        updates = sql.SQL(", ").join(sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(col))
                                     for col in cols if col not in keys)
        on_s = sql.SQL(" AND ").join(sql.SQL("s.{k} = k.{k}").format(k=sql.Identifier(k)) for k in keys)
        upserted = conn.execute(sql.SQL(
            "INSERT INTO {live} ({cols}) SELECT {scols} FROM {scratch} s JOIN kafold_refresh_keys k ON {on_s} "
            "ON CONFLICT ({keys}) DO UPDATE SET {updates}").format(
            live=live, cols=q.ids(cols), scols=sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(col))
                                                                  for col in cols),
            scratch=scratch, on_s=on_s, keys=q.ids(keys), updates=updates)).rowcount
        self.result.rows = deleted + upserted
        self.log.info("refresh.rows_replaced", subject_keys=len(self.touched), upserted=upserted, deleted=deleted)
