"""A `kafold subjects forget` run beside a live daemon (another process): the daemon's aggregate runtime sees the
erasure (kafold.protect.ErasureWatch) and reloads the forgotten subject's state with the placeholder; another
subject's state is unchanged."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest

from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import (
    PLACEHOLDER,
    customer_client,
    kafold_cli,
    live_state,
    master_key,
    protected_customer_toml,
    ready_daemon,
    register,
)
from tests.support import wait_for
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


def test_a_forget_from_the_cli_reloads_the_running_daemons_state(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    master_key(monkeypatch)
    receiver = Receiver()
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port(),
                                            table=f"customers_{unique[-8:]}", hook=receiver.start()))
    _, client = customer_client(conf, kafka_config)
    # subjects of this test only: the tests share one PostgreSQL, each with a master key of its own
    kept, gone = f"{unique[-8:]}-kept", f"{unique[-8:]}-gone"
    emails = {kept: "kept.secret@example.com", gone: "gone.secret@example.com"}
    try:
        with ready_daemon(conf) as d:
            register(client, emails)
            assert live_state(d, gone)["email"] == emails[gone]
            forget = kafold_cli("subjects", "forget", gone, "-c", str(conf), "--json", "--yes", timeout=120)
            assert forget.returncode == 0, forget.stdout + forget.stderr
            assert orjson.loads(forget.stdout)["key_deleted"] is True
            wait_for(lambda: d.get(f"/aggregates/customer/{gone}")[1]["state"].get("email") == PLACEHOLDER,
                     "the daemon's state of the subject forgotten by the CLI", 60)
            assert d.get(f"/aggregates/customer/{gone}")[1]["state"] == {"email": PLACEHOLDER, "name": gone.upper()}
            assert d.get(f"/aggregates/customer/{kept}")[1]["state"]["email"] == emails[kept]
            # a command decided after the erasure sees the placeholder state, and nothing fails
            client.send("rename-gone", gone, "Rename", {"name": "Bob"})
            client.wait()
            assert client.results["rename-gone"][0]["status"] == "accepted"
            assert live_state(d, gone, 2) == {"email": PLACEHOLDER, "name": "Bob"}
    finally:
        client.close()
        receiver.stop()


def test_a_forget_without_a_terminal_needs_yes_and_a_dry_run_changes_nothing(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from kafold import config, db, protect
    from kafold.tools import cli

    master_key(monkeypatch)
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port()))
    subject = f"{unique[-8:]}-held"
    cfg = config.load_file(conf).config
    db.upgrade(cfg.postgres)
    ring = protect.build(cfg).ring  # type: ignore[union-attr]
    ring.for_writing(subject)  # a key is held, as after a first protected event
    monkeypatch.setattr("sys.stdin", io.StringIO(subject))  # a script, no terminal: its input is not a confirmation

    assert cli.main(["subjects", "forget", subject, "-c", str(conf), "--dry-run", "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out.splitlines()[-1])["key_held"] is True
    assert cli.main(["subjects", "forget", subject, "-c", str(conf), "--json"]) == 2
    assert "pass --yes" in capsys.readouterr().err
    ring.drop()
    assert ring.lookup(subject)[1] is not None  # neither the dry run nor the refused forget deleted the key
    assert cli.main(["subjects", "forget", subject, "-c", str(conf), "--json", "--yes"]) == 0
    assert orjson.loads(capsys.readouterr().out.splitlines()[-1])["key_deleted"] is True
    ring.drop()
    assert ring.lookup(subject)[1] is None
