"""`kafold events audit`: whether every stored event of an aggregate decodes, upcasts and folds under today's code."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaException
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kafold import config, logs, protect
from kafold.config import AggregateConfig, FoldErrorPolicy, KafkaConfig
from kafold.errors import ConfigError, FatalError, RetriableError
from kafold.fold import Parked, fields
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain, folder
from kafold.spark_jobs import runs, source
from kafold.spark_jobs.progress import watch
from kafold.spark_jobs.session import session
from kafold.stages import FOLD_STAGES, Stage
from kafold.terminal import visible
from kafold.tools import commands
from kafold.tools.cli import add_config_arg
from kafold.tools.commands import history
from kafold.tools.commands.snapshot import python_paths, selected_aggregates

log = logs.get("kafold.events")
UNKNOWN = "?"  # type and schema version of a record that is no event body
FIRST = 3  # failing events named per (type, schema version)
ERROR_CHARS = 400  # an error's text is cut there (a payload quoted in an exception stays out of the report)
Reporter = Callable[[int, int], None]  # (offsets read, offsets in the captured ranges)


def register(sub: Any) -> None:
    p = sub.add_parser("events", help="an aggregate's stored events: list one aggregate's history, index it, "
                       "check them all against the current code")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    audit = actions.add_parser(
        "audit", help="count events per type and schema version; report which do not decode, upcast or fold")
    add_config_arg(audit)
    audit.add_argument("--aggregate", metavar="NAME", help="only this aggregate type (default: all)")
    audit.add_argument("--topic", metavar="T",
                       help="audit this topic instead of the aggregate's events topic (needs one aggregate)")
    audit.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    audit.add_argument("--engine", choices=("auto", "spark", "local"),
                       help="read with Spark, in this process, or auto: in this process when the topic holds at most "
                            "[snapshots].local_max_events offsets (default [snapshots].engine, auto)")
    audit.add_argument("--master", metavar="URL",
                       help="Spark master (default [snapshots].spark_master; under spark-submit: its --master)")
    audit.add_argument("--no-progress", action="store_true", help="draw no progress bar even on a terminal")
    audit.set_defaults(handler=handle_audit)
    history.register_actions(actions)


# ---- the report ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    partition: int
    offset: int
    stage: Stage
    error: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class AuditRow:
    """The events of one (type, schema version): how many, how many read and folded, failures per stage."""

    type: str
    schema_version: Any
    events: int = 0
    ok: int = 0
    failed: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in FOLD_STAGES})
    first: list[Failure] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "schema_version": self.schema_version, "events": self.events, "ok": self.ok,
                "failed": dict(self.failed), "first_failures": [f.to_json() for f in self.first]}


@dataclass
class Audit:
    """One topic read under one aggregate's code."""

    aggregate: str
    topic: str
    partitions: int = 0
    engine: str = "local"
    rows: dict[tuple[str, str], AuditRow] = field(default_factory=dict)
    skipped: int = 0  # counted ok: versions already folded (duplicates), which no fold ever reads
    duration_s: float = 0.0

    @property
    def events(self) -> int:
        return sum(r.events for r in self.rows.values())

    @property
    def failed(self) -> int:
        return sum(r.events - r.ok for r in self.rows.values())

    def row(self, type_name: Any, version: Any) -> AuditRow:
        key = (str(type_name), str(version))
        found = self.rows.get(key)
        if found is None:
            found = self.rows[key] = AuditRow(str(type_name), version)
        return found

    def sorted_rows(self) -> list[AuditRow]:
        return sorted(self.rows.values(), key=lambda r: (r.type == UNKNOWN, r.type, _version_order(r.schema_version)))

    def parts(self) -> dict[str, Any]:
        """What a Spark task hands back (plain data)."""
        return {"rows": [r.to_json() for r in self.rows.values()], "skipped": self.skipped}

    def absorb(self, parts: dict[str, Any]) -> None:
        """Add a task's `parts`: counts summed, the first failures kept in partition and offset order."""
        self.skipped += parts["skipped"]
        for r in parts["rows"]:
            row = self.row(r["type"], r["schema_version"])
            row.events += r["events"]
            row.ok += r["ok"]
            for stage, n in r["failed"].items():
                row.failed[stage] += n
            theirs = [Failure(**{**f, "stage": Stage(f["stage"])}) for f in r["first_failures"]]
            row.first = sorted([*row.first, *theirs], key=lambda f: (f.partition, f.offset))[:FIRST]

    def to_json(self) -> dict[str, Any]:
        return {"aggregate": self.aggregate, "topic": self.topic, "partitions": self.partitions, "engine": self.engine,
                "events": self.events, "ok": self.events - self.failed, "failed": self.failed, "skipped": self.skipped,
                "duration_s": round(self.duration_s, 3), "types": [r.to_json() for r in self.sorted_rows()]}


def _version_order(version: Any) -> tuple[int, int, str]:
    return (0, version, "") if type(version) is int else (1, 0, str(version))


# ---- classifying what the fold parked --------------------------------------------------------------------------
def auditing(domain: Domain) -> Domain:
    """The snapshot runs' domain with every failure collected, never raised (the fold goes on past it, as under
    `on_fold_error = "dead-letter"`); the fold names each failure's stage."""
    return dataclasses.replace(domain, on_fold_error=FoldErrorPolicy.DEAD_LETTER)


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:ERROR_CHARS]


def classify(parked: Parked) -> tuple[Stage, str]:
    """(stage, error text) of an event the fold parked: the stage the fold set (kafold.stages)."""
    return parked.error.stage, _described(parked.error.error)


def identify(value: bytes | None) -> tuple[Any, Any]:
    """(type, schema version) of a record as stored; UNKNOWN for both when it is no event body."""
    try:
        body = fields(value)
    except Exception:
        return UNKNOWN, UNKNOWN
    return body.type, getattr(body, "schema_version", 1)


def tally(audit: Audit, partition: int, offsets: list[int], values: list[bytes | None],
          parked: list[Parked]) -> None:
    """Count one folded batch: every record under its stored type and version, ok unless the fold parked it."""
    failed = {p.offset: p for p in parked}
    for offset, value in zip(offsets, values, strict=True):
        row = audit.row(*identify(value))
        row.events += 1
        bad = failed.get(offset)
        if bad is None:
            row.ok += 1
            continue
        stage, error = classify(bad)
        row.failed[stage] += 1
        if len(row.first) < FIRST:
            row.first.append(Failure(partition, offset, stage, error))


# ---- reading -----------------------------------------------------------------------------------------------------
def _partitions(consumer: Consumer, topic: str) -> list[int]:
    """The topic's partitions (a metadata request); FatalError when the broker does not know it."""
    try:
        meta = consumer.list_topics(topic, timeout=15)
    except KafkaException as e:
        raise RetriableError(f"{topic}: cannot read metadata: {e}") from e
    found = meta.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise FatalError(f"topic {topic!r} does not exist (or is not readable); run `kafold topics ensure`")
    return sorted(found.partitions)


Bounds = dict[int, tuple[int, int]]  # partition -> (first offset, end offset captured at the start)


def capture(kafka: KafkaConfig, topic: str) -> Bounds:
    """Every partition of `topic` with its first offset and its end now (the fetch path's, read_committed)."""
    consumer = kafka_io.reader(kafka)
    try:
        return kafka_io.bounds_many(consumer, topic, _partitions(consumer, topic))
    finally:
        consumer.close()


def audit_partition(consumer: Consumer, checked: Domain, result: Audit, partition: int, low: int, end: int,
                    report: Callable[[int], None] | None = None) -> None:
    """Fold one partition's offsets [low, end) with the `auditing` domain into `result`; `report(offsets read)`."""
    fold = folder(checked, partition=partition)
    for offsets, keys, values in kafka_io.read_range(consumer, result.topic, partition, low, end):
        fold.fold(offsets, keys, values)
        tally(result, partition, offsets, values, fold.parked)
        fold.parked.clear()
        if report is not None:
            report(offsets[-1] + 1 - low)
    result.skipped += fold.skipped
    log.info("events.audit_partition_done", aggregate=result.aggregate, topic=result.topic, partition=partition,
             events=fold.read, folded=fold.folded, skipped=fold.skipped, failed=fold.bad)


def audit_local(kafka: KafkaConfig, domain: Domain, result: Audit, bounds: Bounds,
                report: Reporter | None = None) -> None:
    """Every partition in this process, one after the other (one partition's states in memory at a time)."""
    checked = auditing(domain)
    total, covered = sum(end - low for low, end in bounds.values()), 0
    consumer = kafka_io.reader(kafka)
    try:
        for p, (low, end) in sorted(bounds.items()):
            audit_partition(consumer, checked, result, p, low, end, _shifted(report, covered, total))
            covered += end - low
    finally:
        consumer.close()


def _shifted(report: Reporter | None, before: int, total: int) -> Callable[[int], None] | None:
    """A partition's `report(offsets read in it)` as the whole audit's `report(offsets read, total)`."""
    if report is None:
        return None
    return lambda n: report(before + n, total)


def _spark_task(kafka: KafkaConfig, agg: AggregateConfig, python_path: list[str], topic: str, counter: Any,
                item: tuple[int, int, int]) -> dict[str, Any]:
    """One Spark task: audit one partition's range on an executor, hand back its rows (`Audit.absorb`). The
    configurations travel pickled (secrets as their references, `env:` / `file:`), nested settings included."""
    p, low, end = item
    part = Audit(agg.name, topic)
    consumer = kafka_io.reader(kafka)
    try:
        audit_partition(consumer, auditing(source.domain_of(agg, python_path)), part, p, low, end)
    finally:
        consumer.close()
    counter.add(end - low)
    return part.parts()


def audit_spark(spark: Any, kafka: KafkaConfig, agg: AggregateConfig, python_path: list[str], result: Audit,
                bounds: Bounds, report: Reporter | None = None) -> None:
    """One Spark task per partition (its range captured here, on the driver), as a snapshot run's job folds."""
    items = [(p, low, end) for p, (low, end) in sorted(bounds.items()) if end > low]
    if not items:
        return
    sc = spark.sparkContext
    counter = sc.accumulator(0)
    total = sum(end - low for _, low, end in items)
    sc.setJobGroup(f"kafold-events-audit-{agg.name}", f"events audit {agg.name}")
    task = functools.partial(_spark_task, kafka, agg, python_path, result.topic, counter)
    with watch(spark, len(items), counter, None if report is None else lambda _d, _t, n: report(n, total)):
        for part in sc.parallelize(items, len(items)).map(task).collect():
            result.absorb(part)


def choose(engine: str, bounds: Bounds, local_max_events: int) -> str:
    """The snapshot runs' rule (`kafold.spark_jobs.runs.choose`): with auto, local when the offsets to read are at
    most `local_max_events`."""
    planned = runs.RunPlan(pending={p: end - low for p, (low, end) in bounds.items()})
    return runs.choose(engine, planned, local_max_events)


# ---- the command -------------------------------------------------------------------------------------------------
def _aggregates(cfg: config.KafoldConfig, name: str | None, topic: str | None, path: str) -> list[AggregateConfig]:
    if name is None and topic is not None and len(cfg.aggregates) > 1:
        names = ", ".join(a.name for a in cfg.aggregates)
        raise ConfigError([f"--topic: name the aggregate whose code reads it with --aggregate (configured: {names})"])
    return selected_aggregates(cfg, name, path, "audit")


@contextlib.contextmanager
def _progress(name: str, bar: bool) -> Iterator[Reporter]:
    """A rich bar on stderr when `bar` (a terminal), as `kafold snapshot run` draws; otherwise a log line at most
    every 5 s."""
    if not bar:
        last = [time.monotonic()]

        def line(done: int, total: int) -> None:
            if time.monotonic() - last[0] >= 5.0:
                last[0] = time.monotonic()
                log.info("events.audit_progress", aggregate=name, offsets=done, of=total)
        yield line
        return
    progress = Progress(TextColumn(f"audit {visible(name)}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("offsets · {task.fields[rate]:,.0f}/s"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    task = progress.add_task(name, total=None, rate=0.0)
    began = time.monotonic()

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total, rate=done / max(1e-9, time.monotonic() - began))
    with progress:
        yield update


def _table(audit: Audit) -> list[str]:
    out = [f"{visible(audit.topic)} (aggregate {audit.aggregate}): {audit.events:,} events in {audit.partitions} "
           f"partitions, {audit.failed:,} not readable or foldable under the current code ({audit.engine}, "
           f"{audit.duration_s:.2f}s)",
           f"{'TYPE':<28} {'VERSION':>7} {'EVENTS':>10} {'OK':>10} "
           + " ".join(f"{s.upper():>7}" for s in FOLD_STAGES)]
    for r in audit.sorted_rows():
        out.append(f"{visible(r.type):<28} {visible(r.schema_version):>7} {r.events:>10,} {r.ok:>10,} "
                   + " ".join(f"{r.failed[s]:>7,}" for s in FOLD_STAGES))
    for r in audit.sorted_rows():
        for f in r.first:
            out.append(f"  FAILED {visible(r.type)} v{visible(r.schema_version)} at {f.partition}:{f.offset} "
                       f"({f.stage}): {visible(f.error)}")
    return out


def _complaints(audit: Audit) -> list[str]:
    """One stderr line per (type, schema version) with failures: counts per stage and the first offset."""
    lines = []
    for r in audit.sorted_rows():
        if r.ok == r.events:
            continue
        stages = ", ".join(f"{n} {s}" for s, n in r.failed.items() if n)
        first = r.first[0]
        lines.append(f"{audit.aggregate}: {visible(r.type)} v{visible(r.schema_version)}: {r.events - r.ok} of "
                     f"{r.events} events fail ({stages}); first at {visible(audit.topic)} {first.partition}:"
                     f"{first.offset}: {visible(first.error)}")
    return lines


def audit_one(cfg: config.KafoldConfig, agg: AggregateConfig, domain: Domain, python_path: list[str], topic: str,
              engine: str, spark: Callable[[], Any], bar: bool) -> Audit:
    """Capture the topic's ends, choose the engine by the snapshot runs' rule and audit it."""
    began = time.monotonic()
    bounds = capture(cfg.kafka, topic)
    chosen = choose(engine, bounds, cfg.snapshots.local_max_events)
    result = Audit(agg.name, topic, partitions=len(bounds), engine=chosen)
    log.info("events.audit_started", aggregate=agg.name, topic=topic, partitions=len(bounds), engine=chosen,
             configured=engine, offsets=sum(end - low for low, end in bounds.values()))
    session = spark() if chosen == "spark" else None  # started before the bar is drawn (it logs)
    with _progress(agg.name, bar) as report:
        if session is None:
            audit_local(cfg.kafka, domain, result, bounds, report)
        else:
            audit_spark(session, cfg.kafka, agg, python_path, result, bounds, report)
    result.duration_s = time.monotonic() - began
    log.info("events.audit_done", aggregate=agg.name, topic=topic, engine=chosen, partitions=result.partitions,
             events=result.events, failed=result.failed, types=len(result.rows), duration_s=round(result.duration_s, 2))
    return result


def handle_audit(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    aggs = _aggregates(loaded.config, args.aggregate, args.topic, args.config)
    cfg = commands.effective(loaded.config, ("kafka",))
    path = python_paths(loaded)
    protect.build(cfg)  # protected fields opened as every fold opens them (kafold.protect)
    domains = [(agg, Domain.load(agg, path)) for agg in aggs]  # every reference resolves before any read
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit chose the master
    master = args.master or (None if under_submit else cfg.snapshots.spark_master)
    started: dict[str, Any] = {}

    def spark() -> Any:  # started on first use: an audit read in this process never starts a JVM
        if "session" not in started:
            started["session"] = session(master, cfg.snapshots.spark_conf, app="kafold-events-audit")
        return started["session"]

    bar = not (args.no_progress or args.json) and sys.stderr.isatty()
    engine = args.engine or cfg.snapshots.engine
    audits = [audit_one(cfg, agg, domain, path, args.topic or agg.topic("events"), engine, spark, bar)
              for agg, domain in domains]
    failed = sum(a.failed for a in audits)
    if args.json:
        print(json.dumps({"ok": not failed, "aggregates": [a.to_json() for a in audits]}, sort_keys=True))
    else:
        for a in audits:
            print("\n".join(_table(a)))
    for a in audits:
        for line in _complaints(a):
            print(line, file=sys.stderr)
    return 1 if failed else 0
