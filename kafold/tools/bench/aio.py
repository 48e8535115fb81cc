"""An asyncio service's event loop while it sends commands through kafold.aio at a steady rate and reads its writes.

A `kafold daemon` in its own process (the bank aggregate on `--partitions` partitions, its events projected into an
`accounts` table) and, in this process, one asyncio loop with one `aio.CommandClient` and one `aio.DaemonClient`:
`--accounts` accounts are opened first (not measured), then Deposits are started as tasks at `--rate` a second for
`--duration` seconds, each awaiting its result and (`--read-your-writes`, the default) `wait_visible` on the
projection. Measured: the loop's lag (how late a `--tick-ms` sleep of a ticker task wakes; p50/p99/max) over the
steady phase, command -> result and command -> visible times, the process's Python and native threads, and the
outcome: every result accepted at the version its order gives it, every balance in the projection as sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import threading
import time
from typing import Any

from kafold import aio, config, logs, topics
from kafold.config import AggregateConfig
from kafold.messages import Result
from kafold.testing import free_port
from kafold.tools.bench import SHORT_GROUP_TIMEOUTS
from kafold.tools.bench.aggregates import BANK
from kafold.tools.bench.daemons import DaemonStack, daemon_process, daemon_stack, toml_table, wait_ready
from kafold.tools.bench.latency import BANK_COLUMNS

DRAIN_S = 120.0  # after the steady phase, how long the last sends may take to finish (a send's own timeout)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=1000.0, help="commands started per second (default 1,000)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of the steady phase (default 10)")
    p.add_argument("--accounts", type=int, default=1000, help="accounts the deposits go to (default 1,000)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the aggregate's topics (default 4)")
    p.add_argument("--tick-ms", type=float, default=5.0, help="the lag ticker's sleep (default 5 ms)")
    p.add_argument("--read-your-writes", action=argparse.BooleanOptionalAction, default=True,
                   help="each command also waits until the projection shows its events (default: on)")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack)")


def _daemon_toml(stack: DaemonStack, prefix: str, port: int, partitions: int, table: str) -> str:
    kafka = {**stack.kafka_raw, **SHORT_GROUP_TIMEOUTS}
    daemon = {"group_prefix": prefix, "http_port": port, "python_path": [str(BANK)]}
    aggregate = {"name": "account", "initial": "bank_domain:initial", "evolve": "bank_domain:evolve",
                 "decide": "bank_domain:decide", "partitions": partitions,
                 **{f"{k}_topic": f"{prefix}.{k}" for k in ("events", "commands", "results", "snapshot")}}
    connector = {"name": "accounts", "class": "postgres-projection", "topics": [f"{prefix}.events"],
                 "config": {"table": table, "key_columns": ["account_id"], "mapper": "bank_projection:account_row",
                            "columns": BANK_COLUMNS}}

    return "".join([toml_table("[kafka]", kafka), toml_table("[postgres]", stack.postgres_raw),
                    toml_table("[daemon]", daemon), toml_table("[[aggregates]]", aggregate),
                    toml_table("[[connectors]]", connector)])


class Ticker:
    """How late a `tick_s` sleep wakes (the loop's lag), and the process's threads, sampled on each tick."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self.lags: list[float] = []
        self.python_threads: set[int] = set()
        self.native_threads: set[int] = set()

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(self.tick_s)
            self.lags.append(time.perf_counter() - started - self.tick_s)
            self.python_threads.add(threading.active_count())
            self.native_threads.add(len(os.listdir("/proc/self/task")))


def _ms(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


async def _service(args: argparse.Namespace, kafka: Any, agg: AggregateConfig, port: int,
                   accounts: list[str]) -> dict[str, Any]:
    async with aio.DaemonClient(f"http://127.0.0.1:{port}") as http, \
            aio.CommandClient(kafka, agg, http) as client:
        opened = await asyncio.gather(*(client.send(client.command(a, "OpenAccount", {"owner": a}), timeout=DRAIN_S)
                                        for a in accounts))
        if any(r is None or not r.accepted for r in opened):
            raise RuntimeError("bench: an account could not be opened")
        python_before, native_before = threading.active_count(), len(os.listdir("/proc/self/task"))
        total = int(args.rate * args.duration)
        to_result: list[float] = []
        to_visible: list[float] = []
        wrong: list[str] = []

        async def one(i: int) -> tuple[str, int]:
            account, amount = accounts[i % len(accounts)], i + 1
            expected_version = 2 + i // len(accounts)  # sent in order: each account's deposits are decided in order
            began = time.perf_counter()
            result: Result | None = await client.send(client.command(account, "Deposit", {"amount": amount}),
                                                      timeout=DRAIN_S)
            to_result.append(time.perf_counter() - began)
            if result is None or not result.accepted or result.version != expected_version:
                wrong.append(f"{account} #{i}: {result}")
            elif args.read_your_writes:
                await client.wait_visible(result, "accounts", timeout=DRAIN_S)
                to_visible.append(time.perf_counter() - began)
            return account, amount

        ticker = Ticker(args.tick_ms / 1000)
        ticking = asyncio.create_task(ticker.run())
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[tuple[str, int]]] = []
        started = loop.time()
        while len(tasks) < total:
            due = min(total, int((loop.time() - started) * args.rate) + 1)
            tasks.extend(asyncio.create_task(one(i)) for i in range(len(tasks), due))
            await asyncio.sleep(max(0.0, started + len(tasks) / args.rate - loop.time()))
        offered_s = loop.time() - started
        steady_lags = len(ticker.lags)
        sent = await asyncio.gather(*tasks)
        ticking.cancel()
        took_s = loop.time() - started
    balances: dict[str, int] = {}
    for account, amount in sent:
        balances[account] = balances.get(account, 0) + amount
    lags = ticker.lags[:steady_lags]
    return {"offered_s": round(offered_s, 2), "finished_s": round(took_s, 2), "wrong_results": len(wrong),
            "wrong_examples": wrong[:3], "expected_balances": balances,
            "loop_lag_p50_ms": _ms(lags, 0.5), "loop_lag_p99_ms": _ms(lags, 0.99), "loop_lag_max_ms": _ms(lags, 1.0),
            "loop_ticks": len(lags), "all_ticks_lag_p99_ms": _ms(ticker.lags, 0.99),
            "result_p50_ms": _ms(to_result, 0.5), "result_p99_ms": _ms(to_result, 0.99),
            "visible_p50_ms": _ms(to_visible, 0.5), "visible_p99_ms": _ms(to_visible, 0.99),
            "threads_python_before": python_before, "threads_python_during": sorted(ticker.python_threads),
            "threads_native_before": native_before, "threads_native_during": sorted(ticker.native_threads)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs.configure("warning")
    # psycopg: kafold[daemon], not in the core install
    import psycopg

    with contextlib.ExitStack() as stack:
        daemons = daemon_stack(stack, "aio", args.config, args.broker)
        kafka, run_id, prefix = daemons.kafka, daemons.run_id, daemons.name
        table, port = f"aio_accounts_{run_id}", free_port()
        conf = daemons.workdir / f"{prefix}.toml"
        conf.write_text(_daemon_toml(daemons, prefix, port, args.partitions, table))
        loaded = config.load_file(conf).config
        if not topics.ensure(kafka, config.topic_map(loaded).values()).ok:
            raise RuntimeError("bench: the topics could not be created")
        accounts = [f"a{run_id}{i:05d}" for i in range(args.accounts)]
        with daemon_process(daemons, conf) as proc:
            wait_ready(proc, port, conf)
            figures = asyncio.run(_service(args, kafka, loaded.aggregates[0], port, accounts))
            with psycopg.connect(daemons.postgres.url) as conn:
                rows: dict[str, int] = dict(conn.execute(f'SELECT account_id, balance FROM "{table}"').fetchall())
    expected = figures.pop("expected_balances")
    figures["wrong_balances"] = (len([a for a, b in expected.items() if rows.get(a) != b])
                                 if args.read_your_writes else None)
    return {"rate": args.rate, "duration_s": args.duration, "commands": int(args.rate * args.duration),
            "accounts": args.accounts, "partitions": args.partitions, "read_your_writes": args.read_your_writes,
            **figures}
