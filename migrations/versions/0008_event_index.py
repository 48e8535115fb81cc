"""The history index: where each aggregate's events lie on its events topic, and how far each partition is indexed.

`event_index` maps (events topic, aggregate id, version) to the (partition, offset) of the event and its event id,
so an aggregate's history is read by fetching exactly those offsets instead of scanning its partition
(kafold.history). `event_index_marks` holds, per events partition, the offset below which every committed event is
in `event_index`; the rows and the mark are written in one PostgreSQL transaction. Both are a cache of the topic:
they may lag or be dropped and rebuilt (`kafold events index --rebuild`), and every row is checked against the
record it names before it is served.

Revision ID: 0008_event_index
Revises: 0007_key_store_purge
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008_event_index"
down_revision: str | None = "0007_key_store_purge"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    """The `[postgres].schema` the environment migrates (also where alembic_version lives)."""
    return str(op.get_context().opts.get("version_table_schema") or "kafold")


def upgrade() -> None:
    op.create_table(
        "event_index",
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("aggregate_id", sa.Text, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("topic", "aggregate_id", "version", name="pk_event_index"),
        schema=_schema(),
    )
    # a partition's rows are dropped together (a rebuild, a topic recreated)
    op.create_index("ix_event_index_partition", "event_index", ["topic", "partition"], schema=_schema())
    op.create_table(
        "event_index_marks",
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("indexed_to", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("topic", "partition", name="pk_event_index_marks"),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("event_index_marks", schema=_schema())
    op.drop_index("ix_event_index_partition", "event_index", schema=_schema())
    op.drop_table("event_index", schema=_schema())
