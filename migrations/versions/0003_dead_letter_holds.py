"""Dead letters that hold a key: the row key a dead letter holds back (`hold_key`) and the status `held`.

Revision ID: 0003_dead_letter_holds
Revises: 0002_effect_ledger
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003_dead_letter_holds"
down_revision: str | None = "0002_effect_ledger"
branch_labels: str | None = None
depends_on: str | None = None

HOLDING = "status IN ('new', 'held') AND hold_key IS NOT NULL"


def _schema() -> str:
    """The `[postgres].schema` the environment migrates (also where alembic_version lives)."""
    return str(op.get_context().opts.get("version_table_schema") or "kafold")


def _set_statuses(schema: str, statuses: str) -> None:
    """Replace the status check constraint (found by what it checks: its name depends on how 0001 ran)."""
    op.execute(sa.text(f"""DO $$ DECLARE c text; BEGIN
        FOR c IN SELECT conname FROM pg_constraint WHERE conrelid = '"{schema}".dead_letters'::regclass
                 AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%status%' LOOP
            EXECUTE format('ALTER TABLE %I.dead_letters DROP CONSTRAINT %I', '{schema}', c);
        END LOOP; END $$"""))
    op.execute(sa.text(f'ALTER TABLE "{schema}".dead_letters ADD CONSTRAINT ck_dead_letters_status '
                       f"CHECK (status IN ({statuses}))"))


def upgrade() -> None:
    schema = _schema()
    op.add_column("dead_letters", sa.Column("hold_key", sa.Text), schema=schema)
    _set_statuses(schema, "'new', 'held', 'replayed', 'discarded'")
    # The writer reads the held keys of its connector with every batch: a partial index, empty when none are.
    op.create_index("ix_dead_letters_connector_hold_key", "dead_letters", ["connector", "hold_key"], schema=schema,
                    postgresql_where=sa.text(HOLDING))


def downgrade() -> None:
    schema = _schema()
    op.drop_index("ix_dead_letters_connector_hold_key", table_name="dead_letters", schema=schema)
    op.execute(sa.text(f'UPDATE "{schema}".dead_letters SET status = \'new\' WHERE status = \'held\''))
    _set_statuses(schema, "'new', 'replayed', 'discarded'")
    op.drop_column("dead_letters", "hold_key", schema=schema)
