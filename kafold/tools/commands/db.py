"""`kafold db upgrade|current|grant-sql -c FILE`: kafold's own migrations, and the GRANTs its role needs."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

from kafold import config, db, devstack, erasure_log, protect
from kafold.connectors.projection import restored
from kafold.tools.cli import add_config_arg
from kafold.tools.commands import grants


def register(sub: Any) -> None:
    p = sub.add_parser("db", help="kafold's own PostgreSQL tables (checkpoints, tracking, dead letters)")
    dsub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    u = dsub.add_parser("upgrade", help="apply the migrations (idempotent)")
    add_config_arg(u)
    u.add_argument("revision", nargs="?", default="head", help="target revision (default: head)")
    u.set_defaults(handler=upgrade)
    c = dsub.add_parser("current", help="show the revision the database is at and the code's head")
    add_config_arg(c)
    c.set_defaults(handler=current)
    g = dsub.add_parser("grant-sql", help="print the least-privilege GRANTs for the schemas and tables the config uses")
    add_config_arg(g)
    g.add_argument("--role", default="", help="role to grant to (default: the user in postgres.url, else kafold)")
    g.set_defaults(handler=grant_sql)


def _pg(args: argparse.Namespace) -> config.PostgresConfig:
    return devstack.effective(config.load_file(args.config).config, need=("postgres",)).postgres


def upgrade(args: argparse.Namespace) -> int:
    """Apply the migrations; with protected fields, then re-apply the erasure log: a database restored from a
    backup gets back the forgets made after the backup (kafold.erasure_log)."""
    loaded = config.load_file(args.config)
    protected = any(a.protect for a in loaded.config.aggregates)
    cfg = devstack.effective(loaded.config, need=("kafka", "postgres") if protected else ("postgres",))
    revision = db.upgrade(cfg.postgres, args.revision)
    print(f"schema {cfg.postgres.schema!r} at revision {revision}")
    protector = protect.build(cfg) if protected and args.revision == "head" else None
    if protector is not None and protector.ring.erasure_log is not None:
        gone = erasure_log.reapply(protector.ring, protector.ring.erasure_log)
        if gone:
            print(f"erasure log re-applied: {len(gone)} keys of forgotten subjects deleted again (the database "
                  "was behind the log: restored from a backup?); folding those subjects' rows again in the "
                  "projections of protected fields")
            protector.ring.store.purge()
            # the restored rows of those subjects hold the backup's clear values until folded again
            for r in restored.refresh_restored(cfg, loaded.base, gone, config_file=args.config):
                state = "left as restored (stopped)" if not r.completed else f"{r.rows} row(s) folded again"
                held = f"; {r.held} held behind a dead letter, left as restored (`kafold dlq list`)" if r.held else ""
                print(f"{r.name}: {state}{held}")
    return 0


def current(args: argparse.Namespace) -> int:
    pgc = _pg(args)
    now, heads = db.current(pgc), db.heads()
    print(f"schema {pgc.schema!r}: current {now or '(none)'}, head {', '.join(heads)}")
    return 0 if now in heads else 1


def grant_sql(args: argparse.Namespace) -> int:
    """Print the statements; nothing is executed (an administrator reviews and runs them)."""
    loaded = config.load_file(args.config)
    role = args.role or urlsplit(loaded.config.postgres.url).username or "kafold"
    print("\n".join(grants.grant_sql(loaded.config, loaded.base, role)))
    return 0
