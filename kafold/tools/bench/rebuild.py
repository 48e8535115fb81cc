"""Blue-green rebuild of a projection while live traffic keeps flowing: copy rate, live-table lock at the swap.

A `kafold daemon` projects the history (the live connector), a separate process produces live events at a constant
rate, and the rebuild runs here until it swaps (or `--timeout`). The copy rate counts the events the rebuild applied
until it first entered the tail phase, over the time that took; the lock figure is the longest any swap attempt held
the live table (lock granted to commit or rollback). `completed_under_traffic`: it swapped while the producer was
still producing at the rate, and the live connector then caught up with every produced event.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kafold import db, kafka_clients, logs
from kafold.config import ConnectorConfig, KafoldConfig
from kafold.connectors.projection import rebuild as rb
from kafold.envelope import Event, encode
from kafold.tools.bench.daemons import daemon_process, daemon_stack
from kafold.tools.bench.projection import COLUMNS, RULES, daemon_toml, produce_events, tail_of

log = logs.get(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=1_000_000, help="history to rebuild (default 1M events)")
    p.add_argument("--rate", type=int, default=1000, help="live events per second during the rebuild (default 1000)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the benchmark topic")
    p.add_argument("--accounts", type=int, default=0, help="distinct aggregates (default events / 10)")
    p.add_argument("--rebuild-batch", type=int, default=5000, help="records per shadow transaction (default 5000)")
    p.add_argument("--max-tail", type=int, default=20000, help="the rebuild's --max-tail (default 20000)")
    p.add_argument("--workers", type=int, default=None, help="the rebuild's --workers (default: the cores, at most 4)")
    p.add_argument("--timeout", type=float, default=900, help="give up on the rebuild after this many seconds")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack, "
                   "started if needed)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs.configure("warning")
    with contextlib.ExitStack() as stack:
        daemons = daemon_stack(stack, "rebuild", args.config, args.broker)
        kafka, name = daemons.kafka, daemons.name
        topic, table = f"{name}.events", f"bench_{uuid.uuid4().hex[:8]}"
        accounts = args.accounts or max(1, args.events // 10)
        produce_events(kafka, topic, args.events, args.partitions, accounts)
        daemon_args = argparse.Namespace(batch=2500, tasks=2, task_processes=True)
        conf = daemons.workdir / "live.toml"
        conf.write_text(daemon_toml(daemons, name, topic, table, daemon_args))
        live = stack.enter_context(daemon_process(daemons, conf))
        _wait_covered(daemons.postgres, name, args.events, live, conf)
        stop = multiprocessing.get_context("spawn").Event()
        produced = multiprocessing.get_context("spawn").Value("q", 0)
        producer = multiprocessing.get_context("spawn").Process(
            target=_live_traffic, args=(kafka, topic, args.rate, accounts, args.events // accounts + 2, stop,
                                        produced), daemon=True)
        producer.start()
        try:
            time.sleep(2.0)  # the traffic is flowing before the rebuild starts
            figures = _rebuild(kafka, daemons.postgres, name, topic, table, args)
            still_producing = producer.is_alive() and not stop.is_set()
        finally:
            stop.set()
            producer.join(30)
        total = args.events + int(produced.value)
        caught_up = _wait_covered(daemons.postgres, name, total, live, conf, timeout=300, fail=False)
    swapped = figures.pop("phase") == "swapped"
    return {"events": args.events, "partitions": args.partitions, "accounts": accounts,
            "live_rate_events_per_s": args.rate, "live_events_produced": total - args.events, **figures,
            "completed_under_traffic": swapped and still_producing and caught_up}


def _rebuild(kafka: Any, pgc: Any, name: str, topic: str, table: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the rebuild; its copy rate, lock times, retries and duration."""
    connector = ConnectorConfig(name=name, connector_class="postgres-projection", topics=[topic],
                                config={"table": table, "key_columns": ["account_id"], "columns": COLUMNS,
                                        "on": RULES})
    plan = rb.plan(KafoldConfig(kafka=kafka, postgres=pgc, connectors=[connector]), Path("."), name)
    marks: dict[str, float] = {}

    def progress(p: rb.Progress) -> None:
        if "copied" not in marks and p.phase != "copying":
            marks.update(copied=time.perf_counter(), copied_events=p.events)

    stop = threading.Event()
    timer = threading.Timer(args.timeout, stop.set)
    timer.start()
    rebuild = rb.Rebuild(plan, batch=args.rebuild_batch, max_tail=args.max_tail, workers=args.workers,
                         on_progress=progress, stop=stop)
    started = time.perf_counter()
    try:
        result = rebuild.run()
    finally:
        timer.cancel()
    ended = time.perf_counter()
    copied_s = marks.get("copied", ended) - started
    copied = marks.get("copied_events", result.events)
    return {"phase": result.phase, "rebuild_events_per_s": round(copied / copied_s) if copied_s > 0 else 0,
            "rebuild_seconds": round(ended - started, 1), "tail_phase_seconds": round(ended - marks.get(
                "copied", ended), 1), "swap_lock_ms_max": rebuild.lock_ms_max, "swap_lock_ms": rebuild.locked_ms,
            "tail_under_lock": rebuild.tail, "swap_tail_ms": rebuild.tail_ms, "swap_finish_ms": rebuild.finish_ms,
            "swap_retries": rebuild.swap_retries, "workers": rebuild.workers}


def _live_traffic(kafka: Any, topic: str, rate: int, accounts: int, version: int, stop: Any, produced: Any) -> None:
    """Deposits at `rate` events/s to every account in turn (versions after the history's), until `stop`."""
    producer = kafka_clients.producer(kafka, **{"linger.ms": 5, "enable.idempotence": True})
    started, sent, i = time.perf_counter(), 0, 0
    while not stop.is_set():
        due = int((time.perf_counter() - started) * rate)
        while sent < due:
            acc = i % accounts
            event = Event.new("MoneyDeposited", "account", f"acc-{acc}", version + i // accounts, {"amount": 1})
            key, value, headers = encode(event)
            try:
                producer.produce(topic, value=value, key=key, headers=headers)
            except BufferError:  # the broker is slow (a loaded machine): wait for deliveries, then go on
                producer.poll(0.1)
                continue
            sent, i = sent + 1, i + 1
        producer.poll(0)
        with produced.get_lock():
            produced.value = sent
        time.sleep(0.005)
    producer.flush(60)
    with produced.get_lock():
        produced.value = sent


def _wait_covered(pgc: Any, name: str, events: int, proc: Any, conf: Path, timeout: float = 900,
                  fail: bool = True) -> bool:
    """Wait until the live connector's checkpoints cover `events` offsets."""
    # psycopg: kafold[daemon], not in the core install
    from psycopg import sql

    query = sql.SQL("SELECT coalesce(sum(next_offset), 0) FROM {} WHERE connector = %s").format(
        db.table(pgc, "checkpoints"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kafold daemon exited with code {proc.returncode}; its log ends:\n"
                               f"{tail_of(conf.with_suffix('.log'))}")
        try:
            with db.connect(pgc) as conn:
                covered = int(conn.execute(query, (name,)).fetchone()[0])  # type: ignore[index]
        except Exception:  # the daemon has not migrated yet
            covered = 0
        if covered >= events:
            return True
        time.sleep(0.2)
    if fail:
        raise RuntimeError(f"the live connector did not cover {events} events within {timeout:.0f} s")
    return False
