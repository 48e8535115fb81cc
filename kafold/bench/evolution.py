"""Evolving events: a projection over events that all need one upcast step vs the same events in today's shape."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import uuid
from typing import Any

from kafold import db, logs
from kafold.bench import short_group
from kafold.bench.projection import _produce, _project, daemon_stack
from kafold.envelope import Event

log = logs.get(__name__)

# Yesterday's shape of a deposit: another type name and field, turned into today's MoneyDeposited by one step.
UPCASTERS = [{"type": "FundsAdded", "from_version": 1, "rename_type": "MoneyDeposited",
              "rename_fields": {"amt": "amount"}}]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=300_000, help="events per topic (default 300k)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of each kind (default 2)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the benchmark topics")
    p.add_argument("--batch", type=int, default=2500, help="daemon.batch_max_records")
    p.add_argument("--tasks", type=int, default=2, help="tasks_max of the connector (default 2: one per core)")
    p.add_argument("--task-processes", action=argparse.BooleanOptionalAction, default=True,
                   help="daemon.task_processes (default: each task in its own process)")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack)")


def old_deposit(account: str, version: int, amount: int) -> Event:
    return Event.new("FundsAdded", "account", account, version, {"amt": amount})


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs.configure("warning")
    with contextlib.ExitStack() as stack:
        daemons = daemon_stack(stack, "evolution", args.config, args.broker)
        kafka = short_group(daemons.kafka)
        base = f"kafold.bench.evolution.{uuid.uuid4().hex[:8]}"
        accounts = max(1, args.events // 10)
        topics = {"native": f"{base}.native", "upcast": f"{base}.upcast"}
        _produce(kafka, topics["native"], args.events, args.partitions, accounts)
        _produce(kafka, topics["upcast"], args.events, args.partitions, accounts, old_deposit)
        db.upgrade(daemons.postgres)
        rates: dict[str, list[float]] = {"native": [], "upcast": []}
        for r in range(args.rounds):
            for kind in (("native", "upcast") if r % 2 == 0 else ("upcast", "native")):
                name = f"{base}.{kind}.{r}"
                extra = {"upcasters": UPCASTERS} if kind == "upcast" else None
                got = _project(daemons, name, topics[kind], f"bench_{uuid.uuid4().hex[:8]}", args, extra)
                rates[kind].append(got["events"] / got["seconds"])
                log.warning("bench.evolution_round", round=r, kind=kind, events_per_s=round(rates[kind][-1]))
    native, upcast = statistics.median(rates["native"]), statistics.median(rates["upcast"])
    return {"events": args.events, "rounds": args.rounds, "partitions": args.partitions, "tasks": args.tasks,
            "native_events_per_s": [round(x) for x in rates["native"]],
            "upcast_events_per_s": [round(x) for x in rates["upcast"]],
            "upcast_throughput_ratio": round(upcast / native, 3)}

