"""kafold core tables: checkpoints, tracking, dead letters, rebuild state.

Revision ID: 0001_kafold_core
Revises:
Create Date: 2024-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001_kafold_core"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

TS = sa.DateTime(timezone=True)


def _schema() -> str:
    """The `[postgres].schema` the environment migrates (also where alembic_version lives)."""
    return str(op.get_context().opts.get("version_table_schema") or "kafold")


def upgrade() -> None:
    schema = _schema()
    op.create_table(
        "checkpoints",
        sa.Column("connector", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("next_offset", sa.BigInteger, nullable=False),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("connector", "topic", "partition", name="pk_checkpoints"),
        schema=schema,
    )
    op.create_table(
        "tracking",
        # event_key = BLAKE2b-128(namespace, event id) (see connectors/projection/writer.py): one 16-byte key
        # per applied event; `projection` (the namespace) is kept for counts and for dropping a namespace.
        sa.Column("event_key", sa.LargeBinary, nullable=False),
        sa.Column("projection", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("event_key", name="pk_tracking"),
        schema=schema,
    )
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("connector", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("key", sa.LargeBinary),
        sa.Column("value", sa.LargeBinary),
        sa.Column("headers", postgresql.JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("error_class", sa.Text, nullable=False),
        sa.Column("error_message", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False, server_default="invalid"),
        sa.Column("status", sa.Text, nullable=False, server_default="new"),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("replayed_at", TS),
        sa.PrimaryKeyConstraint("id", name="pk_dead_letters"),
        sa.UniqueConstraint("connector", "topic", "partition", "offset",
                            name="uq_dead_letters_connector_topic_partition_offset"),
        sa.CheckConstraint("status IN ('new', 'replayed', 'discarded')", name="ck_dead_letters_status"),
        schema=schema,
    )
    op.create_index("ix_dead_letters_connector_status", "dead_letters", ["connector", "status"], schema=schema)
    op.create_table(
        "rebuild_state",
        sa.Column("projection", sa.Text, nullable=False),
        sa.Column("shadow_table", sa.Text, nullable=False),
        sa.Column("namespace", sa.Text, nullable=False),
        sa.Column("phase", sa.Text, nullable=False),
        sa.Column("events", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("started_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("projection", name="pk_rebuild_state"),
        sa.CheckConstraint("phase IN ('copying', 'catching-up', 'swapped', 'abandoned')",
                           name="ck_rebuild_state_phase"),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    op.drop_table("rebuild_state", schema=schema)
    op.drop_index("ix_dead_letters_connector_status", table_name="dead_letters", schema=schema)
    op.drop_table("dead_letters", schema=schema)
    op.drop_table("tracking", schema=schema)
    op.drop_table("checkpoints", schema=schema)
