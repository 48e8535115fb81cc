"""Dead-letter statuses are stored in PostgreSQL (dead_letters.status, printed by `kafold dlq`): the enum's values
are exactly the ones the table's CHECK constraint accepts, and the open statuses render as the partial index's
predicate spells them (so the planner can use it)."""

from __future__ import annotations

import re

from kafold.connectors.dlq import OPEN_STATUSES, DeadLetterStatus
from kafold.connectors.projection import sql as q
from tests.support import ROOT


def test_the_statuses_are_the_ones_the_dead_letters_table_accepts() -> None:
    from kafold.migrations.tables import DEAD_LETTER_STATUSES

    assert tuple(s.value for s in DeadLetterStatus) == DEAD_LETTER_STATUSES


def test_the_open_statuses_render_as_the_partial_index_predicate() -> None:
    tables = (ROOT / "migrations" / "tables.py").read_text()
    predicate = re.search(r'postgresql_where=sa\.text\("status IN (\([^)]*\)) AND hold_key IS NOT NULL"\)', tables)
    assert predicate is not None, "the dead_letters holds index moved"
    assert q.OPEN.as_string(None) == predicate.group(1) == "('new', 'held')"
    assert q.statuses(DeadLetterStatus.REPLAYED).as_string(None) == "('replayed')"
    assert set(OPEN_STATUSES) == {DeadLetterStatus.NEW, DeadLetterStatus.HELD}
