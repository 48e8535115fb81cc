"""`kafold snapshot run|verify`: fold history into snapshots (Spark, or in-process when small); audit them."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kafold import config, logs, protect, tracing
from kafold.errors import ConfigError
from kafold.snapshot.fold import Domain
from kafold.snapshot.verify import verify
from kafold.spark_jobs import runs
from kafold.spark_jobs.runs import partitions_of
from kafold.spark_jobs.session import session
from kafold.terminal import visible
from kafold.tools import commands
from kafold.tools.cli import add_config_arg

log = logs.get("kafold.snapshot")
EX_TEMPFAIL = 75  # another run holds the lock


def register(sub: Any) -> None:
    p = sub.add_parser("snapshot", help="snapshot aggregate state with Spark; verify snapshots against replay")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = actions.add_parser("run", help="fold new events into snapshots (incremental; Spark or in-process)")
    add_run_arguments(run)
    run.set_defaults(handler=handle_run)
    ver = actions.add_parser("verify", help="recompute state from scratch and compare with snapshot + tail")
    add_config_arg(ver)
    ver.add_argument("--aggregate", metavar="NAME", help="only this aggregate type (default: all)")
    ver.add_argument("--sample", type=int, metavar="N", help="check N random aggregates per partition (default: all)")
    ver.set_defaults(handler=handle_verify)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arg(p)
    p.add_argument("--aggregate", metavar="NAME", help="only this aggregate type (default: all)")
    p.add_argument("--master", metavar="URL",
                   help="Spark master (default [snapshots].spark_master, local[*]; under spark-submit: its --master)")
    p.add_argument("--engine", choices=("auto", "spark", "local"),
                   help="fold with Spark, in this process, or auto: in this process when at most "
                        "[snapshots].local_max_events are unfolded (default [snapshots].engine, auto)")
    p.add_argument("--refresh-lag", type=int, default=None, metavar="OFFSETS",
                   help="move unchanged snapshots lagging the end by more than this forward (default 100000)")
    p.add_argument("--no-progress", action="store_true",
                   help="draw no progress bar even on a terminal (the daemon's scheduled runs: nobody watches them)")


def selected_aggregates(cfg: config.KafoldConfig, name: str | None, path: str, doing: str = "snapshot"
                        ) -> list[config.AggregateConfig]:
    """The aggregates a command works on: all, or the one `--aggregate` names; ConfigError naming the problem."""
    if not cfg.aggregates:
        raise ConfigError([f"{path}: aggregates: no [[aggregates]] configured, nothing to {doing}"])
    if name is None:
        return list(cfg.aggregates)
    found = [a for a in cfg.aggregates if a.name == name]
    if not found:
        names = ", ".join(a.name for a in cfg.aggregates)
        raise ConfigError([f"{path}: --aggregate: no aggregate named {name!r} (configured: {names})"])
    return found


def python_paths(loaded: config.Loaded) -> list[str]:
    """`daemon.python_path`, resolved against the configuration file's folder."""
    return [str((loaded.base / p).resolve()) for p in loaded.config.daemon.python_path]


@contextlib.contextmanager
def run_lock(config_path: str) -> Iterator[bool]:
    """An exclusive, non-blocking lock per configuration file: yields False when another run holds it."""
    digest = hashlib.sha256(str(Path(config_path).resolve()).encode()).hexdigest()[:16]
    path = Path(os.environ.get("KAFOLD_LOCK_DIR") or tempfile.gettempdir()) / f"kafold-snapshot-{digest}.lock"
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _reporter(name: str, wanted: bool = True) -> tuple[Any, Any]:
    """(progress context, reporter callback): a rich bar on a TTY when `wanted`, nothing otherwise (logs carry
    progress)."""
    if not (wanted and sys.stderr.isatty()):
        return contextlib.nullcontext(), None
    progress = Progress(TextColumn(f"snapshot {name}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("partitions · {task.fields[events]:,} events · {task.fields[rate]:,.0f}/s"),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = progress.add_task(name, total=None, events=0, rate=0.0)
    began = time.monotonic()

    def report(done: int, total: int, events: int) -> None:
        progress.update(task, completed=done, total=total, events=events,
                        rate=events / max(1e-9, time.monotonic() - began))
    return progress, report


def handle_run(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    cfg = commands.effective(loaded.config, ("kafka",))
    aggs = selected_aggregates(cfg, args.aggregate, args.config)
    protect.build(cfg)  # protected fields: events opened, snapshot states sealed (kafold.protect)
    tracing.configure(cfg.tracing)  # one span per aggregate's run when [tracing].enabled
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit chose the master
    master = args.master or (None if under_submit else cfg.snapshots.spark_master)
    engine = args.engine or cfg.snapshots.engine
    started: dict[str, Any] = {}

    def spark() -> Any:  # started on first use: a run that folds in-process never starts a JVM
        if "session" not in started:
            began = time.monotonic()
            started["session"] = session(master, cfg.snapshots.spark_conf)
            started["startup_s"] = time.monotonic() - began
        return started["session"]

    with run_lock(args.config) as locked:
        if not locked:
            print("another snapshot run for this configuration is in progress; skipped", file=sys.stderr)
            return EX_TEMPFAIL
        began = time.monotonic()
        results = []
        for agg in aggs:
            display, report = _reporter(agg.name, wanted=not args.no_progress)
            tracer = tracing.tracer()
            with display, (tracer.start_as_current_span(f"snapshot {agg.name}", attributes={
                    "kafold.aggregate": agg.name}) if tracer is not None else contextlib.nullcontext()) as span:
                results.append(runs.run(cfg.kafka, agg, python_paths(loaded), spark, engine=engine,
                                        local_max_events=cfg.snapshots.local_max_events, reporter=report,
                                        refresh_lag=args.refresh_lag or runs.REFRESH_LAG,
                                        protection=protect.setup(cfg)))
                if span is not None:
                    span.set_attributes({"kafold.engine": results[-1].engine,
                                         "kafold.events_folded": results[-1].events_folded,
                                         "kafold.snapshots": results[-1].snapshots})
    tracing.shutdown()  # export the run's spans before the process ends
    total = time.monotonic() - began
    startup = started.get("startup_s", 0.0)
    print(f"{'AGGREGATE':<20} {'ENGINE':<6} {'PARTITIONS':>10} {'EVENTS FOLDED':>14} {'SNAPSHOTS':>10} "
          f"{'AGGREGATES':>10} {'BAD':>6} {'TIME':>8} {'EVENTS/S':>10}")
    for r in results:
        print(f"{r.aggregate:<20} {r.engine:<6} {r.partitions:>10} {r.events_folded:>14,} {r.snapshots:>10,} "
              f"{r.aggregates:>10,} {r.bad:>6} {r.duration_s:>7.2f}s {r.events_per_s:>10,.0f}")
        if r.rejected:
            print(f"  rejected snapshots (fell back to older snapshot or full replay): {r.rejected}")
    spark_note = f"spark start-up {startup:.2f}s, " if "session" in started else "no Spark job needed, "
    print(f"{spark_note}jobs {total - startup:.2f}s, total {total:.2f}s")
    log.info("snapshot.summary", aggregates=len(results), events_folded=sum(r.events_folded for r in results),
             snapshots=sum(r.snapshots for r in results), engines=sorted({r.engine for r in results}),
             spark_startup_s=round(startup, 2) if "session" in started else None, jobs_s=round(total - startup, 2))
    return 0


def handle_verify(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    cfg = commands.effective(loaded.config, ("kafka",))
    protect.build(cfg)  # protected fields: events and sealed snapshot states opened (kafold.protect)
    if args.sample is not None and args.sample < 1:
        raise ConfigError(["--sample: must be >= 1"])
    bad = 0
    for agg in selected_aggregates(cfg, args.aggregate, args.config):
        domain = Domain.load(agg, python_paths(loaded))
        report = verify(cfg.kafka, agg, domain, partitions_of(cfg.kafka, agg), args.sample)
        print(f"{agg.name}: fingerprint {visible(domain.identity.fingerprint)}: {report.checked} aggregates checked, "
              f"{report.snapshots_used} snapshots used, {len(report.mismatches)} mismatches")
        for m in report.mismatches:
            print(visible(f"  MISMATCH {agg.name} {m.aggregate_id} (partition {m.partition}): {m.problem}"))
        bad += len(report.mismatches)
    return 1 if bad else 0
