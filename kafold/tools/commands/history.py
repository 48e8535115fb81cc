"""`kafold events list` and `kafold events index`: an aggregate's history through the history index (kafold.history)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kafold import config, db, devstack, protect
from kafold.history import DEFAULT_LIMIT, MAX_LIMIT, History
from kafold.snapshot.fold import Domain
from kafold.terminal import visible
from kafold.tools.cli import add_config_arg
from kafold.tools.commands import aggregate_named
from kafold.tools.commands.snapshot import python_paths


def register_actions(actions: Any) -> None:
    """Add `list` and `index` to `kafold events`."""
    lst = actions.add_parser("list", help="the events of one aggregate: type, version, schema version, time, "
                             "event id and the command that caused each")
    add_config_arg(lst)
    lst.add_argument("aggregate", help="aggregate name ([[aggregates]].name)")
    lst.add_argument("id", help="aggregate id")
    lst.add_argument("--from-version", type=int, default=1, metavar="N", help="start at version N (default 1)")
    lst.add_argument("--limit", type=int, default=DEFAULT_LIMIT, metavar="N",
                     help=f"at most N events (default {DEFAULT_LIMIT}, at most {MAX_LIMIT})")
    lst.add_argument("--json", action="store_true", help="print one JSON object (with each event's data)")
    lst.set_defaults(handler=handle_list)
    idx = actions.add_parser("index", help="bring the history index of an aggregate up to date (a backfill the "
                             "first time); --rebuild drops it first")
    add_config_arg(idx)
    idx.add_argument("aggregate", help="aggregate name ([[aggregates]].name)")
    idx.add_argument("--rebuild", action="store_true", help="drop the aggregate's index, then build it again")
    idx.add_argument("--json", action="store_true", help="print one JSON object")
    idx.set_defaults(handler=handle_index)


@contextmanager
def history_of(path: str, name: str) -> Iterator[History]:
    """The History of aggregate `name` of the configuration at `path`, read as the runtime reads (its domain,
    upcasters and protected fields: kafold.protect), closed after use. kafold's migrations are applied first (one
    query when the database is at the newest: kafold.db.HEAD), so a first `events list` finds the index tables."""
    loaded = config.load_file(path)
    agg = aggregate_named(loaded, name)
    cfg = devstack.effective(loaded.config, need=("kafka", "postgres"))
    db.upgrade(cfg.postgres)
    protect.build(cfg)  # protected fields read in clear, or as the placeholder once forgotten
    made = History(cfg.kafka, cfg.postgres, agg, Domain.load(agg, python_paths(loaded)))
    try:
        yield made
    finally:
        made.close()


def handle_list(args: argparse.Namespace) -> int:
    with history_of(args.config, args.aggregate) as h:
        page = h.events(args.id, max(1, args.from_version), args.limit)
    if args.json:
        print(json.dumps({"aggregate": args.aggregate, "id": args.id, "partition": page.partition,
                          "events": page.events, "next_version": page.next_version}, default=str))
        return 0
    print(f"{'VERSION':>7}  {'TYPE':<24} {'SCHEMA':>6}  {'OCCURRED_AT':<27} {'EVENT_ID':<36}  COMMAND_ID")
    for e in page.events:
        print(f"{e['version']:>7}  {visible(e['type']):<24} {e['schema_version']:>6}  {visible(e['occurred_at']):<27} "
              f"{visible(e['event_id']):<36}  {visible(e['command_id'] or '-')}")
    if page.next_version is not None:
        print(f"(more: --from-version {page.next_version})")
    return 0


def handle_index(args: argparse.Namespace) -> int:
    with history_of(args.config, args.aggregate) as h:
        if args.rebuild:
            h.index.drop(h.topic)
        done = [h.catch_up(p) for p in range(h.agg.partitions)]
    out = {"aggregate": args.aggregate, "topic": h.topic,
           "partitions": [{"partition": d.partition, "from": d.start, "indexed_to": d.indexed_to,
                           "events_indexed": d.indexed, "unreadable": d.unreadable,
                           "duration_s": round(d.duration_s, 3)} for d in done]}
    if args.json:
        print(json.dumps(out))
    else:
        for p in out["partitions"]:
            print(f"partition {p['partition']}: {p['events_indexed']:,} events indexed "
                  f"({p['from']} -> {p['indexed_to']}) in {p['duration_s']} s"
                  + (f", {p['unreadable']} records not readable as events" if p["unreadable"] else ""))
    return 0
