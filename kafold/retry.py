"""Retrying a step that fails with RetriableError: exponential backoff within a time budget."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kafold.errors import RetriableError

T = TypeVar("T")
# on_retry is called with whichever of `errors` was caught (RetriableError unless the caller names others).
OnRetry = Callable[[Any, float], None]


def backoff(attempt: int, first: float, cap: float) -> float:
    """The delay after failed try number `attempt` (1-based): `first`, doubling per try, at most `cap`."""
    return min(cap, first * 2.0 ** min(max(attempt - 1, 0), 64))


class _Tries:
    """The bookkeeping of one retrying call: the delay after each failure, or None once it is time to give up."""

    def __init__(self, within_s: float, first_delay: float, max_delay: float, stop: threading.Event | None,
                 grace_s: float) -> None:
        self.deadline, self.tries = time.monotonic() + within_s, 0
        self.first_delay, self.max_delay = first_delay, max_delay
        self.stop, self.grace_s, self.stopping = stop, grace_s, False

    def delay(self) -> float | None:
        self.tries += 1
        delay, now = backoff(self.tries, self.first_delay, self.max_delay), time.monotonic()
        if not self.stopping and self.stop is not None and self.stop.is_set():
            self.stopping = True
            self.deadline = min(self.deadline, now + self.grace_s)
        return None if now + delay > self.deadline else delay

    def wait(self, delay: float) -> None:
        if self.stop is not None and not self.stopping:
            self.stop.wait(delay)
        else:
            time.sleep(delay)


def retrying(step: Callable[[], T], *, within_s: float, on_retry: OnRetry, first_delay: float = 0.2,
             max_delay: float = 5.0, stop: threading.Event | None = None, grace_s: float = 0.0,
             errors: tuple[type[Exception], ...] = (RetriableError,),
             wait: Callable[[float], None] | None = None) -> T:
    """`step()` until it returns. On one of `errors`, `on_retry(error, delay)` is called and the step runs again
    after `delay` (doubling up to `max_delay`); the error is raised instead once the next try would start past
    `within_s`. When `stop` is set, the wait in progress ends early and the tries go on, on their backoff, for
    `grace_s` more (none by default: the error is raised at once). `wait(delay)` replaces the sleep (a consumer
    serves its heartbeats meanwhile); it does not end early on `stop`."""
    tries = _Tries(within_s, first_delay, max_delay, stop, grace_s)
    while True:
        try:
            return step()
        except errors as e:
            delay = tries.delay()
            if delay is None:
                raise
            on_retry(e, delay)
            (wait or tries.wait)(delay)


async def retrying_async(step: Callable[[], Awaitable[T]], *, within_s: float, on_retry: OnRetry,
                         first_delay: float = 0.2, max_delay: float = 5.0,
                         errors: tuple[type[Exception], ...] = (RetriableError,)) -> T:
    """`retrying` for a coroutine step on an event loop: the waits are `asyncio.sleep`, a cancelled task stops."""
    tries = _Tries(within_s, first_delay, max_delay, None, 0.0)
    while True:
        try:
            return await step()
        except errors as e:
            delay = tries.delay()
            if delay is None:
                raise
            on_retry(e, delay)
            await asyncio.sleep(delay)
