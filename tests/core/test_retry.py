"""kafold.retry: backoff within a budget, the error raised when the budget or a stop ends it (pure logic)."""

from __future__ import annotations

import threading

import pytest

from kafold.errors import RetriableError
from kafold.retry import retrying


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
