"""Personal data and traces (issue 36): a projection over events with one protected field each, and the aggregate
runtime with protect rules, against the same work unprotected; the projection with tracing sampled at 1 % and
with tracing configured off, against the plain run. Each pair alternated in one run."""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import http.server
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from kafold import db, logs
from kafold.envelope import Event, encode
from kafold.protect import AGGREGATE_ID, PREFIX, Cipher, KeyRing, PgKeyStore, Protector, Rule
from kafold.tools.bench.aggregates import BANK, aggregate_throughput
from kafold.tools.bench.daemons import daemon_stack
from kafold.tools.bench.figures import median_ratio, rounded
from kafold.tools.bench.projection import produce_events, produce_records, run_projection

log = logs.get(__name__)

MASTER_VAR = "KAFOLD_BENCH_PRIVACY_MASTER"  # the daemon's master key: a secret reference, set in its environment
AGGREGATE = "account"  # the benchmark events' aggregate type (kafold.tools.bench.projection's AccountOpened, ...)
# One protected payload field per event, the subject being the aggregate (account) id.
PROTECTED = {"AccountOpened": "owner", "MoneyDeposited": "amount"}
# The sampled tracing run's SDK settings (the standard OTEL_* variables); export to SINK (accepts, discards).
SAMPLED = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
KINDS = ("protected", "sampled", "off")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=200_000, help="events per projection topic (default 200k)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of each pair (default 2)")
    p.add_argument("--commands", type=int, default=0,
                   help="commands per aggregate run (default events / 4; 0 with --no-aggregates skips it)")
    p.add_argument("--no-aggregates", action="store_true", help="skip the aggregate runtime pair")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the benchmark topics")
    p.add_argument("--batch", type=int, default=2500, help="daemon.batch_max_records")
    p.add_argument("--tasks", type=int, default=2, help="tasks_max of the connector (default 2: one per core)")
    p.add_argument("--task-processes", action=argparse.BooleanOptionalAction, default=True,
                   help="daemon.task_processes of every run (default: each task in its own process)")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack)")


def rules(aggregate: str) -> dict[tuple[str, str], Rule]:
    """The protect rules of PROTECTED for `aggregate`, as kafold.protect builds them from [[aggregates.protect]]."""
    return {(aggregate, t): Rule(((f,),), AGGREGATE_ID) for t, f in PROTECTED.items()}


def protect_toml(aggregate: str, topic_base: str, protect: bool, task_processes: bool) -> dict[str, Any]:
    """The daemon's extra settings of the protected projection's pair: the bank aggregate on topics of its own
    (idle: the projection reads the benchmark topic), with the protect rules (and [privacy]) or without them; both
    with the same task_processes (a task process builds its own key ring from the same references)."""
    agg: dict[str, Any] = {"name": aggregate, "initial": "bank_domain:initial", "evolve": "bank_domain:evolve",
                           "decide": "bank_domain:decide", "partitions": 1,
                           **{f"{k}_topic": f"{topic_base}.{k}" for k in ("events", "commands", "results",
                                                                          "snapshot")}}
    extra: dict[str, Any] = {"daemon": {"python_path": [str(BANK)], "task_processes": task_processes},
                             "aggregates": [agg]}
    if protect:
        agg["protect"] = [{"type": t, "fields": [f], "subject": AGGREGATE_ID} for t, f in PROTECTED.items()]
        extra["privacy"] = {"master_key_env": MASTER_VAR}
    return extra


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs.configure("warning")
    master = os.urandom(32)
    with contextlib.ExitStack() as stack:
        daemons = daemon_stack(stack, "privacy", args.config, args.broker)
        kafka = daemons.kafka
        sink = stack.enter_context(otlp_sink())
        store = PgKeyStore(daemons.postgres)  # subject_keys (kafold's tables, upgraded by daemon_stack)
        stack.callback(store.close)
        protector = Protector(rules(AGGREGATE), KeyRing(Cipher(master), store))
        run_id, base = daemons.run_id, daemons.name
        accounts = max(1, args.events // 10)
        plain_topic, sealed_topic = f"{base}.plain", f"{base}.protected"
        # The subjects (account ids) are this run's own: the data keys are in the stack's subject_keys, wrapped by
        # this run's random master key, which an earlier run's keys of the same subjects do not unwrap under.
        prefix = f"acc-{run_id}-"
        sizes = {"plain": produce_events(kafka, plain_topic, args.events, args.partitions, accounts, prefix=prefix),
                 "protected": produce_records(kafka, sealed_topic, args.events, args.partitions, accounts,
                                              sealed_record(protector), prefix)}
        env = {MASTER_VAR: base64.b64encode(master).decode()}
        tracing_env = {**SAMPLED, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url, "OTEL_TRACES_EXPORTER": "otlp"}
        # kind -> (topic, extra settings, extra environment) of it and of its baseline
        runs: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
            "protected": (sealed_topic, protect_toml(AGGREGATE, f"{base}.agg.p", True, args.task_processes), env),
            "unprotected": (plain_topic, protect_toml(AGGREGATE, f"{base}.agg.u", False, args.task_processes), {}),
            "sampled": (plain_topic, {"tracing": {"enabled": True}}, tracing_env),
            "off": (plain_topic, {"tracing": {"enabled": False}}, {}),
            "plain": (plain_topic, {}, {}),
        }
        baseline = {"protected": "unprotected", "sampled": "plain", "off": "plain"}
        rates: dict[str, list[float | None]] = {k: [] for k in runs}  # None: a run too small to time
        # the daemon's CPU (its process tree) per event: what a side costs, less moved by a shared machine's
        # scheduling than its rate
        cpu: dict[str, list[float | None]] = {k: [] for k in runs}
        left_sealed = 0
        for r in range(args.rounds):
            for kind in KINDS:
                for side in ((baseline[kind], kind) if r % 2 == 0 else (kind, baseline[kind])):
                    topic, extra, side_env = runs[side]
                    table = f"bench_{uuid.uuid4().hex[:8]}"
                    got = run_projection(dataclasses.replace(daemons, env={**daemons.env, **side_env}),
                                   f"{base}.{side}.{kind}.{r}", topic, table, args, None, extra)
                    rates[side].append(got["events_per_s"])
                    cpu[side].append(got["cpu_us_per_event"]["kafold"])
                    if side == "protected":
                        left_sealed += sealed_rows(daemons.postgres, table)
                    log.warning("bench.privacy_round", round=r, kind=side, events_per_s=rounded(rates[side][-1]))
        figures: dict[str, Any] = {"events": args.events, "rounds": args.rounds, "partitions": args.partitions,
                                   "tasks": args.tasks, "task_processes": args.task_processes, "value_bytes": sizes,
                                   **{f"{k}_events_per_s": [rounded(x) for x in v] for k, v in rates.items()},
                                   **{f"{k}_kafold_cpu_us_per_event": v for k, v in cpu.items()},
                                   "protected_rows_left_sealed": left_sealed,
                                   "tracing_export": "OTLP/HTTP to a local sink that accepts and discards",
                                   "otlp_requests": sink.requests, "otlp_bytes": sink.bytes}
        for kind in KINDS:
            figures[{"protected": "protected_projection_ratio", "sampled": "tracing_sampled_ratio",
                     "off": "tracing_off_ratio"}[kind]] = median_ratio(rates[kind], rates[baseline[kind]])
        # unprotected CPU per event over protected: the share of the protected side's cost that is the same work
        figures["protected_cpu_ratio"] = median_ratio(cpu["unprotected"], cpu["protected"])
        if not args.no_aggregates:
            figures.update(_aggregates(kafka, args, master, store))
    return figures


def _aggregates(kafka: Any, args: argparse.Namespace, master: bytes, store: PgKeyStore) -> dict[str, Any]:
    """commands/s of the aggregate runtime (in process, kafold.tools.bench.aggregates) with the protect rules and
    without, alternated; each run a fresh aggregate (its own topics and subjects' keys)."""
    commands = args.commands or max(1, args.events // 4)
    agg_args = argparse.Namespace(commands=commands, accounts=max(1, commands // 10), partitions=args.partitions,
                                  batch=2000, instances=1)
    rates: dict[str, list[float]] = {"protected": [], "unprotected": []}
    for r in range(args.rounds):
        for side in (("unprotected", "protected") if r % 2 == 0 else ("protected", "unprotected")):
            run_id = uuid.uuid4().hex[:6]
            name = f"bench.privacy.{run_id}"
            protector = Protector(rules(name), KeyRing(Cipher(master), store)) if side == "protected" else None
            got = aggregate_throughput(kafka, agg_args, protector=protector, name=name, prefix=f"acc-{run_id}-")
            rates[side].append(got["commands_per_s"])
            log.warning("bench.privacy_aggregates_round", round=r, kind=side, commands_per_s=got["commands_per_s"])
    return {"aggregate_commands": commands,
            "aggregates_commands_per_s": {k: [round(x) for x in v] for k, v in rates.items()},
            "protected_aggregates_ratio": median_ratio(rates["protected"], rates["unprotected"])}


def sealed_record(protector: Protector) -> Callable[[int, str, int], tuple[bytes | None, bytes, Any]]:
    """The projection bench's events with their PROTECTED field sealed as kafold writes them (keys in
    PostgreSQL under the master key)."""
    def record(i: int, acc: str, version: int) -> tuple[bytes | None, bytes, Any]:
        kind, payload = ("AccountOpened", {"owner": f"owner-{i}"}) if version == 1 else \
            ("MoneyDeposited", {"amount": i % 97 + 1})
        sealed = protector.seal(AGGREGATE, kind, acc, payload)
        return encode(Event.new(kind, AGGREGATE, acc, version, sealed))
    return record


def sealed_rows(pgc: Any, table: str) -> int:
    """Rows of the protected run's table whose owner is still sealed (0 when the daemon decrypted every event)."""
    # psycopg: kafold[daemon], not in the core install
    from psycopg import sql

    with db.connect(pgc) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE owner LIKE %s").format(sql.Identifier(table)),
                           (PREFIX + "%",)).fetchone()
    return int(row[0]) if row else 0


@dataclasses.dataclass
class Sink:
    url: str
    requests: int = 0
    bytes: int = 0


@contextlib.contextmanager
def otlp_sink() -> Iterator[Sink]:
    """A local OTLP/HTTP endpoint that accepts every export (200, an empty protobuf response) and discards it."""
    sink = Sink("")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            sink.requests += 1
            sink.bytes += len(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    sink.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="bench-otlp-sink")
    thread.start()
    try:
        yield sink
    finally:
        server.shutdown()
        server.server_close()
