"""Alembic environment for kafold's own tables: offline (SQL script) and online (NullPool) modes."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context
from sqlalchemy.pool import NullPool

from kafold.migrations.tables import metadata

config = context.config
# kafold.db passes the schema (and usually an open connection) through config.attributes; no alembic.ini.
SCHEMA: str = config.attributes.get("schema") or config.get_main_option("kafold_schema") or "kafold"
target_metadata = metadata(SCHEMA)


def run_migrations_offline() -> None:
    """Emit SQL for the migrations without a database (`alembic upgrade --sql`)."""
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, dialect_opts={"paramstyle": "named"},
                      version_table_schema=SCHEMA, include_schemas=True)
    with context.begin_transaction():
        context.execute(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        context.run_migrations()


def _run(connection: sa.Connection) -> None:
    # Not CREATE SCHEMA IF NOT EXISTS: that needs CREATE on the database even when the schema exists, which a
    # least-privilege role owning only its schema lacks (docs/security.md). kafold.db holds an advisory lock here.
    if connection.execute(sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": SCHEMA}).first() is None:
        connection.execute(sa.text(f'CREATE SCHEMA "{SCHEMA}"'))
    context.configure(connection=connection, target_metadata=target_metadata, version_table_schema=SCHEMA,
                      include_schemas=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = sa.create_engine(config.get_main_option("sqlalchemy.url") or "", poolclass=NullPool)
    with engine.begin() as conn:
        _run(conn)


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
