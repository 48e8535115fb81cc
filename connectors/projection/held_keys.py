"""HeldKeys: the row keys a projection holds back (`hold_on_dead_letter`), as its writer reads and makes them.

writer.py's module note has the protocol: every transaction that may hold takes the connector's holds lock
(shared) and reads the held keys in its first round trip; a set different from the one the batch was prepared
with is HoldsChanged (the writer redoes the transaction). A refused event whose row key is known becomes the head
of that key, and the key's later events become dead letters with status `held`. holds.py has the release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import psycopg
from psycopg import sql

from kafold.connectors.api import RawRecord, SinkRecord
from kafold.connectors.dlq import DeadLetterStatus
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.fold import Prepared
from kafold.connectors.projection.mapping import Mapping, MappingError
from kafold.errors import RecordError

DeadLetter = tuple[RawRecord, BaseException]
HoldOf = dict[int, tuple[DeadLetterStatus, str]]  # id(error) -> (status, hold_key) of the dead letters a write makes


def holds_lock(connector: str) -> str:
    """The advisory lock (text, hashed by PostgreSQL) a connector's writer holds shared while it reads held keys."""
    return f"kafold.holds:{connector}"


def hold_text(key: tuple[Any, ...]) -> str:
    """A row key as stored in `dead_letters.hold_key`: JSON, the same text for the same key."""
    return orjson.dumps(list(key), default=str).decode()


class HoldsChanged(Exception):
    """The connector's held keys changed since the batch was prepared; redo it with the keys read."""


class HeldKeys:
    """The connector's held keys as its writer last read them (`known`: texts by hold_text), and the dead letters
    they make of a batch's events."""

    def __init__(self, connector: str, dead_letters: sql.Composed, mapping: Mapping) -> None:
        self.connector, self.dead_letters, self.mapping = connector, dead_letters, mapping
        self.known: set[str] = set()

    def read(self, conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
        """Take the holds lock (shared, until the commit) and read the connector's held keys (pipelined)."""
        conn.execute("SELECT pg_advisory_xact_lock_shared(hashtext(%s))", (holds_lock(self.connector),))
        return conn.execute(q.held_keys(self.dead_letters), (self.connector,))

    def check_in_server(self, conn: psycopg.Connection[Any]) -> None:
        """`read` and `check` made in the server (pipelined): the statement fails (sql.redo) when the held keys are
        not those known; for a transaction whose COMMIT is queued before any result is read (whole_rows.py)."""
        conn.execute("SELECT pg_advisory_xact_lock_shared(hashtext(%s))", (holds_lock(self.connector),))
        known = list(self.known)
        conn.execute(q.holds_unchanged(self.dead_letters), (known, known, self.connector))

    def check(self, cur: psycopg.Cursor[Any]) -> None:
        """HoldsChanged when the keys `read` found are not those known (now known)."""
        found = {row[0] for row in cur.fetchall()}
        if found != self.known:
            self.known = found
            raise HoldsChanged()

    def head_text(self, hold: bool, record: SinkRecord) -> str | None:
        """The hold key a dead letter of `record` would hold back (None: not holding, or no row key)."""
        if not hold:
            return None
        try:
            return hold_text(self.mapping.key(record.event))
        except MappingError:
            return None

    def heads(self, hold: bool, hold_of: HoldOf, records: Sequence[SinkRecord],
              bad: list[tuple[SinkRecord, RecordError]], heads: dict[str, int]) -> list[tuple[SinkRecord, RecordError]]:
        """The refused events that become dead letters (each the head of its row key when holding, noted in
        `heads` and `hold_of`); one of a key already held, or behind an earlier refused one, is left out: the redo
        holds it."""
        if not hold:
            return bad
        at = {id(r): i for i, r in enumerate(records)}
        out: list[tuple[SinkRecord, RecordError]] = []
        for r, err in bad:
            text = self.head_text(hold, r)
            if text is not None:
                if text in self.known or text in heads:
                    continue
                heads[text] = at[id(r)]
                hold_of[id(err)] = (DeadLetterStatus.NEW, text)
            out.append((r, err))
        return out

    def held_records(self, hold_of: HoldOf, records: Sequence[SinkRecord], prep: Prepared, skip: set[int],
                     heads: dict[str, int]) -> list[DeadLetter]:
        """The events of held keys (all of a key held before this batch; those after their head in it), as dead
        letters with status `held` (noted in `hold_of`); they join `skip`."""
        out: list[DeadLetter] = []
        held, end = self.known, len(records)
        for i, r in enumerate(records):
            if id(r) in skip:
                continue
            key = prep[id(r)][1]
            if type(key) is not tuple:
                continue
            text = hold_text(key)
            if text in held or heads.get(text, end) < i:
                skip.add(id(r))
                error = RecordError(f"held: an earlier event of row key {text} is dead-lettered; this one is applied "
                                    f"after it is replayed or discarded (kafold dlq list --connector "
                                    f"{self.connector} --status all)", raw=r, reason="held")
                hold_of[id(error)] = (DeadLetterStatus.HELD, text)
                out.append((RawRecord.of(r), error))
        return out
