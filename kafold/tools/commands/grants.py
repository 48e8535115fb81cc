"""The least-privilege PostgreSQL GRANTs a configuration needs, for `kafold db grant-sql`.

What kafold does in PostgreSQL, and so what the role needs:
- kafold's own schema (`[postgres].schema`: checkpoints, tracking records, dead letters, the effect ledger):
  the role owns it, so the daemon can apply kafold's migrations on start (`migrate_on_start`); tables an
  administrator created there before get plain read/write grants;
- every database session stages rows in TEMP tables: CONNECT and TEMPORARY on the database;
- each `postgres-projection` connector reads and writes its table; with `create_table = true` it may create it,
  which needs CREATE on that schema (the role then owns only what it created: it can never drop or alter a table
  it does not own). Blue-green rebuilds create, rename and drop tables, so they need the same.
Nothing here grants anything on other tables, other schemas, or the database itself beyond CONNECT/TEMPORARY.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kafold.config import KafoldConfig, python_path
from kafold.connectors.projection import ProjectionConfig, ProjectionConnector
from kafold.connectors.registry import resolve
from kafold.errors import ConfigError
from kafold.schema import Problems, is_missing, load

ROLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
TABLE_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"


def quote(name: str) -> str:
    """A double-quoted SQL identifier (names reaching here were validated; quoting is the second guard)."""
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class ProjectionTarget:
    connector: str
    schema: str
    table: str
    create_table: bool


def projection_targets(cfg: KafoldConfig, base: Path) -> list[ProjectionTarget]:
    """The table of every projection connector in the configuration."""
    out: list[ProjectionTarget] = []
    with python_path(cfg, base):
        for i, con in enumerate(cfg.connectors):
            if not issubclass(resolve(con.connector_class), ProjectionConnector):
                continue
            problems = Problems(f"connectors[{i}]")
            pc = load(ProjectionConfig, con.config, "config", problems, base)
            if problems.items or is_missing(pc):
                raise ConfigError(problems.items)
            out.append(ProjectionTarget(con.name, pc.schema, pc.table, pc.create_table))
    return out


def grant_sql(cfg: KafoldConfig, base: Path, role: str) -> list[str]:
    """The statements (one per item, each ending in `;`) to run as an administrator for `role`."""
    if not ROLE_RE.match(role):
        raise ConfigError([f"--role: {role!r} is not a plain role name (letters, digits and '_', not starting with "
                           "a digit, at most 63 characters)"])
    r, own = quote(role), quote(cfg.postgres.schema)
    out = [
        f"-- kafold: least-privilege grants for role {role} (run as an administrator; the role must exist:",
        f"--   CREATE ROLE {r} LOGIN;  then give it a password or a certificate)",
        "-- connect, and stage rows in TEMP tables",
        "DO $$ BEGIN EXECUTE format('GRANT CONNECT, TEMPORARY ON DATABASE %I TO %I', current_database(), "
        f"'{role}'); END $$;",
        f"-- kafold's own tables (checkpoints, tracking, dead letters, effect ledger) in schema {cfg.postgres.schema}; "
        "the role applies kafold's migrations there",
        f"CREATE SCHEMA IF NOT EXISTS {own} AUTHORIZATION {r};",
        f"GRANT USAGE, CREATE ON SCHEMA {own} TO {r};",
        f"GRANT {TABLE_PRIVILEGES} ON ALL TABLES IN SCHEMA {own} TO {r};",
        f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {own} TO {r};",
    ]
    for t in projection_targets(cfg, base):
        schema, table = quote(t.schema), quote(t.table)
        out.append(f"-- projection {t.connector}: {t.schema}.{t.table}"
                   + (" (created by the connector when missing)" if t.create_table else " (must exist)"))
        out.append(f"GRANT USAGE{', CREATE' if t.create_table else ''} ON SCHEMA {schema} TO {r};")
        grant = f"GRANT {TABLE_PRIVILEGES} ON TABLE {schema}.{table} TO {r};"
        if t.create_table:  # the table may not exist yet: then the role creates (and owns) it
            literal = f"{schema}.{table}".replace("'", "''")
            out.append(f"DO $$ BEGIN IF to_regclass('{literal}') IS NOT NULL THEN {grant[:-1]}; END IF; END $$;")
        else:
            out.append(grant)
    return out
