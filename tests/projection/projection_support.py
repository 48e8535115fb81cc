"""Helpers for projection tests: the accounts projection, an independent fold, and a runner driven to the end."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from kafold import db
from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig, PostgresConfig
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner
from kafold.envelope import Event, encode
from kafold.errors import RetriableError
from tests.support import wait_for

COLUMNS = {"account_id": "text", "owner": "text", "balance": "bigint", "last_amount": "bigint", "status": "text"}
RULES: list[dict[str, Any]] = [
    {"type": "AccountOpened", "set": {"owner": "payload.owner", "status": "'open'", "balance": 0}},
    {"type": "MoneyDeposited", "action": "update", "increment": {"balance": "payload.amount"},
     "set": {"last_amount": "payload.amount"}},
    {"type": "AccountClosed", "action": "delete"},
]


def projection_config(table: str, **extra: Any) -> dict[str, Any]:
    return {"table": table, "key_columns": ["account_id"], "columns": COLUMNS, "on": RULES, **extra}


def settings(name: str, topic: str, table: str, **extra: Any) -> ConnectorConfig:
    on_unknown = extra.pop("on_unknown_type", "skip")
    return ConnectorConfig(name=name, connector_class="postgres-projection", topics=[topic],
                           on_unknown_type=on_unknown, config=projection_config(table, **extra))


def table_name() -> str:
    return f"acc_{uuid.uuid4().hex[:10]}"


def opened(account: str, owner: str = "ada") -> Event:
    return Event.new("AccountOpened", "account", account, 1, {"owner": owner})


def deposited(account: str, version: int, amount: int) -> Event:
    return Event.new("MoneyDeposited", "account", account, version, {"amount": amount})


def closed(account: str, version: int) -> Event:
    return Event.new("AccountClosed", "account", account, version, {})


def history(accounts: int, deposits: int, close_every: int = 0) -> list[Event]:
    """Per account: opened, `deposits` deposits, and a close for every `close_every`-th account."""
    out: list[Event] = []
    for a in range(accounts):
        acc = f"acc-{a}"
        out.append(opened(acc, f"owner-{a}"))
        out += [deposited(acc, v + 2, a + v + 1) for v in range(deposits)]
        if close_every and a % close_every == 0:
            out.append(closed(acc, deposits + 2))
    return out


def fold(events: Iterable[Event]) -> dict[str, dict[str, Any]]:
    """The expected table, computed independently: unique event ids, each aggregate's events by version."""
    unique: dict[str, Event] = {}
    for e in events:
        unique.setdefault(e.event_id, e)
    rows: dict[str, dict[str, Any]] = {}
    for e in sorted(unique.values(), key=lambda e: (e.aggregate_id, e.version)):
        row = rows.get(e.aggregate_id)
        if e.type == "AccountOpened":
            rows[e.aggregate_id] = {"owner": e.payload["owner"], "balance": 0, "last_amount": None,
                                    "status": "open", "_kafold_version": e.version}
        elif e.type == "MoneyDeposited" and row is not None:
            row.update(balance=row["balance"] + e.payload["amount"], last_amount=e.payload["amount"],
                       _kafold_version=e.version)
        elif e.type == "AccountClosed":
            rows.pop(e.aggregate_id, None)
    return rows


def read_table(pgc: PostgresConfig, table: str) -> dict[str, dict[str, Any]]:
    from psycopg import sql
    from psycopg.rows import dict_row

    with db.connect(pgc, row_factory=dict_row) as conn:
        rows = conn.execute(sql.SQL("SELECT * FROM public.{}").format(sql.Identifier(table))).fetchall()
    return {r.pop("account_id"): dict(r) for r in rows}


def stored_offsets(pgc: PostgresConfig, connector: str, topic: str) -> dict[int, int]:
    with db.connect(pgc) as conn:
        rows = conn.execute("SELECT partition, next_offset FROM kafold.checkpoints WHERE connector = %s AND "
                            "topic = %s", (connector, topic)).fetchall()
    return dict(rows)


def dead_letters(pgc: PostgresConfig, connector: str) -> list[tuple[Any, ...]]:
    with db.connect(pgc) as conn:
        return conn.execute('SELECT topic, partition, "offset", reason, error_class, error_message FROM '
                            'kafold.dead_letters WHERE connector = %s ORDER BY partition, "offset"',
                            (connector,)).fetchall()


def encoded(events: Iterable[Event], partitions: int) -> list[tuple[int, bytes | None, bytes | None, Any]]:
    """Produce items placing each aggregate in a fixed partition (as a key partitioner would)."""
    return [(int(e.aggregate_id.rpartition("-")[2]) % partitions, *encode(e)) for e in events]


def thirds(items: list[Any]) -> list[list[Any]]:
    """`items` cut into three consecutive parts (produced one by one between faults)."""
    n = len(items)
    return [items[: n // 3], items[n // 3: 2 * n // 3], items[2 * n // 3:]]


def ends_of(coords: list[tuple[int, int]]) -> dict[int, int]:
    ends: dict[int, int] = {}
    for p, o in coords:
        ends[p] = max(ends.get(p, 0), o + 1)
    return ends


@contextmanager
def running(kafka: KafkaConfig, pgc: PostgresConfig, cfg: ConnectorConfig, group_prefix: str,
            batch: int = 500) -> Iterator[SinkRunner]:
    """A SinkRunner of the projection in a thread, given the [postgres] section as the daemon host would."""
    connector = instantiate(cfg, Path("."))
    task_config = connector.task_configs(1)[0].with_services(postgres=pgc)
    runner = SinkRunner(connector, task_config, kafka=kafka,
                        daemon=DaemonConfig(group_prefix=group_prefix, batch_max_records=batch, shutdown_grace_s=5))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        runner.stop()
        thread.join(60)
    # A helper module: pytest does not rewrite its asserts, so the message says what failed.
    assert not thread.is_alive(), f"the {cfg.name} runner did not stop within 60 s (state {runner.state})"


def wait_for_offsets(pgc: PostgresConfig, connector: str, topic: str, ends: dict[int, int],
                     runner: SinkRunner | None = None, timeout: float = 90) -> None:
    def done() -> bool:
        if runner is not None and runner.failed:
            raise AssertionError(f"the task failed: {runner.error!r}")
        try:
            return stored_offsets(pgc, connector, topic) == ends
        except (psycopg.Error, RetriableError):  # PostgreSQL restarting, or the task has not migrated yet
            return False
    wait_for(done, f"stored offsets {ends}", timeout)
