"""`kafold status -c FILE`: connectors, partitions, committed and end offsets, lag and state (and, from the daemon, the
offset accounting per partition: daemon/accounting.py).

From the running daemon's HTTP API (`GET /status`) when it answers; otherwise computed from Kafka: the
connector's consumer-group committed offsets against the partitions' end offsets (ListOffsets, which some
brokers under-report, so lag may read low there).
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from kafold import config, devstack
from kafold.connectors.projection import holds
from kafold.daemon import offsets
from kafold.daemon.aggregates.gate import STATUS_FIELDS
from kafold.errors import KafoldError
from kafold.terminal import visible
from kafold.tools.cli import add_config_arg

COLUMNS = ("connector", "task", "topic", "partition", "committed", "end_offset", "lag", "lag_seconds", "state")
# Effect connectors (from the daemon only): the endpoint's circuit, events held, fetching paused, parked keys.
EFFECT_COLUMNS = ("connector", "task", "endpoint", "circuit", "waiting", "in_flight", "fetch_paused", "parked_keys")
# The offset accounting (from the daemon only): seen = applied + duplicates + stale + dead_lettered + skipped, per
# partition; `unaccounted` is a write in flight, or a record lost on the way when it stays above 0.
ACCOUNTING_COLUMNS = ("connector", "task", "topic", "partition", "seen", "applied", "duplicates", "stale",
                      "dead_lettered", "skipped", "unaccounted")


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="connectors, partitions, offsets, lag and state (daemon or Kafka)")
    add_config_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--offline", action="store_true", help="do not ask the daemon; compute from Kafka")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    cfg = devstack.effective(loaded.config, need=("kafka",))
    report = None if args.offline else from_daemon(cfg)
    if report is None:
        report = from_kafka(cfg)
    held = held_keys(loaded.config)
    if held is not None:
        report["held_keys"] = held
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(f"source: {report['source']}")
        print(table(report["partitions"]))
        if report.get("effects"):
            print(table(report["effects"], EFFECT_COLUMNS))
        if report.get("accounting"):
            print(table(report["accounting"], ACCOUNTING_COLUMNS))
        if report.get("aggregates"):
            print(table(report["aggregates"], ("aggregate", *STATUS_FIELDS)))
        for name, n in sorted((held or {}).items()):
            hint = f" (kafold dlq list --connector {name} --status all)" if n else ""
            print(visible(f"held keys of {name}: {n}{hint}"))
    return 0


def held_keys(cfg: config.KafoldConfig) -> dict[str, Any] | None:
    """Per postgres-projection connector, the row keys waiting behind a dead letter (from PostgreSQL); None when
    there is no projection; the error text per connector when PostgreSQL cannot be read."""
    names = [c.name for c in cfg.connectors if c.connector_class == "postgres-projection"]
    if not names:
        return None

    try:
        counts = holds.held_keys(devstack.effective(cfg, need=("postgres",)).postgres)
    except (KafoldError, OSError) as e:
        return {name: f"unknown: {e}" for name in names}
    except Exception as e:  # psycopg's errors: PostgreSQL reachable but not answering this (not migrated yet)
        return {name: f"unknown: {type(e).__name__}: {e}" for name in names}
    return {name: counts.get(name, 0) for name in names}


def from_daemon(cfg: config.KafoldConfig, timeout: float = 3.0) -> dict[str, Any] | None:
    """The daemon's own report, or None when it does not answer (not running, HTTP disabled, refused)."""
    d = cfg.daemon
    if not d.http_port:
        return None
    host = "127.0.0.1" if d.http_host in ("0.0.0.0", "") else d.http_host
    req = urllib.request.Request(f"http://{host}:{d.http_port}/status")
    if d.api_token is not None:
        req.add_header("Authorization", f"Bearer {d.api_token.reveal()}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body: dict[str, Any] = json.loads(resp.read())
            return body
    except (OSError, ValueError):
        return None


def from_kafka(cfg: config.KafoldConfig) -> dict[str, Any]:
    """Committed offsets of each connector's group against the end offsets of its topics' partitions."""
    rows: list[dict[str, Any]] = []
    for con in cfg.connectors:
        group = f"{cfg.daemon.group_prefix}.{con.name}"
        tps = offsets.partitions(cfg.kafka, con.topics)
        done = offsets.group_offsets(cfg.kafka, group, tps)
        ends = offsets.end_offsets(cfg.kafka, tps)
        for tp in tps:
            committed = done.get(tp)
            end = ends.get(tp)
            lag = None if end is None else max(0, end - (committed or 0))
            rows.append({"connector": con.name, "task": None, "topic": tp.topic, "partition": tp.partition,
                         "committed": committed, "end_offset": end, "lag": lag, "lag_seconds": None,
                         "state": "daemon not reachable"})
    return {"source": "kafka", "partitions": rows}


def table(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    # A task's state may quote what a record held (an error): shown escaped, as every command shows record content.
    cells = [[("-" if r.get(c) is None else visible(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)
