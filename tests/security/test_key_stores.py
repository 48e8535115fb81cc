"""The key store contract on PostgreSQL (tests/core/test_protect_keystore.py runs it in memory and on a directory),
and the `directory` key store outside the database: a forget survives a restore of the directory from a copy taken
before it (`kafold keys reapply` on Apache Kafka's erasure topic)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from kafold import db, protect
from kafold.config import KafkaConfig, PostgresConfig
from kafold.keystore_dir import DirectoryKeyStore
from kafold.protect import KeyStore, PgKeyStore
from kafold.testing import free_port
from tests.aggregates.agg_support import (
    PLACEHOLDER,
    customer_client,
    kafold_cli,
    master_key,
    protected_customer_toml,
)
from tests.core.test_protect_keystore import KeyStoreContract

pytestmark = pytest.mark.integration


class TestPgKeyStore(KeyStoreContract):
    @pytest.fixture(autouse=True)
    def _schema(self, pg_url: str, unique: str) -> Iterator[None]:
        self.pgc = PostgresConfig(url=pg_url, schema="ks_" + re.sub(r"\W", "_", unique[-8:]))
        db.upgrade(self.pgc)
        yield
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(self.pgc.schema)))

    def make(self) -> KeyStore:
        return PgKeyStore(self.pgc)


def test_the_directory_store_keeps_keys_out_of_the_database_and_a_restored_copy_gets_the_forget_back(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    master_key(monkeypatch)
    keys = tmp_path / "keys"
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port()).replace(
        "[privacy]\n", f'[privacy]\nkey_store = "directory"\nkey_store_dir = "{keys}"\n', 1))
    cfg, client = customer_client(conf, kafka_config)
    client.close()
    db.upgrade(cfg.postgres)
    writer = protect.build(cfg)
    assert writer is not None and isinstance(writer.ring.store, DirectoryKeyStore)
    emails = {"gone": "gone.secret@example.com", "kept": "kept.secret@example.com"}
    sealed = {s: writer.seal("customer", "Registered", s, {"email": e}) for s, e in emails.items()}
    assert PgKeyStore(cfg.postgres).get("gone") is None  # nothing of it in PostgreSQL
    shutil.copytree(keys, tmp_path / "backup")
    forget = kafold_cli("subjects", "forget", "gone", "-c", str(conf), "--yes", check=True)
    assert "key deleted" in forget.stdout
    shutil.rmtree(keys)
    shutil.copytree(tmp_path / "backup", keys)  # the directory restored from before the forget
    kafold_cli("keys", "reapply", "-c", str(conf), check=True)
    reader = protect.Protector(writer.rules, protect.KeyRing(protect.cipher(cfg.privacy), DirectoryKeyStore(keys)),
                               PLACEHOLDER)
    assert reader.unseal("customer", "Registered", "gone", sealed["gone"])["email"] == PLACEHOLDER
    assert reader.unseal("customer", "Registered", "kept", sealed["kept"])["email"] == emails["kept"]
