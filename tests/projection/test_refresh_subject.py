"""`kafold projection refresh NAME --subject S` beside a live daemon (Apache Kafka, real PostgreSQL): after
`kafold subjects forget S`, S's rows hold the placeholder and the rest of their columns as folded; another subject's
rows keep their clear values; commands decided while the refresh runs are not lost; the table then equals a fold of
its events (`projection verify` clean); a subject without rows is reported as such; an unknown projection and one
of unprotected event types are refused."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from kafold import db
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import (
    KAFOLD,
    PLACEHOLDER,
    customer_client,
    master_key,
    protected_customer_toml,
    ready_daemon,
    register,
)
from tests.aggregates.agg_support import customer_rows as _rows
from tests.aggregates.agg_support import kafold_cli as _cli
from tests.projection.test_projection_verify import _logged
from tests.support import child_env, wait_for
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


def test_refresh_folds_a_forgotten_subjects_rows_again_under_live_traffic(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    master_key(monkeypatch)
    receiver = Receiver()
    table = f"customers_{unique[-8:]}"
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port(), table=table,
                                            hook=receiver.start()))
    _, client = customer_client(conf, kafka_config)
    # subjects of this test only: the tests share one PostgreSQL, each with a master key of its own
    kept, gone = f"{unique[-8:]}-kept", f"{unique[-8:]}-gone"
    emails = {kept: "kept.secret@example.com", gone: "gone.secret@example.com"}
    try:
        with ready_daemon(conf):
            register(client, emails)
            for cid in emails:
                client.send(f"ren-{cid}", cid, "Rename", {"name": f"{cid}-renamed"})
            client.wait()
            wait_for(lambda: _rows(pg_url, table).get(gone) == (emails[gone], f"{gone}-renamed"), "rows projected")
            forget = _cli("subjects", "forget", gone, "-c", str(conf), "--yes")
            assert forget.returncode == 0, forget.stdout + forget.stderr
            assert _rows(pg_url, table)[gone][0] == emails[gone]  # projected before: still in clear

            # the refresh runs while commands of both subjects keep being decided and projected
            running = subprocess.Popen([KAFOLD, "projection", "refresh", table, "--subject", gone, "-c", str(conf),
                                        "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=child_env())
            n = 0
            while running.poll() is None and n < 200:
                for cid in (kept, gone):
                    client.send(f"live-{cid}-{n}", cid, "Rename", {"name": f"{cid}-{n}"})
                n += 1
                time.sleep(0.05)
            out, err = running.communicate(timeout=300)
            assert running.returncode == 0, out + err
            assert "folded again" in out, out
            logged = _logged(err)  # its log events are named for what it does, not a rebuild's
            assert logged >= {"refresh.started", "refresh.rows_replaced", "refresh.done"}, err
            assert not any(e.startswith("rebuild.") for e in logged), err
            client.send(f"last-{gone}", gone, "Rename", {"name": "last"})
            client.send(f"last-{kept}", kept, "Rename", {"name": "last"})
            client.wait()
            assert all(client.results[c][0]["status"] == "accepted" for c in (f"last-{gone}", f"last-{kept}"))
            wait_for(lambda: _rows(pg_url, table).get(gone, (None, None))[1] == "last"
                     and _rows(pg_url, table).get(kept, (None, None))[1] == "last", "the last renames projected")
            rows = _rows(pg_url, table)
            assert rows[gone] == (PLACEHOLDER, "last")
            assert rows[kept] == (emails[kept], "last")

            verify = _cli("projection", "verify", table, "-c", str(conf), "--no-progress")
            assert verify.returncode == 0, verify.stdout + verify.stderr  # the table equals a fold of its events

            nobody = _cli("projection", "refresh", table, "--subject", f"{unique[-8:]}-nobody", "-c", str(conf),
                          "--no-progress")
            assert nobody.returncode == 0 and "nothing to refresh" in nobody.stdout, nobody.stdout + nobody.stderr
            assert _rows(pg_url, table) == rows

            unknown = _cli("projection", "refresh", f"{table}-nope", "--subject", gone, "-c", str(conf))
            assert unknown.returncode == 2 and f"no connector named '{table}-nope'" in unknown.stderr, unknown.stderr
            # a projection of event types without protect rules holds no protected field: refused, naming it
            names = tmp_path / "names.toml"
            names.write_text(conf.read_text() + f"""
[[connectors]]
name = "names-{table}"
class = "postgres-projection"
topics = ["{unique}.events"]
[connectors.config]
table = "names_{table}"
key_columns = ["customer_id"]
[connectors.config.columns]
customer_id = "text"
name = "text"
[[connectors.config.on]]
type = "Renamed"
set = {{ name = "payload.name" }}
""")
            plain = _cli("projection", "refresh", f"names-{table}", "--subject", gone, "-c", str(names))
            assert plain.returncode == 2, plain.stdout + plain.stderr
            assert f"'names-{table}': none of the event types it projects has protect rules" in plain.stderr, \
                plain.stderr
    finally:
        client.close()
        receiver.stop()


def test_refresh_leaves_a_row_held_behind_a_dead_letter_and_says_so(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    master_key(monkeypatch)
    receiver = Receiver()
    table = f"customers_{unique[-8:]}"
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port(), table=table,
                                            hook=receiver.start()))
    cfg, client = customer_client(conf, kafka_config)
    count = sql.SQL("SELECT count(*) FROM {} WHERE connector = %s AND hold_key IS NOT NULL").format(
        db.table(cfg.postgres, "dead_letters"))
    held = f"{unique[-8:]}-held"

    def dead_letters(connector: str) -> int:
        with psycopg.connect(pg_url) as conn:
            row = conn.execute(count, (connector,)).fetchone()
            return int(row[0]) if row else 0

    try:
        with ready_daemon(conf):
            client.send(f"reg-{held}", held, "Register", {"email": "held.secret@example.com", "name": "first"})
            client.wait()
            wait_for(lambda: held in _rows(pg_url, table), "the row projected")
            # each in a batch of its own (a batch folds a key's events into one row write)
            client.send(f"bad-{held}", held, "Rename", {"name": "bad\u0000name"})  # PostgreSQL refuses the row
            client.wait()
            wait_for(lambda: dead_letters(table) == 1, "the refused rename dead-lettered")
            client.send(f"after-{held}", held, "Rename", {"name": "after"})  # held behind it
            client.wait()
            wait_for(lambda: dead_letters(table) == 2, "the next rename held behind it")
            before = _rows(pg_url, table)
            assert before[held] == ("held.secret@example.com", "first")
            forget = _cli("subjects", "forget", held, "-c", str(conf), "--yes")
            assert forget.returncode == 0, forget.stdout + forget.stderr

            out = _cli("projection", "refresh", table, "--subject", held, "-c", str(conf), "--no-progress")
            assert out.returncode == 1, out.stdout + out.stderr
            assert "1 row(s) of subject" in out.stdout and "held behind a dead letter" in out.stdout, out.stdout
            assert _rows(pg_url, table) == before  # left alone: the live row lacks the held rename on purpose
            assert dead_letters(f"{table}:refresh") == 0  # the refresh's own bookkeeping is gone
            assert dead_letters(table) == 2
    finally:
        client.close()
        receiver.stop()
