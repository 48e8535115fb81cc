"""The lifecycle shared by the jobs that fold a projection into scratch tables of their own (verify, refresh).

Note on offsets and commits
---------------------------
A scratch job folds with the rebuild's machinery (rebuild.py) under its own checkpoint key and tracking namespace
(its plan's `key`), never the live connector's nor a rebuild's, and writes no rebuild_state (a rebuild may be in
progress). Nothing is committed to Kafka. Its scratch tables and that bookkeeping are dropped before it folds (a
killed run's leftovers) and at the end, whatever happened: a scratch job never resumes, it starts afresh.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Self

import psycopg
from psycopg import sql

from kafold import db
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.rebuild import Plan, Progress, Rebuild
from kafold.errors import FatalError

__all__ = ["Scratch", "ScratchPlan"]


@dataclasses.dataclass(frozen=True)
class ScratchPlan(Plan):
    """A rebuild's Plan pointed at a scratch job's own tables and bookkeeping key (a subclass names them)."""

    @classmethod
    def of(cls, plan: Plan) -> Self:
        return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})

    @property
    def tables(self) -> tuple[str, ...]:
        """The scratch tables, dropped before and after each run."""
        return (self.shadow,)


class Scratch(Rebuild):
    """A rebuild's fold into scratch tables, never swapped: one run of a projection at a time (a session's advisory
    lock, `kafold.<kind>:<name>`: the tables have fixed names), no rebuild_state, and the tables and their
    bookkeeping dropped at the end of the run (`scratch`). Its subclasses use `scratch` (the run) and
    `drop_scratch` (its tables), with Rebuild's surface."""

    kind = "scratch"
    plan_type: ClassVar[type[ScratchPlan]] = ScratchPlan

    def __init__(self, plan: Plan, *, batch: int = 5000, on_progress: Callable[[Progress], None] | None = None,
                 stop: threading.Event | None = None) -> None:
        # One process: copy workers would re-read the live checkpoints as their targets, and note nothing of what
        # they read (see rebuild.py `_copier`).
        super().__init__(self.plan_type.of(plan), batch=batch, workers=1, on_progress=on_progress, stop=stop)
        self.guard: psycopg.Connection[Any] | None = None

    def save(self, phase: str, conn: psycopg.Connection[Any] | None = None) -> None:
        self.phase = phase  # no rebuild_state: it is the rebuild's (which may be in progress)

    def drop_scratch(self, conn: psycopg.Connection[Any]) -> None:
        """The scratch tables and the fold's bookkeeping (the live connector's stays)."""
        p, c = self.plan, self.plan.config
        assert isinstance(p, ScratchPlan)
        for table in p.tables:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(q.qualified(c.schema, table)))
        self.tables.forget(conn)

    def _lock(self) -> None:
        """One run of a projection at a time: a session's advisory lock, held on `guard` until the run ends."""
        self.guard = db.connect(self.plan.pgc)
        got = self.guard.execute("SELECT pg_try_advisory_lock(hashtext(%s))",
                                 (f"kafold.{self.kind}:{self.plan.name}",)).fetchone()
        if not got or not got[0]:
            self.guard.close()
            raise FatalError(f"a {self.kind} of {self.plan.name!r} is already running")

    @contextmanager
    def scratch(self) -> Iterator[None]:
        """A run: the lock taken (FatalError when another run holds it); on the way out, however it ends, the
        scratch tables and bookkeeping dropped in one transaction and the lock released."""
        self._lock()
        try:
            yield
        finally:
            try:
                with db.connect(self.plan.pgc) as conn, conn.transaction():
                    self.drop_scratch(conn)
            finally:
                if self.guard is not None:
                    self.guard.close()
