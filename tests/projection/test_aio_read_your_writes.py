"""An asyncio service on kafold.aio against a running daemon (the bank aggregate and its `accounts` projection, in a
process of its own, on Apache Kafka): 10,000 commands sent concurrently get their own results (statuses and
versions), every one is then read back through the daemon's consistency tokens and the projection's rows, the
client runs no thread per call (the process's threads sampled throughout). Correctness only: the event loop's lag
at a steady 1,000 commands/s is `kafold bench aio`'s (docs/benchmarks.md), not a test's."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kafold import aio, config, topics
from kafold.config import AggregateConfig, KafkaConfig
from kafold.messages import Result
from kafold.testing import free_port
from tests.aggregates.agg_support import accounts_projection_toml, bank_daemon_toml
from tests.daemon.daemon_support import get_json
from tests.support import child_env, wait_for

KAFOLD = str(Path(sys.executable).parent / "kafold")
PROJECTION = "accounts"
ACCOUNTS, DEPOSITS = 1000, 8  # per account: OpenAccount, 8 deposits, a withdrawal over the balance: 10,000
TICK_S = 0.005


class Daemon:
    """`kafold daemon` in a child process, so that this process holds the service's threads only."""

    def __init__(self, path: Path, port: int, agg: AggregateConfig, table: str) -> None:
        self.path, self.port, self.agg, self.table = path, port, agg, table
        self.proc = subprocess.Popen([KAFOLD, "daemon", "-c", str(path)], env=child_env(),
                                     stdout=subprocess.DEVNULL, stderr=(path.parent / "daemon.log").open("wb"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def daemon(kafka_config: KafkaConfig, pg_url: str, tmp_path: Path) -> Iterator[Daemon]:
    unique, port, table = f"kt.aio.{uuid.uuid4().hex[:8]}", free_port(), f"aio_{uuid.uuid4().hex[:10]}"
    path = tmp_path / "kafold.toml"
    path.write_text(f"""
{bank_daemon_toml(kafka_config, unique, port, partitions=4)}
[postgres]
url = "{pg_url}"

{accounts_projection_toml(PROJECTION, unique + ".events", table)}
""")
    loaded = config.load_file(path)
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    d = Daemon(path, port, loaded.config.aggregates[0], table)
    try:
        wait_for(lambda: get_json(port, "/ready")[0] == 200, "the daemon ready", 120)
        yield d
    finally:
        d.stop()


class Threads:
    """The process's Python and native threads, sampled every TICK_S by a task on the loop."""

    def __init__(self) -> None:
        self.python_threads: set[int] = set()
        self.native_threads: set[int] = set()
        self.samples = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.python_threads.add(threading.active_count())
            self.native_threads.add(len(os.listdir("/proc/self/task")))
            self.samples += 1


def _plan(client: aio.CommandClient, accounts: list[str]) -> list[tuple[Any, str, int]]:
    """(command, expected status, expected version) in sending order: per account an opening, deposits of 1..8,
    and a withdrawal over the balance (rejected at version 9)."""
    plan = []
    for a in accounts:
        plan.append((client.command(a, "OpenAccount", {"owner": a}), "accepted", 1))
        for i in range(1, DEPOSITS + 1):
            plan.append((client.command(a, "Deposit", {"amount": i}), "accepted", i + 1))
        plan.append((client.command(a, "Withdraw", {"amount": 10_000}), "rejected", DEPOSITS + 1))
    return plan


def _own_threads() -> int:
    """Python threads less librdkafka's warm-up of a new idempotent producer (kafka_clients._connect: it ends once
    connected)."""
    return sum(1 for t in threading.enumerate() if t.name != "kafold-producer-connect")


def test_an_async_service_sends_10000_commands_concurrently_and_reads_its_own_writes(
        daemon: Daemon, kafka_config: KafkaConfig, pg_url: str) -> None:
    accounts = [f"a{uuid.uuid4().hex[:10]}" for _ in range(ACCOUNTS)]

    async def service() -> tuple[list[Result], dict[str, int], Threads, int, int]:
        async with aio.DaemonClient(f"http://127.0.0.1:{daemon.port}") as http, \
                aio.CommandClient(kafka_config, daemon.agg, http) as client:
            await client.send(client.command(f"warm-{accounts[0]}", "OpenAccount", {"owner": "w"}), timeout=60)
            wait_for(lambda: _own_threads() == threading.active_count(), "the producer's warm-up thread", 10)
            python_before, native_before = threading.active_count(), len(os.listdir("/proc/self/task"))
            ticker = Threads()
            ticking = asyncio.create_task(ticker.run())
            plan = _plan(client, accounts)
            # every send at once, each its own task; asyncio starts them in creation order, so each account's
            # commands are produced in order (one partition per account: decided in order)
            results = await asyncio.gather(*(asyncio.create_task(client.send(c, timeout=120)) for c, _, _ in plan))
            # read your writes: each result's events waited on through the daemon, then the rows read
            await asyncio.gather(*(client.wait_visible(r, PROJECTION, timeout=120) for r in results if r))
            state = await http.state(daemon.agg.name, accounts[0], min_version=DEPOSITS + 1)
            assert (state["version"], state["state"]["balance"]) == (DEPOSITS + 1, sum(range(1, DEPOSITS + 1)))
            async with await psycopg.AsyncConnection.connect(pg_url) as conn:
                rows = await (await conn.execute(f'SELECT account_id, balance FROM "{daemon.table}" '
                                                 "WHERE account_id = ANY(%s)", (accounts,))).fetchall()
            ticking.cancel()
            return [r for r in results if r], dict(rows), ticker, python_before, native_before

    results, balances, ticker, python_before, native_before = asyncio.run(service())
    plan_statuses = [(s, v) for a in accounts for s, v in
                     [("accepted", 1), *(("accepted", i + 1) for i in range(1, DEPOSITS + 1)),
                      ("rejected", DEPOSITS + 1)]]
    assert len(results) == ACCOUNTS * (DEPOSITS + 2)
    assert [(r.status, r.version) for r in results] == plan_statuses
    assert [r.aggregate_id for r in results] == [a for a in accounts for _ in range(DEPOSITS + 2)]
    assert all(r.reason and r.reason.startswith("insufficient funds") for r in results if not r.accepted)
    assert balances == dict.fromkeys(accounts, sum(range(1, DEPOSITS + 1)))
    # no thread per call: the Python threads stayed as they were; librdkafka's own may come and go by a few
    assert ticker.samples > 0
    assert ticker.python_threads == {python_before}, (python_before, ticker.python_threads)
    assert max(ticker.native_threads) <= native_before + 2, (native_before, ticker.native_threads)
