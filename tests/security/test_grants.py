"""Integration: the GRANTs `kafold db grant-sql` prints, run for a fresh role, let a projection run as that role
(kafold's migrations included) and nothing more: the role cannot read, create in, or drop what the config does not
name."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from kafold import db
from kafold.config import KafkaConfig, PostgresConfig
from kafold.tools import cli
from tests.projection.projection_support import encoded, ends_of, fold, history, running, settings
from tests.security.test_bad_configs import projection
from tests.support import create_topic, produce, wait_for


def as_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


@pytest.fixture
def role(pg_config: PostgresConfig) -> Iterator[str]:
    name = f"kt_role_{uuid.uuid4().hex[:8]}"
    with db.connect(pg_config) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with db.connect(pg_config) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {0} CASCADE; DROP ROLE {0}").format(sql.Identifier(name)))


def grant_sql(path: Path, role: str, capsys: pytest.CaptureFixture[str]) -> str:
    args = cli.build_parser().parse_args(["db", "grant-sql", "-c", str(path), "--role", role])
    assert args.handler(args) == 0
    return capsys.readouterr().out


def test_grant_sql_is_enough_for_a_projection_and_no_more(
        tmp_path: Path, kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str, role: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    tag = uuid.uuid4().hex[:8]
    own, target, table = f"kt_own_{tag}", f"kt_proj_{tag}", f"acc_{tag}"
    with db.connect(pg_config) as conn:  # the administrator's objects: a schema for projections, other tables
        conn.execute(sql.SQL("CREATE SCHEMA {0}; CREATE TABLE {0}.other (x int); CREATE TABLE public.{1} (x int)"
                             ).format(sql.Identifier(target), sql.Identifier(f"other_{tag}")))
    topic = f"{unique}.events"
    cfg = settings(unique, topic, table, schema=target)
    path = tmp_path / "kafold.toml"
    path.write_text(f'[postgres]\nurl = "{as_user(pg_config.url, role)}"\nschema = "{own}"\n'
                    + projection(table=table, schema=target, column="account_id"))
    statements = grant_sql(path, role, capsys)
    assert f'GRANT USAGE, CREATE ON SCHEMA "{target}" TO "{role}";' in statements
    with db.connect(pg_config) as conn:
        conn.execute(statements)

    events = history(accounts=4, deposits=2)
    create_topic(kafka_config, topic, partitions=2)
    create_topic(kafka_config, cfg.dlq_topic)
    ends = ends_of(produce(kafka_config, topic, encoded(events, 2)))
    pgc = PostgresConfig(url=as_user(pg_config.url, role), schema=own)

    def stored() -> dict[int, int]:
        try:
            with db.connect(pgc) as conn:
                return dict(conn.execute(sql.SQL("SELECT partition, next_offset FROM {}.checkpoints").format(
                    sql.Identifier(own))).fetchall())
        except psycopg.Error:  # the task has not migrated yet
            return {}

    with running(kafka_config, pgc, cfg, unique, batch=50) as runner:
        def done() -> bool:
            assert not runner.failed, runner.error
            return stored() == ends

        wait_for(done, f"stored offsets {ends}", 90)
    with db.connect(pgc) as conn:
        rows = {r for (r,) in conn.execute(sql.SQL("SELECT account_id FROM {}.{}").format(
            sql.Identifier(target), sql.Identifier(table))).fetchall()}
    assert rows == set(fold(events))

    forbidden: list[Any] = [
        sql.SQL("DROP TABLE {}.other").format(sql.Identifier(target)),            # not its table
        sql.SQL("SELECT * FROM public.{}").format(sql.Identifier(f"other_{tag}")),  # not named by the config
        sql.SQL("CREATE TABLE public.{} (x int)").format(sql.Identifier(f"mine_{tag}")),
        sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(target)),
        sql.SQL("CREATE ROLE {}").format(sql.Identifier(f"r_{tag}")),
    ]
    with db.connect(pgc) as conn:
        for statement in forbidden:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    with db.connect(pg_config) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE; DROP SCHEMA {} CASCADE; DROP TABLE public.{}").format(
            sql.Identifier(target), sql.Identifier(own), sql.Identifier(f"other_{tag}")))


def test_grant_sql_refuses_a_hostile_role_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kafold.errors import ConfigError

    path = tmp_path / "kafold.toml"
    path.write_text("")
    with pytest.raises(ConfigError, match="--role"):
        grant_sql(path, 'x"; DROP TABLE y; --', capsys)
    assert 'GRANT USAGE, CREATE ON SCHEMA "kafold" TO "app";' in grant_sql(path, "app", capsys)
