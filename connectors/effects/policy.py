"""How an effect attempt failed, and what to do next: retry after a full-jitter backoff, or park.

Transient failures (a refused connection, a timeout, 408/409/425/429, a 5xx) are retried until the event's
`max_age_s` (a day by default: a receiver's deploy or an outage of hours heals by itself), and `max_attempts`
when set; only permanent failures and events past their age are parked.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kafold.errors import KafoldError
from kafold.retry import backoff


class EffectError(KafoldError):
    """An attempt failed; `retriable` says whether another attempt may succeed."""

    retriable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RetriableEffectError(EffectError):
    """Transient: a 5xx, a timeout, a refused connection, a 429/503 (with its Retry-After)."""


class PermanentEffectError(EffectError):
    """Retrying cannot help (a 4xx such as 400 or 404, a bad mapping): the event is parked at once."""

    retriable = False


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded by the age of the first attempt (and attempts, unless 0)."""

    max_attempts: int
    max_age_s: float
    initial_s: float
    cap_s: float

    def delay(self, attempt: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based); a Retry-After wins when given."""
        if retry_after_s is not None:
            return max(0.0, retry_after_s)
        return rng.uniform(0.0, backoff(attempt, self.initial_s, self.cap_s))

    def next_delay(self, attempt: int, age_s: float, error: BaseException, rng: random.Random) -> float | None:
        """The wait before the next attempt, or None when the event must be parked now."""
        if not retriable(error) or (self.max_attempts and attempt >= self.max_attempts):
            return None
        wait = self.delay(attempt, rng, getattr(error, "retry_after_s", None))
        if age_s + wait > self.max_age_s:
            return None
        return wait


def retriable(error: BaseException) -> bool:
    """Whether another attempt may succeed (anything but an EffectError saying otherwise is transient)."""
    return bool(getattr(error, "retriable", True))


def describe(error: BaseException, limit: int = 500) -> str:
    """A short, payload-free description of an error for the ledger and logs."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text[:limit]
