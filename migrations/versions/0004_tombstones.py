"""Tombstones: the version of each deleted row, per namespace, for writers that dedupe by version (a rebuild).

Revision ID: 0004_tombstones
Revises: 0003_dead_letter_holds
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004_tombstones"
down_revision: str | None = "0003_dead_letter_holds"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    """The `[postgres].schema` the environment migrates (also where alembic_version lives)."""
    return str(op.get_context().opts.get("version_table_schema") or "kafold")


def upgrade() -> None:
    op.create_table(
        "tombstones",
        # row_key: the row key as JSON text (the same text as dead_letters.hold_key); version: the highest
        # aggregate version the row had reached when it was deleted.
        sa.Column("namespace", sa.Text, nullable=False),
        sa.Column("row_key", sa.Text, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("namespace", "row_key", name="pk_tombstones"),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("tombstones", schema=_schema())
