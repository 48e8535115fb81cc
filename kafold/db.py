"""PostgreSQL helpers on top of kafold.pg: connections, the SQLAlchemy engine, and kafold's migrations."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from kafold import logs, pg
from kafold.config import ENV_PREFIX, PostgresConfig
from kafold.errors import ConfigError, RetriableError
from kafold.schema import Problems, is_missing, load

if TYPE_CHECKING:  # SQLAlchemy and Alembic are imported only to migrate: a task process that does not keeps ~20 MB
    import sqlalchemy as sa

log = logs.get(__name__)

# kafold.migrations (the top-level migrations/ folder in a checkout), found without importing it.
_SPEC = importlib.util.find_spec("kafold.migrations")
assert _SPEC is not None and _SPEC.submodule_search_locations is not None
MIGRATIONS_DIR = Path(next(iter(_SPEC.submodule_search_locations))).resolve()
# The newest of migrations/versions (a test checks it is Alembic's single head): a database already at it is
# recognised with one psycopg query, so a daemon's start loads SQLAlchemy and Alembic (~21 MB) only to migrate.
HEAD = "0008_event_index"
# Serialises concurrent `upgrade` calls (several daemons or tasks starting at once) on one database.
_MIGRATION_LOCK = 0x6B61_666F_6C64  # "kafold"


# Reads by a list of keys (`= ANY($1)`, a JOIN on `unnest($1)`) are executed with `prepare=False` (BY_KEYS): planned
# for their values each time. psycopg prepares a statement server-side from its 5th execution, and PostgreSQL then
# keeps one generic plan once that costs no more than the custom ones; planned while the table was empty (a new
# effects ledger, subject keys, a projection's rows or tombstones), that plan is a sequential scan, kept as the table
# grows: the effects ledger's read of a batch's event ids took 100 ms at 60k rows instead of 0.3 ms, and the webhook
# fell seconds behind at 1,000 events/s (docs/benchmarks.md, latency). Only these: the other statements (inserts,
# upserts, checkpoints) have one plan whatever the table holds, and re-planning them each time would be wasted work.
BY_KEYS = False


def connect(pgc: PostgresConfig, *, autocommit: bool = True, **kwargs: Any) -> psycopg.Connection[Any]:
    """A psycopg 3 connection; an unreachable server is a RetriableError (the caller backs off and retries)."""
    try:
        return psycopg.connect(pg.conninfo(pgc), autocommit=autocommit, **kwargs)
    except psycopg.OperationalError as e:
        raise RetriableError(f"PostgreSQL unreachable: {_first_line(e)}") from e


def engine(pgc: PostgresConfig) -> sa.Engine:
    """A SQLAlchemy engine without pooling (each `connect` is a fresh session, as Alembic recommends)."""
    # sqlalchemy/alembic: kafold[daemon], not in the core install
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool

    return sa.create_engine(pg.sqlalchemy_url(pgc), poolclass=NullPool)


def _alembic_config(pgc: PostgresConfig, connection: sa.Connection | None = None) -> Any:
    # sqlalchemy/alembic: kafold[daemon], not in the core install
    from alembic.config import Config

    cfg = Config()  # no alembic.ini: everything is set here, so it runs from any working directory
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("kafold_schema", pgc.schema)
    cfg.attributes["schema"] = pgc.schema
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def heads() -> list[str]:
    """The head revisions of kafold's migrations (exactly one unless the history forked)."""
    # sqlalchemy/alembic: kafold[daemon], not in the core install
    from alembic.script import ScriptDirectory

    return list(ScriptDirectory.from_config(_alembic_config(PostgresConfig())).get_heads())


def upgrade(pgc: PostgresConfig, revision: str = "head") -> str | None:
    """Apply kafold's migrations to `[postgres].schema` (idempotent, safe to run concurrently); the new revision."""
    if revision in ("head", HEAD) and _recorded(pgc) == [HEAD]:
        return HEAD
    return _migrate(pgc, "upgrade", revision)


def _recorded(pgc: PostgresConfig) -> list[str]:
    """The revisions Alembic's version table records, read with psycopg ([] when there is no such table yet)."""
    with connect(pgc) as conn:
        try:
            rows = conn.execute(sql.SQL("SELECT version_num FROM {}").format(table(pgc, "alembic_version")))
        except psycopg.errors.UndefinedTable:
            return []
        return [r[0] for r in rows]


def downgrade(pgc: PostgresConfig, revision: str) -> str | None:
    """Revert kafold's migrations down to `revision` ("base" removes kafold's tables)."""
    return _migrate(pgc, "downgrade", revision)


def _migrate(pgc: PostgresConfig, direction: str, revision: str) -> str | None:
    # sqlalchemy/alembic: kafold[daemon], not in the core install
    import sqlalchemy as sa
    from alembic import command

    try:
        with engine(pgc).begin() as conn:
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            getattr(command, direction)(_alembic_config(pgc, conn), revision)
            now = _current(conn, pgc.schema)
    except sa.exc.OperationalError as e:
        raise RetriableError(f"PostgreSQL unreachable: {_first_line(e.orig or e)}") from e
    log.info(f"db.{direction}d", schema=pgc.schema, revision=now)
    return now


def current(pgc: PostgresConfig) -> str | None:
    """The revision the database is at (None before the first upgrade)."""
    with engine(pgc).connect() as conn:
        return _current(conn, pgc.schema)


def _current(conn: sa.Connection, schema: str) -> str | None:
    # sqlalchemy/alembic: kafold[daemon], not in the core install
    from alembic.runtime.migration import MigrationContext

    ctx = MigrationContext.configure(conn, opts={"version_table_schema": schema})
    return ctx.get_current_revision()


def table(pgc: PostgresConfig, name: str) -> sql.Composed:
    """A quoted `schema.table` for one of kafold's own tables."""
    return sql.SQL("{}.{}").format(sql.Identifier(pgc.schema), sql.Identifier(name))


def from_environment(environ: Mapping[str, str] | None = None) -> PostgresConfig:
    """[postgres] from `KAFOLD_POSTGRES__*` variables, for a task whose host did not hand it the configured section
    (TaskConfig.postgres): a task driven outside the daemon. Never a guess: without a URL it is a ConfigError
    (the CLI's commands, not the tasks, fill a missing URL in from a running `kafold dev` stack)."""
    env = os.environ if environ is None else environ
    prefix = f"{ENV_PREFIX}POSTGRES__"
    raw = {k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)}
    problems = Problems("environment", env)
    cfg = load(PostgresConfig, raw, "postgres", problems, Path("."))
    if problems.items or is_missing(cfg):
        raise ConfigError(problems.items)
    if not cfg.url:
        raise ConfigError([f"postgres.url: no [postgres] section reached the task and {prefix}URL is not set"])
    return cfg


@contextmanager
def transaction(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """One transaction; connection-level failures become RetriableError (the same work is tried again)."""
    try:
        with conn.transaction():
            yield conn
    except psycopg.OperationalError as e:
        raise RetriableError(f"PostgreSQL: {_first_line(e)}") from e


# A transaction whose BEGIN and COMMIT are statements of their own on an autocommit connection (`begin`, `commit`):
# in pipeline mode they travel with the statements beside them, where psycopg's `transaction()` waits for its BEGIN
# (a round trip) and, inside a pipeline, syncs at both ends. A projection's batch thereby costs two round trips
# instead of seven (docs/benchmarks.md, latency). After any error the caller calls `roll_back`.
def begin(conn: psycopg.Connection[Any]) -> None:
    conn.execute("BEGIN", prepare=False)


def commit(conn: psycopg.Connection[Any]) -> None:
    conn.execute("COMMIT", prepare=False)


def roll_back(conn: psycopg.Connection[Any]) -> None:
    """End what `begin` opened after an error (nothing to do when it ended); a connection that cannot is closed,
    so that its owner reconnects, and the error being handled is the one that propagates."""
    if conn.closed or conn.broken:
        return
    try:
        conn.rollback()  # also out of an aborted pipeline, and only when a transaction is open
    except psycopg.Error:
        conn.close()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
