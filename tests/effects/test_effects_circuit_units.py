"""The endpoint circuit's logic: opens on a window of mostly transient failures, probes on a backoff, closes."""

from __future__ import annotations

import asyncio
import time

import pytest

from kafold.connectors.effects.circuit import CLOSED, OPEN, PROBING, Circuit


def _circuit(changes: list[str]) -> Circuit:
    return Circuit("c", "http://x", ratio=0.5, window=4, probe_initial_s=0.05, probe_max_s=0.2,
                   on_change=changes.append)


def test_opens_only_when_a_full_window_mostly_failed_and_closes_on_a_probe_answer() -> None:
    async def scenario() -> None:
        changes: list[str] = []
        c = _circuit(changes)
        for failed in (True, False, True):
            c.record(failed, probe=False)
        assert c.state == CLOSED  # the window is not full yet
        c.record(True, probe=False)  # 3 of 4 failed
        assert c.state == OPEN and changes == [OPEN]
        c.record(True, probe=False)  # a request sent before it opened: ignored
        assert c.state == OPEN and c.probes == 0
        probe = await c.admit(time.monotonic() + 5)
        assert probe and c.state == PROBING
        c.record(True, probe=True)  # the probe failed: the next one waits longer
        assert c.state == OPEN and c.probe_at > time.monotonic()
        probe = await c.admit(time.monotonic() + 5)
        assert probe
        c.record(False, probe=True)  # any answer that is not transient closes it (a 4xx too)
        assert c.state == CLOSED and changes == [OPEN, CLOSED]
        assert await c.admit(time.monotonic()) is False

    asyncio.run(scenario())


def test_waiters_stay_off_the_endpoint_until_the_probe_answers_then_all_resume() -> None:
    async def scenario() -> None:
        c = _circuit([])
        for _ in range(4):
            c.record(True, probe=False)
        admitted: list[bool] = []

        async def waiter() -> None:
            admitted.append(await c.admit(time.monotonic() + 5))

        tasks = [asyncio.create_task(waiter()) for _ in range(5)]
        await asyncio.sleep(0.2)
        assert admitted == [True]  # one probe at a time; the others wait
        assert c.waiting == 4
        c.record(False, probe=True)
        await asyncio.gather(*tasks)
        assert admitted == [True, False, False, False, False] and c.waiting == 0

    asyncio.run(scenario())


def test_a_waiter_past_its_deadline_gets_a_timeout_and_retry_after_delays_the_probe() -> None:
    async def scenario() -> None:
        c = _circuit([])
        for _ in range(4):
            c.record(True, probe=False)
        assert await c.admit(time.monotonic() + 5)
        c.record(True, probe=True, retry_after_s=30.0)
        assert c.probe_at - time.monotonic() > 29
        with pytest.raises(TimeoutError):
            await c.admit(time.monotonic() + 0.1)

    asyncio.run(scenario())


def test_a_zero_ratio_never_opens() -> None:
    c = Circuit("c", "http://x", ratio=0, window=2, probe_initial_s=0.05, probe_max_s=0.2)
    for _ in range(10):
        c.record(True, probe=False)
    assert c.state == CLOSED
