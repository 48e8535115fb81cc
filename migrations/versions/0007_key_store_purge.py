"""Durable erasure: subject keys found by key id (the erasure log's re-apply), and the purge bookkeeping.

`ix_subject_keys_key_id` lets a re-apply of the erasure log (kafold.erasure_log) find the keys it names by id.
`key_store_state` counts the changes that leave a wrapped key in a dead row version (deletes, rewraps) and the
count at the last purge (`VACUUM FULL` of `subject_keys`, kafold.protect.PgKeyStore.purge): a purge is due when
they differ.

Revision ID: 0007_key_store_purge
Revises: 0006_subject_keys
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007_key_store_purge"
down_revision: str | None = "0006_subject_keys"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    """The `[postgres].schema` the environment migrates (also where alembic_version lives)."""
    return str(op.get_context().opts.get("version_table_schema") or "kafold")


def upgrade() -> None:
    op.create_index("ix_subject_keys_key_id", "subject_keys", ["key_id"], schema=_schema())
    state = op.create_table(
        "key_store_state",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("value", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_key_store_state"),
        schema=_schema(),
    )
    # a database that has deleted keys already starts with a purge due (changes 1, purged at 0)
    op.bulk_insert(state, [{"name": "changes", "value": 1}, {"name": "purged_at_change", "value": 0}])


def downgrade() -> None:
    op.drop_table("key_store_state", schema=_schema())
    op.drop_index("ix_subject_keys_key_id", table_name="subject_keys", schema=_schema())
