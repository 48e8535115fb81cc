"""kafold's own tables (checkpoints, tracking, dead letters, tombstones, rebuild state) as SQLAlchemy metadata."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# Constraint names are derived, never left to the database, so migrations can refer to them by name.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

DEAD_LETTER_STATUSES = ("new", "held", "replayed", "discarded")
REBUILD_PHASES = ("copying", "catching-up", "swapped", "abandoned")


def metadata(schema: str | None = None) -> sa.MetaData:
    """The tables in `schema` (the `[postgres].schema` setting); used by env.py as the autogenerate target."""
    md = sa.MetaData(schema=schema, naming_convention=NAMING_CONVENTION)
    ts = sa.DateTime(timezone=True)
    sa.Table(
        "checkpoints", md,
        sa.Column("connector", sa.Text, primary_key=True),
        sa.Column("topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("next_offset", sa.BigInteger, nullable=False),
        sa.Column("updated_at", ts, nullable=False, server_default=sa.func.now()),
        comment="Next offset to read per connector and partition; written in the same transaction as the rows.",
    )
    sa.Table(
        "tracking", md,
        sa.Column("event_key", sa.LargeBinary, primary_key=True),
        sa.Column("projection", sa.Text, nullable=False),
        comment="Events a projection has applied (dedup records), keyed by BLAKE2b-128(namespace, event id); "
                "a replay hits the primary key.",
    )
    sa.Table(
        "dead_letters", md,
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
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
        sa.Column("created_at", ts, nullable=False, server_default=sa.func.now()),
        sa.Column("replayed_at", ts),
        sa.Column("hold_key", sa.Text),
        sa.UniqueConstraint("connector", "topic", "partition", "offset"),
        sa.CheckConstraint(f"status IN {DEAD_LETTER_STATUSES!r}", name="status"),
        sa.Index(None, "connector", "status"),
        sa.Index(None, "connector", "hold_key",
                 postgresql_where=sa.text("status IN ('new', 'held') AND hold_key IS NOT NULL")),
        comment="Records a connector could not process, with their coordinates and the error; for a projection, "
                "the row key a dead letter holds back (hold_key) and the events held behind it (status held).",
    )
    sa.Table(
        "tombstones", md,
        sa.Column("namespace", sa.Text, primary_key=True),
        sa.Column("row_key", sa.Text, primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
        comment="The version each deleted row had reached, per namespace: how a writer that dedupes by version "
                "(a rebuild's) knows a late duplicate of a deleted row's events.",
    )
    sa.Table(
        "rebuild_state", md,
        sa.Column("projection", sa.Text, primary_key=True),
        sa.Column("shadow_table", sa.Text, nullable=False),
        sa.Column("namespace", sa.Text, nullable=False),
        sa.Column("phase", sa.Text, nullable=False),
        sa.Column("events", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("started_at", ts, nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", ts, nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint(f"phase IN {REBUILD_PHASES!r}", name="phase"),
        comment="A blue-green rebuild in progress (resumable after a crash).",
    )
    return md
