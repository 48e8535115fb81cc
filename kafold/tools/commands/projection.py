"""`kafold projection rebuild|status|verify|refresh NAME -c FILE`: blue-green rebuilds of a postgres-projection
connector, the check that its live table equals a fold of its events, and a forgotten subject's rows folded again."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kafold import config, db, devstack, logs, protect
from kafold.connectors.projection import rebuild as rb
from kafold.connectors.projection import rebuild_state
from kafold.connectors.projection import verify as vf
from kafold.connectors.projection.subject_refresh import Refresh
from kafold.terminal import visible
from kafold.tools.cli import add_config_arg
from kafold.tools.commands.status import table

log = logs.get(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser("projection", help="rebuild a PostgreSQL projection without downtime, or show its rebuild")
    psub = p.add_subparsers(dest="projection_command", metavar="ACTION", required=True)
    rb = psub.add_parser("rebuild", help="replay the source topics into a shadow table, then swap it in "
                         "atomically (resumes a rebuild that was interrupted)")
    rb.add_argument("name", help="the connector's name")
    add_config_arg(rb)
    rb.add_argument("--keep-old", action="store_true", help="keep the replaced table as <table>_old_<timestamp>")
    rb.add_argument("--batch", type=int, default=5000, help="records per shadow transaction (default 5000)")
    rb.add_argument("--max-tail", type=int, default=20000,
                    help="swap once the shadow is at most this many records behind the live connector on every "
                    "partition; the tail is applied while the live table is locked (default 20000)")
    rb.add_argument("--workers", type=int, default=None, metavar="N",
                    help="processes copying the history, each its own partitions (default: the cores, at most 4; "
                    "1 when the projection has version_guard = false)")
    rb.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    rb.set_defaults(handler=rebuild)
    st = psub.add_parser("status", help="the projection's rebuild: phase, progress, shadow vs live offsets")
    st.add_argument("name", help="the connector's name")
    add_config_arg(st)
    st.set_defaults(handler=status)
    ve = psub.add_parser("verify", help="fold the source topics into a scratch table up to the live checkpoints and "
                         "compare it with the live table row by row (exit 1 on any difference)")
    ve.add_argument("name", help="the connector's name")
    add_config_arg(ve)
    ve.add_argument("--batch", type=int, default=5000, help="records per scratch transaction (default 5000)")
    ve.add_argument("--limit", type=int, default=1000, metavar="N",
                    help="show at most N differing rows (all are counted; default 1000)")
    ve.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ve.add_argument("--no-progress", action="store_true", help="draw no progress bar even on a terminal")
    ve.set_defaults(handler=verify)
    rf = psub.add_parser("refresh", help="after `kafold subjects forget S`: fold the rows S's events made again (its "
                         "protected fields then read as the placeholder), leaving every other row alone")
    rf.add_argument("name", help="the connector's name")
    rf.add_argument("--subject", required=True, help="the forgotten subject (as `kafold subjects forget` took it)")
    add_config_arg(rf)
    rf.add_argument("--batch", type=int, default=5000, help="records per scratch transaction (default 5000)")
    rf.add_argument("--no-progress", action="store_true", help="draw no progress bar even on a terminal")
    rf.set_defaults(handler=refresh)


def _plan(args: argparse.Namespace) -> Any:
    loaded = config.load_file(args.config)
    chosen = rb.plan(loaded.config, loaded.base, args.name)  # an unknown name fails before any connection
    cfg = devstack.effective(loaded.config)
    protect.build(cfg)  # protected fields read in clear, or as the placeholder once forgotten (kafold.protect)
    return dataclasses.replace(chosen, kafka=cfg.kafka, pgc=cfg.postgres)


def rebuild(args: argparse.Namespace) -> int:
    plan = _plan(args)
    if plan.pgc.migrate_on_start:
        db.upgrade(plan.pgc)
    bar = not args.no_progress and sys.stderr.isatty()
    with _reporter(bar, plan.name) as report:
        result = rb.Rebuild(plan, keep_old=args.keep_old, batch=args.batch, max_tail=args.max_tail,
                            workers=args.workers, on_progress=report).run()
    if result.phase == "swapped":
        print(f"{plan.name}: swapped; {plan.config.schema}.{plan.config.table} is the rebuilt table "
              f"({result.done} offsets, {result.events} events applied in this run)")
    else:
        print(f"{plan.name}: stopped in phase {result.phase} ({result.done} offsets covered, {result.behind} "
              "behind the live connector); run the same command again to resume")
    return 0 if result.phase == "swapped" else 1


class Eta:
    """The bar's figures from successive progress reports: records applied per second, and the time until the
    swap — the records behind the live connector over the rate at which that gap closes (smoothed)."""

    SMOOTHING = 0.3

    def __init__(self) -> None:
        self.last: tuple[float, int, int] | None = None  # (time, events applied, behind)
        self.rate = 0.0
        self.closing = 0.0

    def update(self, now: float, events: int, behind: int) -> None:
        if self.last is not None and now > self.last[0]:
            dt = now - self.last[0]
            a = self.SMOOTHING
            self.rate = (1 - a) * self.rate + a * (events - self.last[1]) / dt
            self.closing = (1 - a) * self.closing + a * (self.last[2] - behind) / dt
        self.last = (now, events, behind)

    def seconds(self, behind: int) -> float | None:
        """None while the gap is not closing (the ETA is unknown, not zero)."""
        if behind <= 0:
            return 0.0
        return behind / self.closing if self.closing > 0 else None


def describe(p: Any, eta: Eta) -> str:
    """One line: phase, records behind the live connector, rate and ETA until the swap (or that it swapped)."""
    if p.phase == "swapped":
        return "swapped: the rebuilt table is live (behind 0)"
    left = eta.seconds(p.behind)
    when = "unknown" if left is None else f"{int(left) // 60}:{int(left) % 60:02d}"
    return f"{p.phase}: behind {p.behind:,} records, {eta.rate:,.0f} ev/s, ETA to swap {when}"


@contextmanager
def _reporter(bar: bool, name: str) -> Iterator[Callable[[Any], None]]:
    """A rich status line (phase, behind, rate, ETA until the swap) on a TTY; one structlog line per batch
    otherwise."""
    eta = Eta()
    if not bar:
        def line(p: Any) -> None:
            eta.update(time.monotonic(), p.events, p.behind)
            left = eta.seconds(p.behind)
            log.info("rebuild.batch", projection=name, phase=p.phase, records=p.batch, covered=p.done,
                     target=p.total, applied=p.events, behind=p.behind, rate=round(eta.rate),
                     eta_s=None if left is None else round(left, 1))
        yield line
        return
    columns = (SpinnerColumn(), TextColumn("[bold]rebuild {task.fields[name]}"), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("starting", total=None, name=name)

        def update(p: Any) -> None:
            eta.update(progress.get_time(), p.events, p.behind)
            progress.update(task, description=describe(p, eta))
        yield update


def status(args: argparse.Namespace) -> int:
    plan = _plan(args)
    row = rebuild_state.state(plan.pgc, plan.name)
    console = Console()
    if row is None:
        console.print(f"{plan.name}: never rebuilt")
        return 0
    console.print(f"{plan.name}: [bold]{row['phase']}[/bold]  shadow {plan.config.schema}.{row['shadow_table']}  "
                  f"started {row['started_at']:%Y-%m-%d %H:%M:%S %Z}  updated {row['updated_at']:%Y-%m-%d %H:%M:%S %Z}"
                  f"  offsets covered {row['events']:,}")
    live, shadow = rebuild_state.offsets(plan.pgc, plan.name), rebuild_state.offsets(plan.pgc, plan.key)
    if row["phase"] in rebuild_state.ACTIVE:
        table = Table("topic", "partition", "shadow", "live", "behind")
        for tp in sorted(set(live) | set(shadow), key=lambda t: (t.topic, t.partition)):
            s, li = shadow.get(tp, 0), live.get(tp, 0)
            table.add_row(tp.topic, str(tp.partition), str(s), str(li), str(max(0, li - s)))
        console.print(table)
    return 0


def verify(args: argparse.Namespace) -> int:
    """0 when the live table equals the fold of its events up to its checkpoints, 1 otherwise."""
    plan = _plan(args)
    if plan.pgc.migrate_on_start:
        db.upgrade(plan.pgc)
    bar = not (args.no_progress or args.json) and sys.stderr.isatty()
    with _verify_progress(bar, plan.name) as report:
        result = vf.Verify(plan, batch=args.batch, limit=args.limit, on_progress=report).run()
    if args.json:
        print(json.dumps(result.as_json(), sort_keys=True))
        return 0 if result.clean else 1
    covered = sum(result.checkpoints.values())
    if not result.completed:
        print(f"{plan.name}: stopped before the comparison ({result.events} events folded)")
    elif result.clean:
        print(f"{plan.name}: clean: {result.table} ({result.live_rows} rows) equals the fold of its events below the "
              f"live checkpoints ({covered} offsets, {result.events} events applied)")
    else:
        print(f"{plan.name}: {result.rows_differing} row(s) differ: {result.table} has {result.live_rows} rows, the "
              f"fold of its events below the live checkpoints ({covered} offsets) {result.expected_rows}")
        rows = [{"kind": d.kind, "key": ", ".join(f"{k}={v}" for k, v in d.key.items()), "column": d.column,
                 "live": d.live, "expected": d.expected} for d in result.differences]
        print(table(rows, ("kind", "key", "column", "live", "expected")))
        if result.rows_differing > len({tuple(d.key.items()) for d in result.differences}):
            print(visible(f"(the first {args.limit} rows shown; --limit N shows more)"))
    return 0 if result.clean else 1


def refresh(args: argparse.Namespace) -> int:
    """0 once the subject's rows were folded again (or it has none); 1 when stopped before, or when some of its rows
    were left alone (held behind a dead letter)."""
    plan = _plan(args)
    if plan.pgc.migrate_on_start:
        db.upgrade(plan.pgc)
    bar = not args.no_progress and sys.stderr.isatty()
    with _verify_progress(bar, plan.name, "refresh") as report:
        result = Refresh(plan, [args.subject], batch=args.batch, on_progress=report).run()
    table = f"{plan.config.schema}.{plan.config.table}"
    if not result.completed:
        print(f"{plan.name}: stopped before the rows were replaced ({result.events} events folded); run it again")
        return 1
    if not result.keys:
        print(f"{plan.name}: no row of {table} was made by events of subject {args.subject!r}; nothing to refresh")
    else:
        print(f"{plan.name}: {result.rows} row(s) of {table} folded again from their events ({result.keys} made by "
              f"events of subject {args.subject!r}; {result.events} events read)")
    if result.held:
        print(f"{plan.name}: {result.held} row(s) of subject {args.subject!r} left as they were: their key is held "
              "behind a dead letter (`kafold dlq list`); replay or discard it, then run the refresh again")
        return 1
    return 0


@contextmanager
def _verify_progress(bar: bool, name: str, what: str = "verify") -> Iterator[Callable[[Any], None]]:
    """A progress bar of the offsets folded out of the live checkpoints on a TTY; a log line per batch otherwise."""
    if not bar:
        def line(p: Any) -> None:
            log.info(f"{what}.batch", projection=name, phase=p.phase, records=p.batch, covered=p.done,
                     target=p.total, applied=p.events)
        yield line
        return
    columns = (TextColumn(f"{what} {visible(name)}"), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("folding", total=None)

        def update(p: Any) -> None:
            progress.update(task, description="comparing" if p.phase == "comparing" else "folding",
                            completed=p.done, total=p.total)
        yield update
