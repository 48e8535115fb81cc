"""`kafold projection verify`: a live projection verifies clean (its poison records, duplicates and a row its own
CHECK refused included), also while live traffic flows; a row changed, deleted or added behind kafold's back is named
(key, column, live, expected) and the command exits non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from kafold import db
from kafold.config import KafkaConfig, PostgresConfig
from tests.projection.projection_support import (
    deposited,
    encoded,
    ends_of,
    fold,
    history,
    running,
    settings,
    table_name,
    wait_for_offsets,
)
from tests.projection.test_projection_kill9 import write_config
from tests.projection.test_rebuild import PARTITIONS, Producer, traffic
from tests.support import create_topic, produce, wait_for


def _verify(conf: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(Path(sys.executable).parent / "kafold"), "projection", "verify", name, "-c", str(conf), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def _logged(stderr: str) -> set[str]:
    """The events of the JSON log lines on a command's stderr."""
    return {json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")}


def _scratch_left(pgc: PostgresConfig, table: str, name: str) -> list[Any]:
    """Tables and bookkeeping a verify leaves behind (none expected)."""
    with db.connect(pgc) as conn:
        tables = conn.execute("SELECT relname FROM pg_class WHERE relname LIKE %s AND relkind = 'r'",
                              (f"{table}_kafold%",)).fetchall()
        books = [conn.execute(f"SELECT count(*) FROM kafold.{t} WHERE {c} = %s", (f"{name}:verify",)).fetchone()
                 for t, c in (("checkpoints", "connector"), ("tracking", "projection"), ("tombstones", "namespace"),
                              ("dead_letters", "connector"))]
    return [*tables, *(b for b in books if b and b[0])]


@pytest.mark.timeout(400)
def test_verify_is_clean_on_a_live_table_also_under_traffic_and_names_rows_changed_behind_kafolds_back(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=PARTITIONS)
    with db.connect(pg_config) as conn:  # the user's table, with a rule of its own
        conn.execute(sql.SQL("CREATE TABLE public.{} (account_id text PRIMARY KEY, owner text, balance bigint "
                             "CHECK (balance >= 0), last_amount bigint, status text, "
                             "_kafold_version bigint NOT NULL DEFAULT 0)").format(sql.Identifier(table)))
    first = history(accounts=120, deposits=9, close_every=7)
    poison = (1, b"acc-1", b"not an envelope", None)  # dead-lettered by the live connector and skipped by the fold
    refused = deposited("acc-3", 11, -10_000)  # the CHECK refuses it, live and in the fold: acc-3 held in both
    coords = produce(kafka_config, topic, [*encoded(first[:300], PARTITIONS), poison,
                                           *encoded(first[300:], PARTITIONS), *encoded([refused], PARTITIONS),
                                           *encoded(first[:20], PARTITIONS)])
    conf = write_config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, topic, table)
    with running(kafka_config, pg_config, settings(unique, topic, table), unique, batch=100) as live:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), live)
        quiet = _verify(conf, unique, "--json")
        assert quiet.returncode == 0, quiet.stderr
        report = json.loads(quiet.stdout)
        assert report["clean"] and report["rows_differing"] == 0 and report["differences"] == []
        assert report["live_rows"] == report["expected_rows"] == len(fold(first))
        assert sum(c["next_offset"] for c in report["checkpoints"]) == len(coords)

        # Live traffic flows throughout the verify: it compares a snapshot, still clean.
        producer = Producer(kafka_config, topic, traffic(120, 10))
        producer.start()
        try:
            wait_for(lambda: producer.produced(200), "live traffic to flow")
            before = len(producer.events)
            busy = _verify(conf, unique, "--json")
            assert producer.produced(before + 1)  # produced while the verify ran
        finally:
            producer.halt.set()
            producer.join(30)
        assert producer.error is None
        assert busy.returncode == 0, busy.stdout + busy.stderr
        busy_report = json.loads(busy.stdout)
        assert busy_report["clean"] and busy_report["expected_rows"] == busy_report["live_rows"] > 0
        assert sum(c["next_offset"] for c in busy_report["checkpoints"]) > len(coords)  # a snapshot with traffic
        all_coords = coords + producer.coords
        wait_for_offsets(pg_config, unique, topic, ends_of(all_coords), live)
    expected = fold(first + producer.events)

    # Behind kafold's back: a changed balance, a deleted row, an extra row.
    with db.connect(pg_config) as conn:
        conn.execute(f'UPDATE public."{table}" SET balance = 999999 WHERE account_id = %s', ("acc-1",))
        conn.execute(f'DELETE FROM public."{table}" WHERE account_id = %s', ("acc-2",))
        conn.execute(f'INSERT INTO public."{table}" (account_id, owner, balance, status) VALUES '
                     "('zz-extra', 'mallory', 5, 'open')")
    tampered = _verify(conf, unique, "--json")
    assert tampered.returncode == 1, tampered.stdout + tampered.stderr
    found = json.loads(tampered.stdout)
    assert not found["clean"] and found["completed"] and found["rows_differing"] == 3
    by_kind = {(d["kind"], d["key"]["account_id"]): d for d in found["differences"]}
    assert set(by_kind) == {("changed", "acc-1"), ("missing", "acc-2"), ("extra", "zz-extra")}
    changed = by_kind[("changed", "acc-1")]
    assert (changed["column"], changed["live"], changed["expected"]) == (
        "balance", "999999", str(expected["acc-1"]["balance"]))
    assert json.loads(by_kind[("missing", "acc-2")]["expected"])["balance"] == expected["acc-2"]["balance"]
    assert json.loads(by_kind[("extra", "zz-extra")]["live"])["owner"] == "mallory"
    # The text output names the same rows, columns and values.
    text = _verify(conf, unique, "--no-progress")
    assert text.returncode == 1
    assert "3 row(s) differ" in text.stdout
    for word in ("changed", "account_id=acc-1", "balance", "999999", "missing", "account_id=acc-2", "extra",
                 "account_id=zz-extra"):
        assert word in text.stdout, text.stdout
    assert _logged(text.stderr) >= {"verify.started", "verify.done"}, text.stderr  # named for what it does
    assert not any(e.startswith("rebuild.") for e in _logged(text.stderr)), text.stderr
    assert _scratch_left(pg_config, table, unique) == []

    # One verify of a projection at a time: while another run holds the lock, a verify refuses and leaves that
    # run's scratch table alone.
    theirs = f"{table[:44]}_kafold_expected"
    with db.connect(pg_config) as other:
        other.execute("SELECT pg_advisory_lock(hashtext(%s))", (f"kafold.verify:{unique}",))
        other.execute(sql.SQL("CREATE TABLE public.{} (account_id text)").format(sql.Identifier(theirs)))
        refused = _verify(conf, unique, "--no-progress")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"a verify of {unique!r} is already running" in refused.stderr, refused.stderr
        assert _scratch_left(pg_config, table, unique) == [(theirs,)]
        other.execute(sql.SQL("DROP TABLE public.{}").format(sql.Identifier(theirs)))
