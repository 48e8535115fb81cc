"""kafold's own tables: one migration head, upgrade/downgrade in the configured schema, no alembic.ini needed."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import pytest

from kafold import db
from kafold.config import PostgresConfig


def test_the_migrations_have_a_single_head_and_it_is_the_one_upgrade_recognises_without_alembic() -> None:
    assert db.heads() == [db.HEAD]


def test_upgrade_creates_the_tables_in_the_configured_schema_from_any_directory(
        pg_config: PostgresConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no alembic.ini here
    pgc = dataclasses.replace(pg_config, schema=f"k_{uuid.uuid4().hex[:8]}")
    assert db.current(pgc) is None
    assert db.upgrade(pgc) == db.heads()[0]
    assert db.upgrade(pgc) == db.heads()[0]  # idempotent
    assert db._recorded(pgc) == [db.HEAD]  # what the second upgrade read to skip Alembic
    with db.connect(pgc) as conn:
        tables = {r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (pgc.schema,))}
    assert {"checkpoints", "tracking", "dead_letters", "rebuild_state", "alembic_version"} <= tables
    assert db.downgrade(pgc, "base") is None
    with db.connect(pgc) as conn:
        left = conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = %s "
                            "AND table_name <> 'alembic_version'", (pgc.schema,)).fetchone()
    assert left == (0,)


def test_db_commands_upgrade_and_report_the_revision(pg_url: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kafold.tools import cli

    def main(argv: list[str]) -> int:  # cli.main without its logging set-up (pytest owns stderr)
        args = cli.build_parser().parse_args(argv)
        return int(args.handler(args))

    schema = f"k_{uuid.uuid4().hex[:8]}"
    conf = tmp_path / "kafold.toml"
    conf.write_text(f'[postgres]\nurl = "{pg_url}"\nschema = "{schema}"\n')
    assert main(["db", "current", "-c", str(conf)]) == 1
    assert main(["db", "upgrade", "-c", str(conf)]) == 0
    assert main(["db", "current", "-c", str(conf)]) == 0
    assert f"current {db.heads()[0]}" in capsys.readouterr().out
    assert os.getcwd() != str(db.MIGRATIONS_DIR)


def test_the_holds_migration_keeps_existing_dead_letters_and_downgrades_held_ones_to_new(
        pg_config: PostgresConfig) -> None:
    pgc = dataclasses.replace(pg_config, schema=f"k_{uuid.uuid4().hex[:8]}")
    insert = (f'INSERT INTO "{pgc.schema}".dead_letters (connector, topic, partition, "offset", error_class, '
              "error_message) VALUES ('c', 't', 0, %s, 'E', 'm')")
    db.upgrade(pgc, "0002_effect_ledger")
    with db.connect(pgc) as conn:
        conn.execute(insert, (1,))
    db.upgrade(pgc)
    with db.connect(pgc) as conn:
        conn.execute(insert, (2,))
        conn.execute(f"UPDATE \"{pgc.schema}\".dead_letters SET status = 'held', hold_key = '[\"k\"]' "
                     'WHERE "offset" = 2')
        rows = conn.execute(f'SELECT "offset", status, hold_key FROM "{pgc.schema}".dead_letters ORDER BY 1').fetchall()
    assert rows == [(1, "new", None), (2, "held", '["k"]')]
    db.downgrade(pgc, "0002_effect_ledger")
    with db.connect(pgc) as conn:
        rows = conn.execute(f'SELECT "offset", status FROM "{pgc.schema}".dead_letters ORDER BY 1').fetchall()
    assert rows == [(1, "new"), (2, "new")]
    db.downgrade(pgc, "base")
