"""Natural batching on the real daemon (issue 34): with `batch_max_wait_ms` at a minute, a lone event still reaches its
PostgreSQL row and a lone command still gets its result within seconds (a batch is handed over with what was
fetched; nobody waits for it to fill), and a burst still goes in batches of more than one record.

No timings are measured: the 20 s bounds are far below the configured minute a fill-wait would take."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg

from kafold import config, topics
from kafold.client import CommandClient
from kafold.config import KafkaConfig
from kafold.envelope import Event, encode
from kafold.testing import free_port
from tests.aggregates.agg_support import accounts_projection_toml, bank_daemon_toml
from tests.support import produce, wait_for
from tests.support.daemons import daemon_thread

FILL_WAIT_MS = 60_000  # what a batch would wait to fill without natural batching
BOUND_S = 20.0  # far below FILL_WAIT_MS
BURST = 500


def _config(path: Path, kafka: KafkaConfig, pg_url: str, unique: str, table: str, port: int) -> Path:
    daemon_extra = f"batch_max_records = 1000\nbatch_max_wait_ms = {FILL_WAIT_MS}\nshutdown_grace_s = 4.0"
    head = bank_daemon_toml(kafka, unique, port, daemon_extra=daemon_extra).replace("batch_max_wait_ms = 100\n", "")
    path.write_text(f"""{head}
[postgres]
url = "{pg_url}"

{accounts_projection_toml("accounts-" + table, unique + ".events", table)}
""")
    return path


def _balance(pg_url: str, table: str, account: str) -> int | None:
    try:
        with psycopg.connect(pg_url) as conn:
            row = conn.execute(f'SELECT balance FROM "{table}" WHERE account_id = %s', (account,)).fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    return None if row is None else int(row[0])


def _runner_counts(host: Any) -> dict[str, int]:
    return dict(host.groups[0].slots[0].runner.counts)


def test_a_lone_record_is_handed_over_at_once_and_a_burst_goes_in_batches(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    table, port = f"nb_{uuid.uuid4().hex[:10]}", free_port()
    conf = _config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, table, port)
    loaded = config.load_file(conf)
    assert loaded.config.daemon.batch_max_wait_ms == FILL_WAIT_MS
    agg = loaded.config.aggregates[0]
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    events_topic = agg.topic("events")
    with daemon_thread(conf) as (host, _), CommandClient(kafka_config, agg) as client:
        runtime = host.aggregates["account"].runtime
        wait_for(lambda: runtime.ready, "the aggregate runtime live", 90)
        wait_for(lambda: host.groups[0].slots[0].runner.assigned, "the projection's partition assigned", 90)

        # A lone command: its result comes back (the batch of one is decided and committed at once).
        opened = client.send(client.command("lone", "OpenAccount", {"owner": "lo"}), timeout=BOUND_S)
        assert opened is not None and opened.accepted, opened
        # the runtime counts a batch once its commit call returns, which can be after the result is already visible
        wait_for(lambda: runtime.counts["commands"] >= 1, "the lone command counted", BOUND_S)
        assert runtime.counts["batches"] == 1 and runtime.counts["commands"] == 1
        # ...and its event reaches the row (one record fetched: handed over without waiting for 999 more).
        wait_for(lambda: _balance(pg_url, table, "lone") == 0, "the lone account's row", BOUND_S)

        # A lone event from an independent producer (not through the aggregate) reaches its row as well.
        key, value, headers = encode(Event.new("MoneyDeposited", "account", "lone", 2, {"amount": 7}))
        produce(kafka_config, events_topic, [(0, key, value, headers)])
        wait_for(lambda: _balance(pg_url, table, "lone") == 7, "the lone deposit's row", BOUND_S)

        # A burst: batches grow by themselves, so they hold more than one record.
        before = _runner_counts(host)
        agg_before = dict(runtime.counts)
        cmds = [client.command(f"burst-{i}", "OpenAccount", {"owner": f"o{i}"}) for i in range(BURST)]
        results = client.send_many(cmds, timeout=BOUND_S * 3)
        assert len(results) == BURST and all(r.accepted for r in results.values())
        wait_for(lambda: _balance(pg_url, table, f"burst-{BURST - 1}") == 0, "the burst's last row", BOUND_S * 3)
        wait_for(lambda: _runner_counts(host)["records"] - before["records"] >= BURST, "the burst projected",
                 BOUND_S)
        after = _runner_counts(host)
        commands = runtime.counts["commands"] - agg_before["commands"]
        transactions = runtime.counts["batches"] - agg_before["batches"]
        records, batches = after["records"] - before["records"], after["batches"] - before["batches"]
        assert commands == BURST and 0 < transactions < commands, (commands, transactions)
        assert records >= BURST and 0 < batches < records, (records, batches)
