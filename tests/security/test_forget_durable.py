"""Forgets that last, on Apache Kafka and PostgreSQL: a forget survives a restore of the database from a backup taken
before it (the erasure log re-applied by `kafold db upgrade` and by a daemon's start); a deleted key's bytes leave
the keys table's data file once purged; a master-key rotation interrupted mid-way resumes and completes."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql

from kafold import config, db, key_rotation, protect
from kafold.config import KafkaConfig, KafoldConfig
from kafold.protect import Cipher, KeyRing, PgKeyStore, Protector
from kafold.testing import free_port
from tests.aggregates.agg_support import (
    MASTER_VAR,
    PLACEHOLDER,
    customer_client,
    customer_rows,
    kafold_cli,
    master_key,
    protected_customer_toml,
    ready_daemon,
    register,
)
from tests.support import wait_for

pytestmark = pytest.mark.integration
TABLES = ("subject_keys", "erasures")


@pytest.fixture
def setup(kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, KafoldConfig, str]]:
    """A protected `customer` configuration in a schema of its own (so the test can back up and restore its keys
    tables whole), its topics created and its tables migrated; (config file, configuration, schema)."""
    master_key(monkeypatch)
    schema = "fd_" + re.sub(r"\W", "_", unique[-8:])
    conf = tmp_path / "kafold.toml"
    toml = protected_customer_toml(kafka_config, pg_url, unique, free_port())
    conf.write_text(toml.replace(f'url = "{pg_url}"', f'url = "{pg_url}"\nschema = "{schema}"', 1))
    cfg, client = customer_client(conf, kafka_config)
    client.close()
    db.upgrade(cfg.postgres)
    yield conf, cfg, schema
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _tables(pg_url: str, schema: str, action: str) -> None:
    """`backup`: copy the keys and erasures tables aside; `restore`: put the copies back (as a restore of last
    night's dump would)."""
    with psycopg.connect(pg_url, autocommit=True) as conn, conn.transaction():
        for table in TABLES:
            live, copy = sql.Identifier(schema, table), sql.Identifier(schema, f"backup_{table}")
            if action == "backup":
                conn.execute(sql.SQL("CREATE TABLE {} AS TABLE {}").format(copy, live))
            else:
                conn.execute(sql.SQL("DELETE FROM {}").format(live))
                conn.execute(sql.SQL("INSERT INTO {} OVERRIDING SYSTEM VALUE SELECT * FROM {}").format(live, copy))


def _fresh(cfg: KafoldConfig) -> Protector:
    """A protector with empty caches, as a new process has."""
    found = protect.setup(cfg)
    assert found is not None
    return Protector(found.rules, KeyRing(protect.cipher(cfg.privacy), PgKeyStore(cfg.postgres)),
                     cfg.privacy.placeholder)


def _read(protector: Protector, subject: str, sealed: dict[str, Any]) -> Any:
    return protector.unseal("customer", "Registered", subject, sealed)["email"]


def test_a_forget_survives_a_restore_of_the_database_and_db_upgrade_reapplies_it(
        setup: tuple[Path, KafoldConfig, str], pg_url: str) -> None:
    conf, cfg, schema = setup
    writer = protect.build(cfg)
    assert writer is not None
    emails = {"gone": "gone.secret@example.com", "kept": "kept.secret@example.com"}
    sealed = {s: writer.seal("customer", "Registered", s, {"email": e}) for s, e in emails.items()}
    _tables(pg_url, schema, "backup")
    assert writer.ring.forget("gone", "test:dpo") is True
    assert writer.ring.erasure_log is not None
    writer.ring.erasure_log.close()
    assert _read(_fresh(cfg), "gone", sealed["gone"]) == PLACEHOLDER
    _tables(pg_url, schema, "restore")
    assert _read(_fresh(cfg), "gone", sealed["gone"]) == emails["gone"]  # what a restore alone brings back

    upgrade = kafold_cli("db", "upgrade", "-c", str(conf), timeout=120)
    assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
    assert "1 keys of forgotten subjects deleted again" in upgrade.stdout
    fresh = _fresh(cfg)
    assert _read(fresh, "gone", sealed["gone"]) == PLACEHOLDER
    assert _read(fresh, "kept", sealed["kept"]) == emails["kept"]
    with psycopg.connect(pg_url) as conn:
        actors = [r[0] for r in conn.execute(sql.SQL("SELECT actor FROM {} ORDER BY id").format(
            sql.Identifier(schema, "erasures")))]
    assert actors == ["reapply:test:dpo"]  # the restored table lost the first record; the re-apply wrote it again
    again = kafold_cli("db", "upgrade", "-c", str(conf), check=True, timeout=120)
    assert "deleted again" not in again.stdout  # nothing behind the log any more


def test_a_daemon_started_on_a_restored_database_reapplies_the_forget_before_it_serves(
        setup: tuple[Path, KafoldConfig, str], pg_url: str, kafka_config: KafkaConfig) -> None:
    conf, cfg, schema = setup
    _, client = customer_client(conf, kafka_config)
    emails = {"gone": "gone.secret@example.com", "kept": "kept.secret@example.com"}
    try:
        with ready_daemon(conf) as d:
            register(client, emails)
            _tables(pg_url, schema, "backup")
            status, _ = d.call("POST", "/subjects/gone/forget")
            assert status == 200
        _tables(pg_url, schema, "restore")
        assert PgKeyStore(cfg.postgres).get("gone") is not None  # the restore brought the key back
        with ready_daemon(conf) as d:
            assert d.get("/aggregates/customer/gone")[1]["state"]["email"] == PLACEHOLDER
            assert d.get("/aggregates/customer/kept")[1]["state"]["email"] == emails["kept"]
        assert PgKeyStore(cfg.postgres).get("gone") is None
        with psycopg.connect(pg_url) as conn:  # and purged at that start: no purge due
            state = dict(conn.execute(sql.SQL("SELECT name, value FROM {}").format(
                sql.Identifier(schema, "key_store_state"))).fetchall())
        assert state["changes"] == state["purged_at_change"]
    finally:
        client.close()


def test_db_upgrade_on_a_restored_database_folds_the_forgotten_subjects_projection_rows_again(
        setup: tuple[Path, KafoldConfig, str], pg_url: str, kafka_config: KafkaConfig, unique: str) -> None:
    conf, _, schema = setup
    table = f"fd_rows_{unique[-8:]}"
    with_rows = protected_customer_toml(kafka_config, pg_url, unique, free_port(), table=table)
    conf.write_text(conf.read_text() + with_rows[with_rows.index("[[connectors]]"):])
    _, client = customer_client(conf, kafka_config)
    emails = {"gone": "gone.secret@example.com", "kept": "kept.secret@example.com"}
    try:
        with ready_daemon(conf) as d:
            register(client, emails)
            wait_for(lambda: set(customer_rows(pg_url, table)) == set(emails), "the rows projected")
            _tables(pg_url, schema, "backup")
            status, _ = d.call("POST", "/subjects/gone/forget")
            assert status == 200
        # no refresh after the forget: the rows are the backup's, made before it, as a restore brings them back
        _tables(pg_url, schema, "restore")
        assert customer_rows(pg_url, table)["gone"][0] == emails["gone"]

        upgrade = kafold_cli("db", "upgrade", "-c", str(conf), timeout=300)
        assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
        assert "1 keys of forgotten subjects deleted again" in upgrade.stdout
        assert f"{table}: 1 row(s) folded again" in upgrade.stdout, upgrade.stdout
        rows = customer_rows(pg_url, table)
        assert rows["gone"][0] == PLACEHOLDER and rows["kept"][0] == emails["kept"], rows
        assert "protect.restored_refreshed" in upgrade.stdout + upgrade.stderr
    finally:
        client.close()
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))


def _heap(pg_url: str, schema: str) -> tuple[Path, bytes]:
    """The keys table's data file after a checkpoint (everything in shared buffers written), and its bytes."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
        data = conn.execute("SHOW data_directory").fetchone()[0]
        rel = conn.execute("SELECT pg_relation_filepath(%s::regclass)", (f"{schema}.subject_keys",)).fetchone()[0]
    path = Path(data) / rel
    return path, path.read_bytes() if path.exists() else b""


def test_a_deleted_key_leaves_the_tables_data_file_once_purged(
        setup: tuple[Path, KafoldConfig, str], pg_url: str) -> None:
    _, cfg, schema = setup
    store = PgKeyStore(cfg.postgres)
    try:
        _heap(pg_url, schema)
    except OSError:
        pytest.skip("PostgreSQL's data directory is not readable here (an external server)")
    wrapped = os.urandom(69)
    store.create("gone", b"g" * 8, wrapped)
    store.create("kept", b"k" * 8, os.urandom(69))
    assert wrapped in _heap(pg_url, schema)[1]
    assert store.forget("gone", "h", "test:dpo", b"g" * 8) is True
    old, held = _heap(pg_url, schema)
    assert wrapped in held  # a DELETE alone leaves the bytes in the heap (a dead row version)
    assert store.purge() is True and store.purge() is False  # due once: nothing deleted since
    new, now = _heap(pg_url, schema)
    assert new != old and wrapped not in now and store.get("kept") is not None
    assert wrapped not in (old.read_bytes() if old.exists() else b"")  # the old file is truncated, then unlinked


def test_an_interrupted_rotation_resumes_from_the_cli_and_every_key_reads_under_the_new_master_key(
        setup: tuple[Path, KafoldConfig, str], monkeypatch: pytest.MonkeyPatch) -> None:
    conf, cfg, _ = setup
    old = protect.build(cfg)
    assert old is not None
    sealed = {f"s-{i:02}": old.seal("customer", "Registered", f"s-{i:02}", {"email": f"{i}@example.com"})
              for i in range(30)}
    monkeypatch.setenv("KAFOLD_TEST_PREVIOUS_MASTER", os.environ[MASTER_VAR])
    master_key(monkeypatch)  # a new master key in MASTER_VAR
    conf.write_text(conf.read_text().replace(
        f'master_key_env = "{MASTER_VAR}"',
        f'master_key_env = "{MASTER_VAR}"\nprevious_master_key_env = "KAFOLD_TEST_PREVIOUS_MASTER"'))
    rotating = config.load_file(conf).config
    store, cipher = PgKeyStore(rotating.postgres), protect.cipher(rotating.privacy)
    batches: list[key_rotation.RotationProgress] = []

    def interrupt(p: key_rotation.RotationProgress) -> None:
        batches.append(p)
        if len(batches) == 2:
            raise KeyboardInterrupt  # as a ^C between two committed batches

    with pytest.raises(KeyboardInterrupt):
        key_rotation.rotate(store, cipher, batch=10, progress=interrupt)
    assert key_rotation.pending(store, cipher) == 10
    status = orjson.loads(kafold_cli("keys", "status", "-c", str(conf), "--json", check=True).stdout)
    assert (status["keys"], status["not_under_current_master_key"]) == (30, 10)
    assert status["previous_master_key_id"] == protect.master_key_id(
        base64.b64decode(os.environ["KAFOLD_TEST_PREVIOUS_MASTER"])).hex()
    rerun = kafold_cli("keys", "rotate", "-c", str(conf), "--batch", "10", check=True)
    assert "done: 30 keys" in rerun.stdout and "(10 re-wrapped)" in rerun.stdout
    assert os.environ[MASTER_VAR] not in rerun.stdout + rerun.stderr
    new_only = Protector(old.rules, KeyRing(Cipher(base64.b64decode(os.environ[MASTER_VAR])), store))
    assert all(_read(new_only, s, v) == f"{int(s[2:])}@example.com" for s, v in sealed.items())


def test_db_upgrade_before_the_erasure_topic_exists_migrates_and_says_so(
        setup: tuple[Path, KafoldConfig, str], unique: str) -> None:
    """A deployment upgraded to a kafold with the erasure topic, before `kafold topics ensure` created it."""
    conf, _, _ = setup
    conf.write_text(conf.read_text().replace(f'erasure_topic = "{unique}.erasures"',
                                             f'erasure_topic = "{unique}.not-yet"'))
    upgrade = kafold_cli("db", "upgrade", "-c", str(conf), check=True, timeout=120)
    assert "protect.erasure_topic_missing" in upgrade.stdout + upgrade.stderr
