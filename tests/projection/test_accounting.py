"""Offset accounting: after a run with duplicates, stale events, poison records, refused events and unknown types
(skipped by one projection, dead-lettered by another), per partition records seen = applied + duplicates + stale +
dead-lettered + skipped, with exactly the counts sent, on /status, /metrics and `kafold status` (tasks in the daemon's
process, and in child processes whose reports carry the counts)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from kafold import db
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.api import Outcomes, TopicPartition
from kafold.daemon.accounting import Account, Seen, accounts
from kafold.envelope import Event
from kafold.schema import toml_value
from tests.daemon.daemon_support import daemon_in_process
from tests.projection.projection_support import (
    COLUMNS,
    RULES,
    deposited,
    encoded,
    ends_of,
    history,
    settings,
    table_name,
    wait_for_offsets,
)
from tests.support import create_topic, free_port, kafka_toml, produce, wait_for

PARTITIONS = 2


def _config(path: Path, kafka: KafkaConfig, pg_url: str, unique: str, port: int, topic: str,
            connectors: dict[str, tuple[str, str]], processes: bool, dedup: str) -> Path:
    rules = "".join("\n[[connectors.config.on]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in rule.items())
                    for rule in RULES)
    body = "".join(f"""
[[connectors]]
name = "{name}"
class = "postgres-projection"
topics = ["{topic}"]
on_unknown_type = "{policy}"

[connectors.config]
table = "{table}"
key_columns = ["account_id"]
columns = {toml_value(COLUMNS)}
dedup = "{dedup}"
{rules}""" for name, (table, policy) in connectors.items())
    path.write_text(f"""
{kafka_toml(kafka)}
[postgres]
url = "{pg_url}"

[daemon]
group_prefix = "{unique}"
http_port = {port}
batch_max_records = 7
batch_max_wait_ms = 50
shutdown_grace_s = 5
task_processes = {str(processes).lower()}
{body}""")
    return path


def _status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


def _settled(port: int, seen: dict[tuple[str, int], int]) -> bool:
    """Every record sent seen, on every partition of every connector, and accounted for (no write in flight). The
    stored checkpoints alone do not say it: a batch's write may commit before its runner counts the batch."""
    rows = _status(port)["accounting"]
    return {(r["connector"], r["partition"]): r["seen"] for r in rows} == seen \
        and all(r["unaccounted"] == 0 for r in rows)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("processes", [False, True], ids=["in-process", "task-processes"])
@pytest.mark.parametrize("dedup", ["auto", "tracking"])  # auto: by version here (kafold envelopes)
def test_records_seen_equal_applied_duplicates_stale_dead_lettered_and_skipped_per_partition(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path,
        processes: bool, dedup: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, partitions=PARTITIONS)
    skipping, dead_lettering = f"{unique}-skip", f"{unique}-dl"
    tables = {skipping: table_name(), dead_lettering: table_name()}
    for name, table in tables.items():
        create_topic(kafka_config, settings(name, topic, table).dlq_topic)
        with db.connect(pg_config) as conn:  # a rule of the user's own: a negative balance is refused
            conn.execute(sql.SQL("CREATE TABLE public.{} (account_id text PRIMARY KEY, owner text, balance bigint "
                                 "CHECK (balance >= 0), last_amount bigint, status text, "
                                 "_kafold_version bigint NOT NULL DEFAULT 0)").format(sql.Identifier(table)))
    events = history(accounts=8, deposits=3)  # acc-N in partition N % 2, versions 1..4
    duplicates = events[:6]  # the same event ids again: acc-0 (opened, 3 deposits), acc-1 (opened, 1 deposit)
    stale = [deposited("acc-4", 2, 7), deposited("acc-5", 3, 7), deposited("acc-6", 4, 7)]  # new ids, old versions
    refused = [Event.new("AccountOpened", "account", "acc-20", 1, {"name": "no owner field"}),  # the mapping
               deposited("acc-3", 5, -10_000)]  # PostgreSQL (CHECK)
    unknown = [Event.new("Mystery", "account", f"acc-{n}", 9, {}) for n in (6, 7, 1)]
    poison = [(0, b"acc-0", b"\xff\xfe not json", []), (1, b"acc-1", b"not an envelope", None)]
    items = [*encoded(events[:20], PARTITIONS), *poison, *encoded(refused, PARTITIONS),
             *encoded(events[20:], PARTITIONS), *encoded(unknown + stale + duplicates, PARTITIONS)]
    coords = produce(kafka_config, topic, items)

    def per_partition(evs: list[Event]) -> Counter[int]:
        return Counter(p for p, *_ in encoded(evs, PARTITIONS))

    seen = Counter(p for p, _ in coords)
    poisoned = Counter(p for p, *_ in poison)
    expected: dict[tuple[str, int], dict[str, int]] = {}
    for name in tables:
        skip = name == skipping
        for p in range(PARTITIONS):
            dead = poisoned[p] + per_partition(refused)[p] + (0 if skip else per_partition(unknown)[p])
            # By version a record produced twice is stale (its row is at its version already): the same records
            # are skipped, counted under `stale` instead of `duplicates`.
            again, older = ((per_partition(duplicates)[p], per_partition(stale)[p]) if dedup == "tracking"
                            else (0, per_partition(duplicates + stale)[p]))
            expected[(name, p)] = {"seen": seen[p], "applied": per_partition(events)[p],
                                   "duplicates": again, "stale": older,
                                   "dead_lettered": dead, "skipped": per_partition(unknown)[p] if skip else 0,
                                   "unaccounted": 0}
    assert all((v["duplicates"] or dedup != "tracking") and v["stale"] and v["dead_lettered"]
               for v in expected.values())  # every kind sent

    port = free_port()
    conf = _config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, port, topic,
                   {skipping: (tables[skipping], "skip"), dead_lettering: (tables[dead_lettering], "dead-letter")},
                   processes, dedup)
    with daemon_in_process(conf):
        for name in tables:
            wait_for_offsets(pg_config, name, topic, ends_of(coords))
        wait_for(lambda: _settled(port, {k: v["seen"] for k, v in expected.items()}),
                 "every record seen and accounted for")
        rows = _status(port)["accounting"]
        got = {(r["connector"], r["partition"]): {k: r[k] for k in expected[(skipping, 0)]} for r in rows}
        assert got == expected
        for r in rows:  # the identity, as documented
            assert r["seen"] == sum(r[k] for k in ("applied", "duplicates", "stale", "dead_lettered", "skipped",
                                                   "unaccounted"))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        for (name, p), counts in expected.items():
            labels = f'connector="{name}",partition="{p}",task="0",topic="{topic}"'
            assert _sample(metrics, "kafold_records_seen_total", labels) == counts["seen"]
            assert _sample(metrics, "kafold_records_unaccounted", labels) == 0
            for outcome in ("applied", "duplicates", "stale", "dead_lettered", "skipped"):
                assert _sample(metrics, "kafold_records_outcome_total",
                               f'connector="{name}",outcome="{outcome}",partition="{p}",task="0",topic="{topic}"'
                               ) == counts[outcome]
        kafold = str(Path(sys.executable).parent / "kafold")
        shown = subprocess.run([kafold, "status", "-c", str(conf), "--json"], capture_output=True, text=True,
                               timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["accounting"] == rows
        text = subprocess.run([kafold, "status", "-c", str(conf)], capture_output=True, text=True, timeout=60)
        assert text.returncode == 0 and "UNACCOUNTED" in text.stdout and "DUPLICATES" in text.stdout


def test_a_task_that_does_not_tell_has_every_record_put_counted_as_applied_and_a_lost_record_shows() -> None:
    tp = TopicPartition("t", 0)
    seen = {tp: Seen(seen=10, dead_lettered=2, skipped=1)}
    assert accounts(seen, None)[tp] == Account(tp, 10, 7, 0, 0, 2, 1)
    told = accounts(seen, {tp: Outcomes(applied=4, duplicates=1, stale=1, dead_lettered=0)})[tp]
    assert (told.dead_lettered, told.unaccounted) == (2, 1)  # one record put whose outcome nobody knows


def _sample(text: str, name: str, labels: str) -> float:
    """The value of one sample of the Prometheus text (labels in the order prometheus_client writes them)."""
    found = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name}{{{labels}}} not in /metrics"
    return float(found.group(1))
