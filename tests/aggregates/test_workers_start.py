"""A daemon's worker processes start together: none joins the group before every one is built, none decides before
every one has had its first assignment (AggregateWorkers._joins, _merge). The parent's side, over real pipes; a
worker's side (startup.StartUp): its phases, moved on by the parent's words or its one deadline."""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kafold.config import DaemonConfig, KafkaConfig
from kafold.daemon.aggregates import AggregateWorkers
from kafold.daemon.aggregates.startup import Phase, StartUp
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
    third.phase = Phase.BUILDING
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


def test_a_worker_waits_at_each_phase_for_the_parents_word() -> None:
    announced: list[Phase] = []
    startup = StartUp("start", announce=lambda: announced.append(startup.phase), wait_s=3600)
    assert not startup.may_decide() and startup.phase is Phase.BUILDING
    joined = threading.Event()
    runtime = threading.Thread(target=lambda: (startup.built(threading.Event()), joined.set()))
    runtime.start()
    try:
        assert not joined.wait(0.2)  # built, announced, waiting for the word to join
        assert announced == [Phase.JOINING]
        startup.let_join()
        assert joined.wait(30)
    finally:
        startup.let_join()
        runtime.join(30)
    assert startup.phase is Phase.HOLDING and not startup.may_decide()
    startup.let_join()  # a word repeated does not move a start back
    assert startup.phase is Phase.HOLDING
    startup.let_decide()
    assert startup.may_decide() and startup.phase is Phase.DECIDING and not startup.alone
    startup.let_join()
    assert startup.phase is Phase.DECIDING


def test_one_deadline_lets_a_worker_join_and_decide_without_its_siblings() -> None:
    startup = StartUp("start", wait_s=0.0)  # every sibling late: the deadline is already past when it is built
    startup.built(threading.Event())
    assert startup.may_decide() and startup.alone and startup.phase is Phase.DECIDING
    held = StartUp("start", wait_s=0.0)
    held.deadline = None
    held.let_join()  # in the group before its deadline is set: held, until the deadline (once built) passes
    assert held.phase is Phase.HOLDING and not held.may_decide()
    held.built(threading.Event())
    assert held.phase is Phase.HOLDING  # let through already: built does not wait
    assert held.may_decide() and held.alone


def test_a_stop_ends_the_wait_to_join_and_a_runtime_without_siblings_decides_at_once() -> None:
    stopping = threading.Event()
    stopping.set()
    startup = StartUp("start", wait_s=3600)
    startup.built(stopping)  # returns: the runtime then stops
    assert startup.phase is Phase.JOINING and not startup.may_decide()
    alone = StartUp.without_siblings("start")
    alone.built(threading.Event())
    assert alone.may_decide() and not alone.alone
