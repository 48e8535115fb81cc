"""`kafold projection rebuild|status NAME -c FILE`: blue-green rebuilds of a postgres-projection connector."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.table import Table

from kafold import config, db, devstack, logs
from kafold.cli import add_config_arg

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
                    help="largest number of records applied while the live writer waits (default 20000)")
    rb.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    rb.set_defaults(handler=rebuild)
    st = psub.add_parser("status", help="the projection's rebuild: phase, progress, shadow vs live offsets")
    st.add_argument("name", help="the connector's name")
    add_config_arg(st)
    st.set_defaults(handler=status)


def _plan(args: argparse.Namespace) -> Any:
    from kafold.connectors.projection import rebuild as rb

    loaded = config.load_file(args.config)
    chosen = rb.plan(loaded.config, loaded.base, args.name)  # an unknown name fails before any connection
    cfg = devstack.effective(loaded.config)
    return rb.Plan(chosen.name, cfg.kafka, cfg.postgres, chosen.config, chosen.mapping, chosen.topics,
                   chosen.on_unknown)


def rebuild(args: argparse.Namespace) -> int:
    from kafold.connectors.projection import rebuild as rb

    plan = _plan(args)
    if plan.pgc.migrate_on_start:
        db.upgrade(plan.pgc)
    bar = not args.no_progress and sys.stderr.isatty()
    with _reporter(bar, plan.name) as report:
        result = rb.Rebuild(plan, keep_old=args.keep_old, batch=args.batch, max_tail=args.max_tail,
                            on_progress=report).run()
    print(f"{plan.name}: {plan.config.schema}.{plan.config.table} rebuilt from {result.done} offsets "
          f"({result.events} events applied in this run); phase {result.phase}")
    return 0 if result.phase == "swapped" else 1


@contextmanager
def _reporter(bar: bool, name: str) -> Iterator[Callable[[Any], None]]:
    """A rich progress bar (events, rate, ETA) on a TTY; one structlog line per batch otherwise."""
    if not bar:
        def line(p: Any) -> None:
            log.info("rebuild batch", projection=name, phase=p.phase, records=p.batch, covered=p.done,
                     target=p.total, applied=p.events)
        yield line
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
               TextColumn("{task.fields[rate]} ev/s"), TimeElapsedColumn(), TextColumn("ETA"),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task(f"rebuild {name}", total=None, rate="-")
        first: list[tuple[int, float]] = []

        def update(p: Any) -> None:
            now = progress.get_time()
            if not first:
                first.append((p.done, now))
            done0, t0 = first[0]
            rate = (p.done - done0) / (now - t0) if now > t0 else 0.0
            progress.update(task, completed=p.done, total=max(p.total, p.done),
                            description=f"rebuild {name} ({p.phase})", rate=f"{rate:,.0f}")
        yield update


def status(args: argparse.Namespace) -> int:
    from kafold.connectors.projection import rebuild as rb

    plan = _plan(args)
    row = rb.state(plan.pgc, plan.name)
    console = Console()
    if row is None:
        console.print(f"{plan.name}: never rebuilt")
        return 0
    console.print(f"{plan.name}: [bold]{row['phase']}[/bold]  shadow {plan.config.schema}.{row['shadow_table']}  "
                  f"started {row['started_at']:%Y-%m-%d %H:%M:%S %Z}  updated {row['updated_at']:%Y-%m-%d %H:%M:%S %Z}"
                  f"  offsets covered {row['events']:,}")
    live, shadow = rb.offsets(plan.pgc, plan.name), rb.offsets(plan.pgc, plan.key)
    if row["phase"] in rb.ACTIVE:
        table = Table("topic", "partition", "shadow", "live", "behind")
        for tp in sorted(set(live) | set(shadow), key=lambda t: (t.topic, t.partition)):
            s, li = shadow.get(tp, 0), live.get(tp, 0)
            table.add_row(tp.topic, str(tp.partition), str(s), str(li), str(max(0, li - s)))
        console.print(table)
    return 0
