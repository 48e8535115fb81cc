"""The long-poll waits of daemon/visibility.py without a broker: a token over several partitions is released only
once every one is covered, a timeout answers False and leaves nothing behind, and thousands of waiters cost the
event loop little (each read looks only at the waiters it releases)."""

from __future__ import annotations

import asyncio
import heapq
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kafold.config import KafkaConfig, PostgresConfig
from kafold.daemon import visibility
from kafold.daemon.visibility import Watch, Watches
from kafold.tools.bench.waiters import run


async def _inline(fn: Any, *args: Any) -> Any:
    return fn(*args)


def _watch(committed: dict[tuple[str, int], int]) -> Watch:
    return Watch("w", lambda: dict(committed), 0.001, lambda: None, _inline)


def test_a_token_over_two_partitions_is_released_when_both_are_covered() -> None:
    async def scenario() -> None:
        committed = {("t", 0): 0, ("t", 1): 0}
        watch = _watch(committed)
        waiting = asyncio.ensure_future(watch.wait({("t", 0): 5, ("t", 1): 7}, 5.0))
        await asyncio.sleep(0.02)
        committed[("t", 0)] = 6
        await asyncio.sleep(0.02)
        assert not waiting.done()  # filed under its second partition now
        committed[("t", 1)] = 8
        assert await waiting is True
        assert watch.waiting == 0 and watch.task is not None
        watch.task.cancel()

    asyncio.run(scenario())


def test_a_commit_this_daemon_made_releases_its_waiters_without_a_read() -> None:
    async def scenario() -> None:
        reads: list[int] = []

        def read() -> dict[tuple[str, int], int]:
            reads.append(1)
            return {("t", 0): 0}  # the checkpoints as a first read finds them, before the commit

        watches = Watches(KafkaConfig(), PostgresConfig(), lambda name: None, _inline)
        watches.stored("w", {("t", 0): 9})  # before anyone waited: nothing to wake, nothing kept
        watch = watches.by_name["w"] = Watch("w", read, 60.0, lambda: None, _inline)  # the next read: in a minute
        watches.loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(watch.wait({("t", 0): 5}, 10.0))
        await asyncio.sleep(0.02)
        assert not waiting.done() and reads == [1]
        writer = threading.Thread(target=watches.stored, args=("w", {("t", 0): 6}))  # as a task's writer thread
        writer.start()
        writer.join()
        assert await asyncio.wait_for(waiting, 5.0) is True
        assert reads == [1] and watch.seen == {("t", 0): 6}
        assert watch.task is not None
        watch.task.cancel()

    asyncio.run(scenario())


def test_timed_out_waiters_answer_false_and_are_swept() -> None:
    async def scenario() -> None:
        watch = _watch({("t", 0): 0})
        results = await asyncio.gather(*(watch.wait({("t", 0): 100 + i}, 0.05) for i in range(3000)))
        assert not any(results)
        assert watch.waiting == 0 and watch.filed <= 1024  # stale entries do not pile up
        assert watch.task is not None
        watch.task.cancel()

    asyncio.run(scenario())


def test_ten_thousand_waiters_cost_the_loop_little(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each waiter is filed once and taken out once, however many reads pass while it waits (a read used to look at
    every waiter): counted, not timed (the CPU time it takes is `python -m kafold.tools.bench.waiters`'s figure)."""
    counts = {"push": 0, "pop": 0}

    def push(heap: list[Any], item: Any) -> None:
        counts["push"] += 1
        heapq.heappush(heap, item)

    def pop(heap: list[Any]) -> Any:
        counts["pop"] += 1
        return heapq.heappop(heap)

    monkeypatch.setattr(visibility, "heapq", SimpleNamespace(heappush=push, heappop=pop, heapify=heapq.heapify))
    figures = asyncio.run(run(10_000, 4, 400))
    assert figures["covered"] == 10_000
    # one partition a token: filed at most once (not at all when already covered on arrival), released once
    assert 0 < counts["push"] <= 10_000 and counts["pop"] == counts["push"], counts
