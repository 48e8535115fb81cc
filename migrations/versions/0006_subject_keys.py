"""Crypto-shredding: each subject's data key (wrapped by the master key) and the record of erasures, without data.

`subject_keys` holds one wrapped 256-bit data key per subject (kafold.protect); deleting the row is forgetting the
subject. `erasures` records each `forget` as a keyed hash of the subject (HMAC under a key derived from the master
key: it proves a given subject was forgotten, and names none), who asked and when.

Revision ID: 0006_subject_keys
Revises: 0005_covers
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006_subject_keys"
down_revision: str | None = "0005_covers"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    """The `[postgres].schema` the environment migrates (also where alembic_version lives)."""
    return str(op.get_context().opts.get("version_table_schema") or "kafold")


def upgrade() -> None:
    op.create_table(
        "subject_keys",
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("key_id", sa.LargeBinary, nullable=False),
        sa.Column("wrapped_key", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("subject", name="pk_subject_keys"),
        schema=_schema(),
    )
    op.create_table(
        "erasures",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("subject_hash", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("key_existed", sa.Boolean, nullable=False),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("id", name="pk_erasures"),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("erasures", schema=_schema())
    op.drop_table("subject_keys", schema=_schema())
