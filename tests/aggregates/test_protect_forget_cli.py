"""A `kafold subjects forget` run beside a live daemon (another process): the daemon's aggregate runtime sees the
erasure (kafold.protect.ErasureWatch) and reloads the forgotten subject's state with the placeholder; another
subject's state is unchanged."""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

import orjson
import pytest

from kafold import config, topics
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.test_idempotency import Outside
from tests.aggregates.test_protect_daemon import KAFOLD, MASTER_VAR, PLACEHOLDER, _config
from tests.daemon.daemon_support import daemon_in_process
from tests.support import child_env, wait_for
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


def test_a_forget_from_the_cli_reloads_the_running_daemons_state(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MASTER_VAR, base64.b64encode(os.urandom(32)).decode())
    receiver = Receiver()
    conf = _config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, free_port(), f"customers_{unique[-8:]}",
                   receiver.start())
    loaded = config.load_file(conf)
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    client = Outside(kafka_config, loaded.config.aggregates[0])
    # subjects of this test only: the tests share one PostgreSQL, each with a master key of its own
    kept, gone = f"{unique[-8:]}-kept", f"{unique[-8:]}-gone"
    emails = {kept: "kept.secret@example.com", gone: "gone.secret@example.com"}
    try:
        with daemon_in_process(conf) as d:
            wait_for(lambda: d.get("/ready")[0] == 200, "the daemon ready", 120)
            for cid, email in emails.items():
                client.send(f"reg-{cid}", cid, "Register", {"email": email, "name": cid.upper()})
            client.wait()
            assert d.get(f"/aggregates/customer/{gone}")[1]["state"]["email"] == emails[gone]
            forget = subprocess.run([KAFOLD, "subjects", "forget", gone, "-c", str(conf), "--json"],
                                    capture_output=True, text=True, timeout=120, env=child_env())
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
            assert d.get(f"/aggregates/customer/{gone}")[1]["state"] == {"email": PLACEHOLDER, "name": "Bob"}
    finally:
        client.close()
        receiver.stop()
