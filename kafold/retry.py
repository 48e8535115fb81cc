"""Retrying a step that fails with RetriableError: exponential backoff within a time budget."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kafold.errors import RetriableError

T = TypeVar("T")


def backoff(attempt: int, first: float, cap: float) -> float:
    """The delay after failed try number `attempt` (1-based): `first`, doubling per try, at most `cap`."""
    return min(cap, first * 2.0 ** min(max(attempt - 1, 0), 64))


def retrying(step: Callable[[], T], *, within_s: float, on_retry: Callable[[RetriableError, float], None],
             first_delay: float = 0.2, max_delay: float = 5.0, stop: threading.Event | None = None) -> T:
    """`step()` until it returns. On RetriableError, `on_retry(error, delay)` is called and the step runs again
    after `delay` (doubling up to `max_delay`); the error is raised instead once the next try would start past
    `within_s`, or when `stop` is set (the wait ends early then too)."""
    deadline, tries = time.monotonic() + within_s, 0
    while True:
        tries += 1
        delay = backoff(tries, first_delay, max_delay)
        try:
            return step()
        except RetriableError as e:
            if (stop is not None and stop.is_set()) or time.monotonic() + delay > deadline:
                raise
            on_retry(e, delay)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
