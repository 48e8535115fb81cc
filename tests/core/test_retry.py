"""kafold.retry: backoff within a budget, the error raised when the budget or a stop ends it (pure logic)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kafold.errors import RetriableError
from kafold.retry import retrying, retrying_async


def test_a_step_is_retried_with_doubling_delays_until_it_succeeds() -> None:
    calls, waits = [], []

    def step() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise RetriableError(f"try {len(calls)}")
        return "done"

    got = retrying(step, within_s=60, on_retry=lambda e, d: waits.append(d), first_delay=0.001, max_delay=0.003)
    assert got == "done" and len(calls) == 4 and waits == [0.001, 0.002, 0.003]


def test_the_error_is_raised_once_the_budget_is_spent_or_stop_is_set() -> None:
    def step() -> None:
        raise RetriableError("down")

    with pytest.raises(RetriableError, match="down"):
        retrying(step, within_s=0.0, on_retry=lambda e, d: None)
    stop = threading.Event()
    stop.set()
    with pytest.raises(RetriableError):
        retrying(step, within_s=60, on_retry=lambda e, d: pytest.fail("no retry after stop"), stop=stop)


def test_named_errors_are_retried_others_pass_through() -> None:
    calls = []

    def step() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("refused")
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        retrying(step, within_s=60, on_retry=lambda e, d: None, first_delay=0.001, errors=(OSError,))
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(OSError):  # not a RetriableError: by default it goes through at once
        retrying(step, within_s=60, on_retry=lambda e, d: pytest.fail("retried"))
    assert len(calls) == 1


def test_after_stop_the_tries_go_on_on_their_backoff_for_the_grace() -> None:
    stop, calls, waits = threading.Event(), [], []
    stop.set()

    def step() -> None:
        calls.append(1)
        raise RetriableError("still down")

    with pytest.raises(RetriableError, match="still down"):
        retrying(step, within_s=float("inf"), on_retry=lambda e, d: waits.append(d), first_delay=0.1,
                 max_delay=0.1, stop=stop, grace_s=0.3)
    # tries 0.1 s apart (a set stop does not turn the waits into a busy loop) until the next would pass the grace
    assert 2 <= len(calls) <= 4 and waits == [0.1] * (len(calls) - 1)


def test_the_given_wait_replaces_the_sleep_and_stop_ends_a_sleep_early() -> None:
    stop, calls, waits = threading.Event(), [], []

    def step() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RetriableError("down")
        return "up"

    assert retrying(step, within_s=600, on_retry=lambda e, d: None, first_delay=60, max_delay=600,
                    wait=waits.append) == "up"
    assert waits == [60, 120]  # handed to the caller's wait (a consumer serving heartbeats), never slept here
    calls[:] = [1]  # one failure to go
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    assert retrying(step, within_s=600, on_retry=lambda e, d: None, first_delay=60, max_delay=600, stop=stop) == "up"
    assert time.monotonic() - started < 30  # the 60 s wait ended with the stop; the try after it succeeded


def test_the_async_variant_retries_a_coroutine_step() -> None:
    calls, waits = [], []

    async def step() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("ledger away")
        return "read"

    got = asyncio.run(retrying_async(step, within_s=60, on_retry=lambda e, d: waits.append(d), first_delay=0.001,
                                     errors=(Exception,)))
    assert got == "read" and waits == [0.001, 0.002]

    async def failing() -> None:
        raise RetriableError("gone")

    with pytest.raises(RetriableError):
        asyncio.run(retrying_async(failing, within_s=0.0, on_retry=lambda e, d: None))
