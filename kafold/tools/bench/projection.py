"""Kafka -> PostgreSQL projection end to end (exactly-once checkpoints) vs a naive per-event upsert + commit."""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition
from confluent_kafka.admin import NewTopic

from kafold import db, kafka_clients, logs
from kafold.connectors.projection.config import Dedup
from kafold.envelope import Event, decode, encode
from kafold.schema import toml_value
from kafold.tools.bench import BROKER_PROCESSES, SHORT_GROUP_TIMEOUTS, cpu_s, jit_cpu_s
from kafold.tools.bench.daemons import DaemonStack, daemon_process, daemon_stack, toml_table
from kafold.tools.bench.figures import per, rounded

log = logs.get(__name__)

RSS_SAMPLE_S = 0.5  # how often the daemon's memory is sampled for its peak

COLUMNS = {"account_id": "text", "owner": "text", "balance": "bigint", "last_amount": "bigint", "status": "text"}
RULES = [
    {"type": "AccountOpened", "set": {"owner": "payload.owner", "status": "'open'", "balance": 0}},
    {"type": "MoneyDeposited", "action": "update", "increment": {"balance": "payload.amount"},
     "set": {"last_amount": "payload.amount"}},
]
# `--rows whole`: each event carries its key's whole new row, every column set from it (the Kafka Connect JDBC sink
# peer's load, ../shared/peers/connect_jdbc): the writer needs no stored row (connectors/projection/whole_rows.py).
WHOLE_RULES = [{"type": "AccountState", "set": {c: f"payload.{c}" for c in COLUMNS if c != "account_id"}}]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=1_000_000, help="events to project (default 1M)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the benchmark topic")
    p.add_argument("--accounts", type=int, default=0, help="distinct aggregates (default events / 10)")
    p.add_argument("--batch", type=int, default=2500, help="daemon.batch_max_records (default 2500: with a task per "
                   "core, smaller batches cost less CPU per event than 5,000; docs/benchmarks.md)")
    p.add_argument("--tasks", type=int, default=2, help="tasks_max of the connector (default 2: one per core)")
    p.add_argument("--task-processes", action=argparse.BooleanOptionalAction, default=True,
                   help="daemon.task_processes: each task in its own process (default) or --no-task-processes: "
                   "threads of the daemon's one process")
    p.add_argument("--dedup", choices=[d.value for d in Dedup], default=Dedup.AUTO.value,
                   help="the connector's `dedup` (default auto, the connector's default: by version here, the "
                   "events being kafold envelopes; tracking: a tracking record per event, docs/benchmarks.md)")
    p.add_argument("--rows", choices=["fold", "whole"], default="fold",
                   help="fold (default): events opening accounts and depositing (an increment: the stored row is "
                   "read); whole: each event sets its whole row (AccountState, as the Kafka Connect peer's)")
    p.add_argument("--baseline-events", type=int, default=5000, help="sample size of the naive baseline")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack, "
                   "started if needed)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs.configure("warning")
    with contextlib.ExitStack() as stack:
        daemons = daemon_stack(stack, "projection", args.config, args.broker)
        kafka, name = daemons.kafka, daemons.name
        topic, table = f"{name}.events", f"bench_{uuid.uuid4().hex[:8]}"
        accounts = args.accounts or max(1, args.events // 10)
        value_bytes = (produce_states if getattr(args, "rows", "fold") == "whole" else produce_events)(
            kafka, topic, args.events, args.partitions, accounts)
        first = run_projection(daemons, name, topic, table, args)
        _forget_checkpoints(daemons.postgres, name)
        replay = run_projection(daemons, name, topic, table, args)
        baseline = _baseline(kafka, daemons.postgres, topic, args.baseline_events)
    rate = first["events_per_s"]
    return {"events": args.events, "partitions": args.partitions, "accounts": accounts,
            "value_bytes": value_bytes, "batch": args.batch,
            "events_per_s": rounded(rate), "baseline_events_per_s": round(baseline),
            "baseline_sample": args.baseline_events, "ratio": rounded(per(rate, baseline), 1),
            "replay_events_per_s": rounded(replay["events_per_s"]),
            "rows_changed_on_replay": replay["rows_changed"], "rows_written_first_pass": first["rows_changed"],
            "tasks": args.tasks, "task_processes": args.task_processes, "dedup": args.dedup, "rows": args.rows,
            # The daemon's memory: RSS of its processes added up (the daemon, and its task processes), at the end,
            # at 20 % of the events and the largest sampled; PSS added up (shared library pages counted once).
            "daemon_processes": first["processes"], "rss_mb": first["rss_mb"],
            "rss_mb_at_20pct": first["rss_mb_at_20pct"], "rss_mb_peak": first["rss_mb_peak"],
            "pss_mb": first["pss_mb"],
            # CPU of the first pass (kafold's process tree and, when they run here, PostgreSQL's and the broker's):
            # steadier than the rate on a shared machine, and it shows which side the two cores went to.
            "cpu_us_per_event": first["cpu_us_per_event"], "cores_busy": first["cores_busy"]}


def deposited(account: str, version: int, amount: int) -> Event:
    return Event.new("MoneyDeposited", "account", account, version, {"amount": amount})


def produce_events(kafka: Any, topic: str, n: int, partitions: int, accounts: int,
             deposit: Callable[[str, int, int], Event] = deposited, prefix: str = "acc-") -> int:
    """n events of ~300 bytes: each account opened, then deposits (`deposit(account, version, amount)`); returns
    the mean value size."""
    def record(i: int, acc: str, version: int) -> tuple[bytes | None, bytes, Any]:
        if version == 1:
            return encode(Event.new("AccountOpened", "account", acc, 1, {"owner": f"owner-{i}"}))
        return encode(deposit(acc, version, i % 97 + 1))
    return produce_records(kafka, topic, n, partitions, accounts, record, prefix)


def produce_states(kafka: Any, topic: str, n: int, partitions: int, accounts: int) -> int:
    """n events each carrying its account's whole row (`--rows whole`); returns the mean value size."""
    def record(i: int, acc: str, version: int) -> tuple[bytes | None, bytes, Any]:
        return encode(Event.new("AccountState", "account", acc, version,
                                {"owner": f"owner-{i % accounts}", "balance": i * 7 % 100_003,
                                 "last_amount": i % 97 + 1, "status": "open" if version % 5 else "frozen"}))
    return produce_records(kafka, topic, n, partitions, accounts, record)


def produce_records(kafka: Any, topic: str, n: int, partitions: int, accounts: int,
                    record: Callable[[int, str, int], tuple[bytes | None, bytes, Any]], prefix: str = "acc-") -> int:
    """n records `record(i, account, version)` (key, value, headers) to a new topic, the accounts (`prefix` and a
    number) in turn; returns the mean value size."""
    admin = kafka_clients.admin(kafka)
    for fut in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        fut.result(15)
    # Not idempotent: twice a fresh broker's idempotent producer (its id asked for while the coordinator was still
    # loading) acknowledged a topic's first two records that never reached the log, and the run then waited for
    # them. One request in flight keeps the order through retries instead.
    producer = kafka_clients.producer(kafka, **{"linger.ms": 20, "enable.idempotence": False, "acks": "all",
                                                "max.in.flight.requests.per.connection": 1,
                                                "batch.num.messages": 10000})
    total = 0
    failed: list[Any] = []  # a record the broker refused is not in the topic: the run would wait for it forever

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(err)

    for i in range(n):
        key, value, headers = record(i, f"{prefix}{i % accounts}", i // accounts + 1)
        total += len(value)
        kafka_clients.produce(producer, topic, value, key, headers, on_delivery=delivered)
    if producer.flush(120):
        raise RuntimeError("benchmark events not acknowledged")
    if failed:
        raise RuntimeError(f"{len(failed)} benchmark events not delivered to {topic}: {failed[0]}")
    ends = sum(_end_offsets(kafka, topic, partitions))
    if ends != n:
        raise RuntimeError(f"{topic} holds {ends} records after {n} were acknowledged")
    return round(total / max(1, n))


def _end_offsets(kafka: Any, topic: str, partitions: int) -> list[int]:
    reader = kafka_clients.consumer(kafka, f"kafold-bench-count-{uuid.uuid4().hex[:8]}")
    try:
        return [reader.get_watermark_offsets(TopicPartition(topic, p), timeout=15)[1] for p in range(partitions)]
    finally:
        reader.close()


def run_projection(stack: DaemonStack, name: str, topic: str, table: str, args: argparse.Namespace,
             connector_extra: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `kafold daemon` on a connector for `topic` until PostgreSQL's checkpoints cover every event, measuring
    the daemon as an operator would: its whole process tree (the daemon, and with task processes its children) for
    RSS, PSS and CPU. The clock runs from the first stored checkpoint (the start-up and the group join are not the
    hot path; the events that first commit covered are left out of the count) to the one covering every event.
    Rows changed are counted in PostgreSQL itself (rows whose xmin is newer than the run)."""
    # psutil, psycopg: kafold[daemon], not in the core install
    import psutil
    from psycopg import sql

    conf = stack.workdir / f"{name}.{uuid.uuid4().hex[:4]}.toml"
    conf.write_text(daemon_toml(stack, name, topic, table, args, connector_extra, extra))
    log_path = conf.with_suffix(".log")
    with db.connect(stack.postgres) as conn:
        postmaster = _postmaster(conn)
        table_id = sql.Identifier(table)
        xid_before, rows_before = _xid_and_rows(conn, table_id)
        query = sql.SQL("SELECT coalesce(sum(next_offset), 0) FROM {} WHERE connector = %s").format(
            db.table(stack.postgres, "checkpoints"))
        with daemon_process(stack, conf) as proc:
            marks = _watch(proc, psutil.Process(proc.pid), postmaster, lambda: int(
                conn.execute(query, (name,)).fetchone()[0]), args.events, log_path)  # type: ignore[index]
        changed = _rows_changed(conn, table_id, xid_before, rows_before)
    if proc.returncode != 0:
        raise RuntimeError(f"kafold daemon exited with code {proc.returncode} on SIGTERM; its log ({log_path}) "
                           f"ends:\n{tail_of(log_path)}")
    return projection_figures(marks, args.events, changed)


def _watch(proc: Any, daemon: Any, postmaster: Any, covered_now: Callable[[], int], total: int,
           log_path: Path) -> dict[str, Any]:
    """Poll the checkpoints until they cover `total` events, marking the daemon tree's and PostgreSQL's CPU at the
    first checkpoint and at the last, and the tree's memory (sampled every RSS_SAMPLE_S)."""
    marks: dict[str, Any] = {"peak": 0.0}
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kafold daemon exited with code {proc.returncode} before the end; its "
                               f"log ({log_path}) ends:\n{tail_of(log_path)}")
        covered = covered_now()
        now = time.perf_counter()
        if covered and "first" not in marks:
            tree = _tree(daemon)
            pg = [postmaster, *postmaster.children()] if postmaster is not None else []
            broker = list(BROKER_PROCESSES)
            marks.update(first=now, covered=covered, tree=tree, pg=pg, broker=broker, cpu0=cpu_s(tree), pg0=cpu_s(pg),
                         broker0=cpu_s(broker), sampled=now)
        if "first" in marks and now - marks["sampled"] >= RSS_SAMPLE_S:
            marks["sampled"] = now
            marks["peak"] = max(marks["peak"], _mb(marks["tree"], "rss"))
            if "rss20" not in marks and covered >= total // 5:
                marks["rss20"] = _mb(marks["tree"], "rss")
        if covered >= total:
            tree = marks["tree"]
            marks.update(last=now, cpu1=cpu_s(tree), pg1=cpu_s(marks["pg"]), broker1=cpu_s(marks["broker"]),
                         rss=_mb(tree, "rss"),
                         pss=_mb(tree, "pss"))
            return marks
        time.sleep(0.01)


def projection_figures(marks: dict[str, Any], total: int, changed: int) -> dict[str, Any]:
    """`run_projection`'s figures from `_watch`'s marks. A run so small that its first checkpoint covered every
    event counted none over no time: its rate and per-event figures are absent (None), not 0."""
    seconds, events = marks["last"] - marks["first"], total - marks["covered"]
    cpu = {"kafold": marks["cpu1"] - marks["cpu0"], "postgres": marks["pg1"] - marks["pg0"] if marks["pg"] else None,
           "broker": marks["broker1"] - marks["broker0"] if marks["broker"] else None}
    return {"events": events, "seconds": seconds, "processes": len(marks["tree"]),
            "events_per_s": per(events, seconds) if events else None,
            "cpu_us_per_event": {k: rounded(per(v, events, 1e6), 1) for k, v in cpu.items()},
            "cores_busy": {k: rounded(per(v, seconds), 2) for k, v in cpu.items()},
            "rows_changed": changed, "rss_mb": round(marks["rss"]),
            "rss_mb_at_20pct": round(marks.get("rss20", marks["rss"])),
            "rss_mb_peak": round(max(marks["peak"], marks["rss"])), "pss_mb": round(marks["pss"])}


def daemon_toml(stack: DaemonStack, name: str, topic: str, table: str, args: argparse.Namespace,
                 connector_extra: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> str:
    """The daemon's kafold.toml: [kafka] and [postgres] as given (no secrets: the loader takes references only),
    short group timeouts, and the one connector (with `connector_extra` keys, e.g. its upcasters). `extra` adds
    top-level settings: a table (e.g. `privacy`, `tracing`; `daemon` keys merge into [daemon]) or a list of tables
    (e.g. `aggregates`, written inline)."""
    kafka = {**stack.kafka_raw, **SHORT_GROUP_TIMEOUTS}
    daemon = {"group_prefix": f"{name}.{uuid.uuid4().hex[:4]}", "http_port": 0, "batch_max_records": args.batch,
              "task_processes": args.task_processes}
    connector = {"name": name, "class": "postgres-projection", "topics": [topic], "tasks_max": args.tasks,
                 "config": {"table": table, "key_columns": ["account_id"], "columns": COLUMNS,
                            "on": WHOLE_RULES if getattr(args, "rows", "fold") == "whole" else RULES,
                            "dedup": getattr(args, "dedup", Dedup.AUTO.value)},
                 **(connector_extra or {})}
    extra = dict(extra or {})
    daemon.update(extra.pop("daemon", {}))
    arrays = {k: v for k, v in extra.items() if isinstance(v, list)}  # before any [table] header, as TOML wants
    sections = [("kafka", kafka), ("postgres", stack.postgres_raw), ("daemon", daemon),
                *((k, v) for k, v in extra.items() if k not in arrays)]
    text = "".join(f"{k} = {toml_value(v)}\n" for k, v in arrays.items())
    text += "".join(toml_table(f"[{section}]", body) for section, body in sections)
    return text + toml_table("[[connectors]]", connector)


def _tree(proc: Any) -> list[Any]:
    """A process and its descendants (the daemon and its task processes)."""
    # psutil: kafold[daemon], not in the core install
    import psutil

    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def _mb(procs: list[Any], kind: str) -> float:
    """RSS or PSS of `procs` added up, in MiB."""
    return sum(_memory(p, kind) for p in procs) / 2**20


def tail_of(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _xid_and_rows(conn: Any, table: Any) -> tuple[int, int]:
    """A transaction id to compare rows' xmin with, and the table's row count."""
    return int(conn.execute("SELECT txid_current()").fetchone()[0]), _row_count(conn, table)


def _row_count(conn: Any, table: Any) -> int:
    """Rows in `table` (0 before it exists)."""
    # psycopg: kafold[daemon], not in the core install
    from psycopg import sql

    if not conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table.as_string(conn),)).fetchone()[0]:
        return 0
    return int(conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0])


def _rows_changed(conn: Any, table: Any, xid: int, rows_before: int) -> int:
    """Rows written (inserted or updated) by transactions after `xid`, plus rows removed since."""
    # psycopg: kafold[daemon], not in the core install
    from psycopg import sql

    written = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE xmin::text::bigint > %s").format(table),
                           (xid % 2**32,)).fetchone()[0]
    return int(written) + max(0, rows_before - _row_count(conn, table))


def _memory(proc: Any, kind: str) -> int:
    """RSS, or PSS (shared pages such as the libraries' code counted once across the processes sharing them)."""
    # psutil: kafold[daemon], not in the core install
    import psutil

    try:
        return int(getattr(proc.memory_full_info() if kind == "pss" else proc.memory_info(), kind))
    except psutil.Error:
        return 0


class Usage:
    """CPU seconds of kafold's daemon tree, the local PostgreSQL (its postmaster and the backends open now) and the
    embedded broker since it was made, per event: a bench's `cpu_us_per_event` and `cores_busy` for a window.
    `broker_jit` is the part of the broker's that its JIT compiler threads took (`jit_cpu_s`: a lower bound, as a
    compiler thread that ended meanwhile is left out; 0 for a broker that compiles nothing, None without a broker
    measured or /proc)."""

    def __init__(self, daemon_pid: int, pgc: Any) -> None:
        # psutil: kafold[daemon], not in the core install
        import psutil

        with db.connect(pgc) as conn:
            postmaster = _postmaster(conn)
        pg = [postmaster, *postmaster.children()] if postmaster is not None else []
        self.groups = {"kafold": _tree(psutil.Process(daemon_pid)), "postgres": pg, "broker": list(BROKER_PROCESSES)}
        self.began = time.perf_counter()
        self.at = {k: cpu_s(v) for k, v in self.groups.items()}
        self.jit_at = jit_cpu_s(self.groups["broker"])

    def per_event(self, events: int) -> dict[str, Any]:
        seconds = time.perf_counter() - self.began
        used = {k: cpu_s(v) - self.at[k] if v else None for k, v in self.groups.items()}
        jit = jit_cpu_s(self.groups["broker"])
        used["broker_jit"] = None if not self.groups["broker"] or jit is None or self.jit_at is None \
            else max(0.0, jit - self.jit_at)
        return {"cpu_us_per_event": {k: None if v is None else round(v / max(1, events) * 1e6, 1)
                                     for k, v in used.items()},
                "cores_busy": {k: None if v is None else round(v / seconds, 2) for k, v in used.items()}}


def _postmaster(conn: Any) -> Any:
    """The local PostgreSQL server's postmaster, found from the connection's backend; None when the server is not
    on this machine (its pid would mean nothing here)."""
    # psutil: kafold[daemon], not in the core install
    import psutil

    host = conn.info.host if conn is not None else ""
    if not (host.startswith("/") or host in ("localhost", "127.0.0.1", "::1")):
        return None
    try:
        postmaster = psutil.Process(conn.info.backend_pid).parent()
    except psutil.Error:
        return None
    return postmaster if postmaster is not None and "postgres" in postmaster.name() else None


def _forget_checkpoints(pgc: Any, name: str) -> None:
    """Make the next run start from the beginning again: every event is then a duplicate (tracking kept)."""
    # psycopg: kafold[daemon], not in the core install
    from psycopg import sql

    with db.connect(pgc) as conn:
        conn.execute(sql.SQL("DELETE FROM {} WHERE connector = %s").format(db.table(pgc, "checkpoints")), (name,))


def _baseline(kafka: Any, pgc: Any, topic: str, n: int) -> float:
    """Naive: per event, decode, one INSERT … ON CONFLICT DO UPDATE and a commit (the same events)."""
    # psycopg: kafold[daemon], not in the core install
    from psycopg import sql

    consumer = kafka_clients.consumer(kafka, f"kafold.bench.baseline.{uuid.uuid4().hex[:6]}")
    consumer.subscribe([topic])
    msgs: list[Any] = []
    while len(msgs) < n:
        msgs += [m for m in consumer.consume(min(5000, n - len(msgs)), 1.0) if m.error() is None]
    consumer.close()
    table = sql.Identifier(f"baseline_{uuid.uuid4().hex[:8]}")
    upsert = sql.SQL("INSERT INTO {} AS t (account_id, owner, balance, last_amount, status) "
                     "VALUES (%s, %s, %s, %s, 'open') ON CONFLICT (account_id) DO UPDATE SET "
                     "balance = t.balance + EXCLUDED.balance, last_amount = EXCLUDED.last_amount").format(table)
    with db.connect(pgc, autocommit=False) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (account_id text PRIMARY KEY, owner text, balance bigint, "
                             "last_amount bigint, status text)").format(table))
        conn.commit()
        started = time.perf_counter()
        for m in msgs:
            e = decode(m.key(), m.value(), m.headers())
            amount = e.payload.get("amount", 0)
            conn.execute(upsert, (e.aggregate_id, e.payload.get("owner"), amount, amount))
            conn.commit()
        elapsed = time.perf_counter() - started
        conn.execute(sql.SQL("DROP TABLE {}").format(table))
        conn.commit()
    return len(msgs) / elapsed
