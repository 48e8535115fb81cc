"""Effect ledger tables: outcomes and failed attempts per (connector, event id), parked events and parked keys.

Revision ID: 0002_effect_ledger
Revises: 0001_kafold_core
Create Date: 2024-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002_effect_ledger"
down_revision: str | None = "0001_kafold_core"
branch_labels: str | None = None
depends_on: str | None = None

TS = sa.DateTime(timezone=True)


def _schema() -> str:
    """The `[postgres].schema` the environment migrates (also where alembic_version lives)."""
    return str(op.get_context().opts.get("version_table_schema") or "kafold")


def upgrade() -> None:
    schema = _schema()
    _ledger(schema)
    _attempts(schema)
    _parked(schema)
    _parked_keys(schema)


def _ledger(schema: str) -> None:
    """One row per (connector, event id): the effect's status, attempts and outcome."""
    op.create_table(
        "effect_ledger",
        sa.Column("connector", sa.Text, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("event_type", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("first_attempt_at", TS),
        sa.Column("last_attempt_at", TS),
        sa.Column("completed_at", TS),
        sa.Column("latency_ms", sa.Float),
        sa.Column("last_error", sa.Text),
        sa.PrimaryKeyConstraint("connector", "event_id", name="pk_effect_ledger"),
        sa.CheckConstraint("status IN ('retrying', 'succeeded', 'parked', 'skipped')",
                           name="ck_effect_ledger_status"),
        schema=schema,
    )
    op.create_index("ix_effect_ledger_event_id", "effect_ledger", ["event_id"], schema=schema)


def _attempts(schema: str) -> None:
    """Every failed attempt of an effect, for `kafold effects` to show."""
    op.create_table(
        "effect_attempts",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("connector", sa.Text, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("attempted_at", TS, nullable=False),
        sa.Column("latency_ms", sa.Float),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("error", sa.Text),
        schema=schema,
    )
    op.create_index("ix_effect_attempts_connector_event_id", "effect_attempts", ["connector", "event_id"],
                    schema=schema)


def _parked(schema: str) -> None:
    """Parked events, in their order per key (`seq`)."""
    op.create_table(
        "effect_parked",
        sa.Column("seq", sa.BigInteger, sa.Identity(), nullable=False, unique=True),
        sa.Column("connector", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("head", sa.Boolean, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("event", sa.dialects.postgresql.JSONB, nullable=False),
        sa.Column("parked_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("connector", "event_id", name="pk_effect_parked"),
        schema=schema,
    )
    op.create_index("ix_effect_parked_connector_key_seq", "effect_parked", ["connector", "key", "seq"],
                    schema=schema)


def _parked_keys(schema: str) -> None:
    """Parked keys: the head event that parked a key, and the operator's requested action."""
    op.create_table(
        "effect_parked_keys",
        sa.Column("connector", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("head_event_id", sa.Text, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("parked_at", TS, nullable=False),
        sa.Column("requested_action", sa.Text),
        sa.Column("requested_at", TS),
        sa.PrimaryKeyConstraint("connector", "key", name="pk_effect_parked_keys"),
        sa.CheckConstraint("requested_action IS NULL OR requested_action IN ('retry', 'skip')",
                           name="ck_effect_parked_keys_requested_action"),
        schema=schema,
    )

def downgrade() -> None:
    schema = _schema()
    for name in ("effect_parked_keys", "effect_parked", "effect_attempts", "effect_ledger"):
        op.drop_table(name, schema=schema)
