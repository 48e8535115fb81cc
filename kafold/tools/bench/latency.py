"""End-to-end latency at a fixed offered rate: event → projection row, event → webhook, command → result, command →
its own projection row (read-your-writes), p50/p95/p99/max, on a real `kafold daemon`.

Two phases of `--duration` seconds each, on one daemon (`kafold daemon` in its own process, as an operator runs it):
- events: an independent producer appends events at `--rate` to a topic that a postgres-projection and a webhook
  connector (to a local receiver in its own process) both consume. Event → row: from the broker's acknowledgement
  of the event (the delivery report) to the first sight of the projection's checkpoint in PostgreSQL covering its
  offset (checkpoints are written in the same transaction as the rows; polled every `--poll-ms`). Event → webhook:
  from the same acknowledgement to the receiver's first receipt of its id.
- commands: commands at `--rate` to the bank aggregate (Deposits to accounts opened beforehand), its events projected
  into an `accounts` table. Command → result: from the produce call to the result's arrival at a results reader
  kept assigned (read_committed). Read-your-writes: `--probes` commands a second open a fresh account; from their
  produce call to the return of `DaemonClient.wait` on their result's consistency token (the daemon's
  `GET /connectors/{name}/wait`, as a service does it), after which the row is read once and must be there.
Every time is taken with time.time() on this machine (the receiver's too)."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import random
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
from confluent_kafka import TopicPartition

from kafold import db, kafka_clients, logs, topics
from kafold.client import PRODUCER_SETTINGS, DaemonClient
from kafold.config import TopicSpec
from kafold.consumer_loop import take
from kafold.envelope import Event, encode
from kafold.errors import KafoldError
from kafold.messages import H_COMMAND_ID, Command, decode_result, header
from kafold.testing import free_port
from kafold.tools.bench import SHORT_GROUP_TIMEOUTS
from kafold.tools.bench.aggregates import BANK
from kafold.tools.bench.daemons import DaemonStack, daemon_process, daemon_stack, toml_table, wait_ready
from kafold.tools.bench.effects import effect_receiver
from kafold.tools.bench.progress import wait_progress
from kafold.tools.bench.projection import COLUMNS, RULES, Usage

log = logs.get("kafold.bench.latency")

PACE_WAIT_S = 0.001  # librdkafka's poll granularity
# How long one read-your-writes probe's `DaemonClient.wait` may take before it counts as failed. The phases' own waits
# (every row, receipt and result) have no deadline: they last as long as something arrives (wait_progress) and fail,
# naming what is missing, when nothing does for its STALL_S.
PROBE_WAIT_S = 60.0
BANK_COLUMNS = {"account_id": "text", "owner": "text", "currency": "text", "balance": "bigint", "status": "text",
                "opened_at": "timestamptz", "updated_at": "timestamptz"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=1000.0, help="offered events/s and commands/s (default 1,000)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of each phase (default 60)")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of each phase's load sent, and waited for, before its measured part (default 0): "
                        "a broker the bench starts compiles its hot paths through its first minute, which a "
                        "service's long-running cluster has long done")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the topics (default 4)")
    p.add_argument("--accounts", type=int, default=1000, help="aggregates the events and commands go to")
    p.add_argument("--probes", type=float, default=20.0, help="read-your-writes probes per second (default 20)")
    p.add_argument("--poll-ms", type=float, default=2.0,
                   help="how often PostgreSQL is polled for the event projection's checkpoints (default 2 ms)")
    p.add_argument("--task-processes", action=argparse.BooleanOptionalAction, default=False,
                   help="daemon.task_processes: each connector task in its own process (default: off, the "
                   "daemon's default)")
    p.add_argument("--process-projections", action="store_true",
                   help="the two projections' own task_processes = true: each in a process, the webhook connector "
                   "as the daemon has it")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs.configure("warning")
    with contextlib.ExitStack() as stack:
        daemons = daemon_stack(stack, "latency", args.config, args.broker)
        kafka = daemons.kafka
        url, control = stack.enter_context(effect_receiver())
        names = _Names(daemons.name, daemons.run_id)
        spec = [TopicSpec(t, args.partitions, 1, {}) for t in (names.feed, *names.agg_topics.values())]
        topics.ensure(kafka, spec)
        port = free_port()
        conf = daemons.workdir / f"{names.prefix}.toml"
        conf.write_text(_daemon_toml(daemons, names, args, port, url))
        with daemon_process(daemons, conf) as proc:
            wait_ready(proc, port, conf)
            figures = {"rate": args.rate, "duration_s": args.duration, "warmup_s": args.warmup,
                       "partitions": args.partitions,
                       "task_processes": args.task_processes, "process_projections": args.process_projections}
            usage = Usage(proc.pid, daemons.postgres)
            figures.update(_events_phase(kafka, daemons, names, args, control))
            figures["events_phase"] = usage.per_event(figures.pop("events_sent_in_all"))
            usage = Usage(proc.pid, daemons.postgres)
            figures.update(_commands_phase(kafka, daemons, names, args, DaemonClient(f"http://127.0.0.1:{port}")))
            figures["commands_phase"] = usage.per_event(figures.pop("commands_sent_in_all"))
        figures["aggregate_batches"] = batch_stages(conf.with_suffix(".log"), figures.pop("commands_measured_from"))
    figures["notes"] = [
        "event_to_row: broker acknowledgement -> the projection's PostgreSQL checkpoint seen covering the event "
        f"(polled every {args.poll_ms:g} ms)",
        "event_to_webhook: broker acknowledgement -> first receipt by a local HTTP receiver (its own process)",
        "command_to_result: produce call -> result read by a results reader kept assigned (read_committed)",
        "read_your_writes: produce call of an OpenAccount command -> DaemonClient.wait on its result's token "
        "returned (the row then read once; a missing row is counted in read_your_writes_missing)",
        "the two phases run one after the other, each at the offered rate; with --warmup, each first sends its load "
        "for that long and waits for all of it, unmeasured",
        "events_phase / commands_phase: CPU per event or command sent, the warm-up's included (a command: its "
        "events, result and projection included), and cores busy over the phase (warm-up and drain too), of "
        "kafold's daemon tree, PostgreSQL's backends open at the phase's start (not the bench's own polling "
        "sessions) and the embedded broker (the bench's producers and readers load it too); broker_jit: the part of "
        "the broker's that its JIT compiler threads took (a broker started for the bench compiles through the run)",
        "aggregate_batches: the measured commands' transactions, from the daemon's aggregate.batch log lines: "
        "commands a batch, and ms p50/p90/p99 of a batch from its start to its commit returned (cycle_ms), of "
        "which deciding (decide_ms: decode, decide, the events produced) and the commit (commit_ms: the events' "
        "and results' delivery, EndTxn)",
    ]
    return figures


class _Names:
    def __init__(self, prefix: str, run_id: str) -> None:
        self.prefix = prefix
        self.feed = f"{prefix}.feed"
        self.feed_table, self.accounts_table = f"lat_feed_{run_id}", f"lat_accounts_{run_id}"
        self.feed_rows, self.feed_hooks, self.accounts = (f"lat-feed-rows-{run_id}", f"lat-feed-hooks-{run_id}",
                                                          f"lat-accounts-{run_id}")
        self.agg_topics = {k: f"{prefix}.{k}" for k in ("events", "commands", "results", "snapshot")}


def _daemon_toml(stack: DaemonStack, names: _Names, args: argparse.Namespace, port: int, url: str) -> str:
    kafka = {**stack.kafka_raw, **SHORT_GROUP_TIMEOUTS}
    daemon = {"group_prefix": names.prefix, "http_port": port, "python_path": [str(BANK)],
              "task_processes": args.task_processes}
    aggregate = {"name": "account", "initial": "bank_domain:initial", "evolve": "bank_domain:evolve",
                 "decide": "bank_domain:decide", "partitions": args.partitions,
                 **{f"{k}_topic": t for k, t in names.agg_topics.items()}}
    own: dict[str, Any] = {"task_processes": True} if args.process_projections else {}
    connectors = [
        {"name": names.feed_rows, "class": "postgres-projection", "topics": [names.feed], **own,
         "config": {"table": names.feed_table, "key_columns": ["account_id"], "columns": COLUMNS, "on": RULES}},
        {"name": names.feed_hooks, "class": "webhook", "topics": [names.feed],
         "config": {"url": f"{url}/hook", "allow_http": True}},
        {"name": names.accounts, "class": "postgres-projection", "topics": [names.agg_topics["events"]], **own,
         "config": {"table": names.accounts_table, "key_columns": ["account_id"],
                    "mapper": "bank_projection:account_row", "columns": BANK_COLUMNS}},
    ]

    return "".join([toml_table("[kafka]", kafka), toml_table("[postgres]", stack.postgres_raw),
                    toml_table("[daemon]", daemon), toml_table("[[aggregates]]", aggregate),
                    *(toml_table("[[connectors]]", c) for c in connectors)])


def _nearest_rank(ordered: list[float], q: float) -> float:
    """The `q` quantile of the sorted `ordered` by nearest rank: the one rule of every figure this bench prints."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def batch_stages(log_path: Any, since: float) -> dict[str, Any]:
    """Per-stage figures of the aggregate's transactions logged (`aggregate.batch`, JSON) at or after `since` (epoch
    seconds): commands a batch and ms of the cycle, its deciding and its commit, p50/p90/p99."""
    sizes: list[float] = []
    cycle: list[float] = []
    commit: list[float] = []
    with open(log_path, "rb") as lines:
        for line in lines:
            if b'"aggregate.batch"' not in line:
                continue
            rec = orjson.loads(line)
            at = datetime.datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
            if at >= since:
                sizes.append(rec["commands"])
                cycle.append(rec["duration_ms"])
                commit.append(rec["commit_ms"])
    if not sizes:
        return {"batches": 0}

    def pcts(xs: list[float]) -> list[float]:
        s = sorted(xs)
        return [round(_nearest_rank(s, q), 1) for q in (0.5, 0.9, 0.99)]

    return {"batches": len(sizes), "commands": pcts(sizes), "cycle_ms": pcts(cycle),
            "decide_ms": pcts([c - m for c, m in zip(cycle, commit, strict=True)]), "commit_ms": pcts(commit)}


def _pace(producer: Any, rate: float, duration: float, send: Any) -> int:
    """Call `send(i)` at `rate` per second for `duration` seconds, serving the producer's delivery reports while
    waiting; returns how many were sent. Whatever is due is sent at once, then the loop waits at least PACE_WAIT_S:
    the producer's poll takes whole milliseconds (a shorter wait is a poll(0), so waiting for each event's own
    instant below 1 ms spun a core, which the broker, PostgreSQL and the daemon measured share)."""
    started, i, total = time.monotonic(), 0, int(rate * duration)
    while i < total:
        due = min(total, int((time.monotonic() - started) * rate) + 1)
        while i < due:
            send(i)
            i += 1
        producer.poll(max(PACE_WAIT_S, started + i / rate - time.monotonic()))
    return total


def _figures(prefix: str, samples: list[float], expected: int) -> dict[str, Any]:
    """p50/p95/p99/max in ms of `samples` (seconds), their count and how many of `expected` never arrived."""
    if not samples:
        return {f"{prefix}_samples": 0, f"{prefix}_lost": expected}
    s = sorted(samples)

    def pct(q: float) -> float:
        return round(_nearest_rank(s, q) * 1000, 1)

    return {f"{prefix}_p50_ms": pct(0.50), f"{prefix}_p95_ms": pct(0.95), f"{prefix}_p99_ms": pct(0.99),
            f"{prefix}_max_ms": round(s[-1] * 1000, 1), f"{prefix}_samples": len(s),
            f"{prefix}_lost": max(0, expected - len(s))}


@contextlib.contextmanager
def _polling(interval_s: float, step: Any) -> Iterator[threading.Event]:
    """`step()` every `interval_s` in a thread until the block ends (or the returned event is set)."""
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            step()
            done.wait(interval_s)

    thread = threading.Thread(target=loop, daemon=True, name="bench-latency-poll")
    thread.start()
    try:
        yield done
    finally:
        done.set()
        thread.join(10)


# ---- events -----------------------------------------------------------------------------------------------------
def _events_phase(kafka: Any, stack: DaemonStack, names: _Names, args: argparse.Namespace,
                  control: str) -> dict[str, Any]:
    # psycopg: kafold[daemon], not in the core install
    from psycopg import sql

    producer = kafka_clients.producer(kafka, **{"enable.idempotence": True, "linger.ms": 1})
    accounts = [f"acc-{i}" for i in range(args.accounts)]
    versions = dict.fromkeys(accounts, 1)
    lock = threading.Lock()
    pending: dict[int, list[tuple[int, float]]] = {p: [] for p in range(args.partitions)}  # offset, acked at
    acked: dict[str, float] = {}  # event id -> acked at
    rows: list[float] = []
    measuring = [False]

    def on_delivery(event_id: str) -> Any:
        def report(err: Any, msg: Any) -> None:
            if err is None and measuring[0]:
                at = time.time()
                with lock:
                    pending[msg.partition()].append((msg.offset(), at))
                    acked[event_id] = at
        return report

    def send_event(event: Event, partition: int) -> None:
        key, value, headers = encode(event)
        kafka_clients.produce(producer, names.feed, value, key, headers, partition=partition,
                              on_delivery=on_delivery(event.event_id))

    def send(i: int) -> None:
        acc = accounts[random.randrange(len(accounts))]
        versions[acc] += 1
        send_event(Event.new("MoneyDeposited", "account", acc, versions[acc], {"amount": i % 97 + 1}),
                   int(acc[4:]) % args.partitions)

    # Warm-up: every account opened (the deposits update its row), then `--warmup` seconds of deposits; not measured.
    for i, acc in enumerate(accounts):
        send_event(Event.new("AccountOpened", "account", acc, 1, {"owner": acc}), i % args.partitions)
    warm = len(accounts) + _pace(producer, args.rate, args.warmup, send)
    producer.flush(60)
    query = sql.SQL("SELECT partition, next_offset FROM {} WHERE connector = %s AND topic = %s").format(
        db.table(stack.postgres, "checkpoints"))
    with db.connect(stack.postgres) as conn:
        def covered() -> dict[int, int]:
            return {int(p): int(o) for p, o in conn.execute(query, (names.feed_rows, names.feed)).fetchall()}

        wait_progress(lambda: sum(covered().values()) >= warm, covered,
                      f"the warm-up's {warm} events in {names.feed_table} (the checkpoints of "
                      f"{names.feed_rows} on {names.feed}, by partition)", poll_s=0.05)

        def poll() -> None:
            now_covered, seen = covered(), time.time()
            with lock:
                for p, items in pending.items():
                    upto = now_covered.get(p, 0)
                    while items and items[0][0] < upto:
                        rows.append(seen - items.pop(0)[1])

        measuring[0] = True
        with _polling(args.poll_ms / 1000, poll):
            sent = _pace(producer, args.rate, args.duration, send)
            producer.flush(30)
            wait_progress(lambda: len(rows) >= sent, lambda: len(rows),
                          f"the checkpoints of {names.feed_rows} covering the {sent} events sent to {names.feed} "
                          "(rows seen so far)", poll_s=0.05)
    times = _received(control, acked, sent)
    hooks = [times[eid] - at for eid, at in acked.items() if eid in times]
    return {"events_sent": sent, "events_sent_in_all": warm + sent, **_figures("event_to_row", rows, sent),
            **_figures("event_to_webhook", hooks, sent)}


def _received(control: str, acked: dict[str, float], expected: int) -> dict[str, float]:
    """The receiver's first-receipt times of the measured events, waited for as long as more of them arrive."""
    got: dict[str, float] = {}

    def arrived() -> int:
        with urllib.request.urlopen(f"{control}/times", timeout=10) as resp:
            got.update(orjson.loads(resp.read()))
        return sum(1 for eid in acked if eid in got)

    wait_progress(lambda: arrived() >= expected, lambda: len(got),
                  f"the webhook receiver's receipt of the {expected} events sent (receipts so far)", poll_s=0.2)
    return got


# ---- commands ---------------------------------------------------------------------------------------------------
def _commands_phase(kafka: Any, stack: DaemonStack, names: _Names, args: argparse.Namespace,
                    daemon: DaemonClient) -> dict[str, Any]:
    # psycopg: kafold[daemon], not in the core install
    from psycopg import sql

    commands, results_topic = names.agg_topics["commands"], names.agg_topics["results"]
    producer = kafka_clients.producer(kafka, **PRODUCER_SETTINGS)  # as kafold.client's CommandClient sends
    reader = kafka_clients.consumer(kafka, f"{names.prefix}.results-reader", **{
        "isolation.level": "read_committed", "fetch.wait.max.ms": 100})
    ends = {p: reader.get_watermark_offsets(TopicPartition(results_topic, p), timeout=10)[1]
            for p in range(args.partitions)}
    reader.assign([TopicPartition(results_topic, p, max(0, off)) for p, off in ends.items()])
    lock = threading.Lock()
    sent_at: dict[str, float] = {}
    results: list[float] = []
    probes: dict[str, tuple[str, float]] = {}  # command id -> (account id, sent at), until its result is read
    visible: list[float] = []
    counts = {"results": 0, "probes": 0, "missing": 0, "failed": 0}
    read_upto: dict[int, int] = {}  # partition -> the next offset after the last result read (the reader's thread)
    measuring = [False]
    stop = threading.Event()
    failure: list[BaseException] = []  # the results reader's error, if it died
    waiters = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="bench-latency-wait")
    rows_query = sql.SQL("SELECT count(*) FROM {} WHERE account_id = %s").format(sql.Identifier(names.accounts_table))
    check = db.connect(stack.postgres, autocommit=True)
    check_lock = threading.Lock()

    def read_your_write(acc: str, token: str, sent: float) -> None:
        """Wait as a service does (the token), then read the row once: it must be there."""
        try:
            daemon.wait(names.accounts, token, timeout=PROBE_WAIT_S)
        except KafoldError:
            with lock:
                counts["failed"] += 1
            return
        seen = time.time()
        with check_lock:
            found = check.execute(rows_query, (acc,)).fetchone()
        with lock:
            visible.append(seen - sent)
            counts["missing"] += 0 if found and found[0] else 1

    def read_results() -> None:
        try:
            read_until_stopped()
        except BaseException as e:  # the waits below fail at once on a dead reader, naming its error
            failure.append(e)
            raise

    def read_until_stopped() -> None:
        while not stop.is_set():
            for m in take(reader, 1000, 0.1, stop):
                if m.error() is not None:
                    continue
                at, cid = time.time(), header(m.headers(), H_COMMAND_ID)
                with lock:
                    read_upto[m.partition()] = m.offset() + 1
                    sent = sent_at.pop(cid, None) if cid else None
                    probe = probes.pop(cid, None) if cid else None
                    counts["results"] += 1
                if sent is not None:
                    results.append(at - sent)
                if probe is not None:
                    token = decode_result(m.value()).token
                    if token is None:
                        with lock:
                            counts["failed"] += 1
                    else:
                        waiters.submit(read_your_write, probe[0], token, probe[1])

    def send(cmd: Command, probe: str | None = None) -> None:
        key, value, headers = cmd.encode()
        with lock:
            if measuring[0]:
                sent_at[cmd.command_id] = time.time()
                if probe is not None:
                    probes[cmd.command_id] = (probe, sent_at[cmd.command_id])
        kafka_clients.produce(producer, commands, value, key, headers)

    def reading() -> bool:
        """True while the results reader runs; its error, raised, once it died."""
        if failure:
            raise RuntimeError(f"bench: the results reader of {results_topic} failed: {failure[0]!r}") from failure[0]
        return True

    def where() -> dict[str, Any]:
        """How far the phase is: results read (measured and all), probes answered, where the reader is by partition
        (noted by its own thread: confluent-kafka serializes calls on a consumer, so a `position` call from here would
        wait behind its polls)."""
        with lock:
            return {"results_read": counts["results"], "measured_results": len(results),
                    "awaited": len(sent_at), "probes_answered": len(visible) + counts["failed"],
                    "read_upto": dict(sorted(read_upto.items())), "started_at": ends}

    accounts = [f"acc-{i}" for i in range(args.accounts)]
    reader_thread = threading.Thread(target=read_results, daemon=True, name="bench-latency-results")
    reader_thread.start()
    try:
        # warm-up, not measured: the accounts the deposits go to, then `--warmup` seconds of deposits
        for acc in accounts:
            send(Command.new("account", acc, "OpenAccount", {"owner": acc}))
        warm = len(accounts) + _pace(producer, args.rate, args.warmup, lambda i: send(Command.new(
            "account", accounts[random.randrange(len(accounts))], "Deposit", {"amount": i % 97 + 1})))
        producer.flush(60)
        wait_progress(lambda: reading() and counts["results"] >= warm, where,
                      f"the warm-up's {warm} results on {results_topic} (read_committed)", poll_s=0.05)
        measuring[0] = True
        measured_from = time.time()
        probe_every = max(1, round(args.rate / args.probes)) if args.probes > 0 else 0
        run_id = uuid.uuid4().hex[:6]

        def one(i: int) -> None:
            if probe_every and i % probe_every == 0:
                acc = f"probe-{run_id}-{i}"
                counts["probes"] += 1
                send(Command.new("account", acc, "OpenAccount", {"owner": acc}), probe=acc)
            else:
                acc = accounts[random.randrange(len(accounts))]
                send(Command.new("account", acc, "Deposit", {"amount": i % 97 + 1}))

        sent = _pace(producer, args.rate, args.duration, one)
        producer.flush(30)
        wait_progress(lambda: reading() and len(results) >= sent and not probes
                      and len(visible) + counts["failed"] >= counts["probes"], where,
                      f"the results of the {sent} commands sent to {commands} on {results_topic} (read_committed) "
                      f"and the {counts['probes']} read-your-writes probes' waits", poll_s=0.05)
    finally:
        stop.set()
        reader_thread.join(10)
        waiters.shutdown(wait=True, cancel_futures=True)
        reader.close()
        check.close()
        kafka_clients.close_producer(producer, 10)
    return {"commands_sent": sent, "commands_sent_in_all": warm + sent, "commands_measured_from": measured_from,
            **_figures("command_to_result", results, sent),
            **_figures("read_your_writes", visible, counts["probes"]),
            "read_your_writes_missing": counts["missing"], "read_your_writes_wait_failed": counts["failed"]}
