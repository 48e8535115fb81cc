"""The ledger's delivery statuses are stored in PostgreSQL (effect_ledger.status, printed by the CLI): the enum's
values are exactly the ones the table's CHECK constraint accepts, and psycopg sends the value, not the member name."""

from __future__ import annotations

import re

from psycopg.adapt import PyFormat, Transformer

from kafold.connectors.effects.ledger import DeliveryStatus
from tests.support import ROOT


def test_the_statuses_are_the_ones_the_ledger_table_accepts() -> None:
    migration = (ROOT / "migrations" / "versions" / "0002_effect_ledger.py").read_text()
    check = re.search(r'"status IN \(([^)]*)\)",\s*name="ck_effect_ledger_status"', migration)
    assert check is not None, "the effect_ledger status constraint moved"
    assert {v.strip().strip("'") for v in check.group(1).split(",")} == {s.value for s in DeliveryStatus}


def test_psycopg_stores_the_value_not_the_member_name() -> None:
    tx = Transformer()
    for fmt in (PyFormat.AUTO, PyFormat.TEXT):
        assert bytes(tx.get_dumper(DeliveryStatus.RETRYING, fmt).dump(DeliveryStatus.RETRYING)) == b"retrying"
