"""A daemon's worker processes start together: none joins the group before every one is built, none decides before
every one has had its first assignment (AggregateWorkers._joins, _merge). The parent's side, over real pipes."""

from __future__ import annotations

from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kafold.config import DaemonConfig, KafkaConfig
from kafold.daemon.aggregates import AggregateWorkers
from tests.aggregates.agg_support import BANK, bank_config


def workers_on_pipes(n: int) -> tuple[AggregateWorkers, list[Connection]]:
    """`n` workers whose connections are pipes (their processes not started): what the parent sends them arrives at
    the returned ends."""
    daemon = DaemonConfig(aggregate_processes=n, python_path=[str(BANK)])
    workers = AggregateWorkers(KafkaConfig(bootstrap_servers="127.0.0.1:9"), daemon, bank_config("start", 4),
                               Path("."), instance_id="i")
    theirs = []
    for w in workers.workers:
        ours, other = Pipe()
        w.conn, w.alive = ours, True
        theirs.append(other)
    return workers, theirs


def received(conn: Connection) -> list[Any]:
    got = []
    while conn.poll(0):
        got.append(conn.recv())
    return got


def report(joined: bool) -> dict[str, Any]:
    return {"gates": [], "counts": {}, "figures": {}, "ready": False, "joined": joined}


def test_no_worker_joins_before_every_worker_is_built() -> None:
    workers, ends = workers_on_pipes(3)
    first, second, third = workers.workers
    first.apply({"joining": True})
    second.apply({"joining": True})
    assert [received(e) for e in ends] == [[], [], []]
    third.apply({"joining": True})
    assert [received(e) for e in ends] == [[("join",)]] * 3
    # started again (its predecessor died): the others are through, so it joins at once
    third.joined = third.waiting = False
    third.apply({"joining": True})
    assert [received(e) for e in ends] == [[], [], [("join",)]]


def test_no_worker_decides_before_every_worker_has_its_first_assignment() -> None:
    workers, ends = workers_on_pipes(2)
    first, second = workers.workers
    first.apply(report(True))
    second.apply(report(False))
    assert [received(e) for e in ends] == [[], []]
    second.apply(report(True))
    assert [received(e) for e in ends] == [[("decide",)], [("decide",)]]
    first.apply(report(True))  # told once
    assert [received(e) for e in ends] == [[], []]
