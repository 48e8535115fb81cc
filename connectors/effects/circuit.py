"""A circuit per effect endpoint: stops sending while most requests fail transiently, probes, resumes on an answer.

Closed: every attempt goes through; the last `window` results (transient failure or not) are kept, and when at
least `ratio` of a full window failed transiently the circuit opens. Open: attempts wait in `admit` instead of
sending (no herd of per-key retries against a service that is down); one waiting attempt at a time is let through
as a probe, on a backoff (doubling from `probe_initial_s` to `probe_max_s`, or a Retry-After the endpoint gave).
Any answer to a probe that is not a transient failure (a 2xx, but also a 4xx: the endpoint is up) closes the
circuit and wakes every waiting attempt; each key's attempts wait in order, so the keys resume in order.
Single-threaded: everything runs on the executor's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from kafold import logs
from kafold.retry import backoff

log = logs.get("kafold.connectors.effects")

CLOSED, OPEN, PROBING = "closed", "open", "probing"


class Circuit:
    """The state of one endpoint as seen by one task."""

    def __init__(self, connector: str, endpoint: str, *, ratio: float, window: int, probe_initial_s: float,
                 probe_max_s: float, on_change: Callable[[str], None] | None = None) -> None:
        self.connector, self.endpoint = connector, endpoint
        self.ratio, self.window = ratio, window
        self.probe_initial_s, self.probe_max_s = probe_initial_s, probe_max_s
        self.on_change = on_change
        self.state = CLOSED
        self.results: deque[bool] = deque(maxlen=window)  # True = a transient failure
        self.probes = 0  # probes sent since the circuit opened
        self.probe_at = 0.0
        self.opened_at: float | None = None
        self.changes = 0
        self.waiting = 0  # attempts waiting in `admit`
        self._changed = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.ratio > 0

    async def admit(self, deadline: float) -> bool:
        """Wait until an attempt may be sent (monotonic `deadline`, else TimeoutError); True when it is a probe."""
        while self.state != CLOSED:
            now = time.monotonic()
            if self.state == OPEN and now >= self.probe_at:
                self._set(PROBING)
                self.probes += 1
                return True
            if now >= deadline:
                raise TimeoutError
            wake = deadline if self.state == PROBING else min(deadline, self.probe_at)
            changed = self._changed
            self.waiting += 1
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, wake - now))
            except TimeoutError:
                pass
            finally:
                self.waiting -= 1
        return False

    def record(self, transient_failure: bool, *, probe: bool, retry_after_s: float | None = None) -> None:
        """The result of an attempt `admit` let through."""
        if probe:
            if not transient_failure:
                self._close()
                return
            delay = backoff(self.probes + 1, self.probe_initial_s, self.probe_max_s)
            self.probe_at = time.monotonic() + max(delay, retry_after_s or 0.0)
            self._set(OPEN)
            return
        if self.state != CLOSED or not self.enabled:
            return  # an attempt sent before the circuit opened: the probes decide now
        self.results.append(transient_failure)
        if len(self.results) == self.window and sum(self.results) >= self.ratio * self.window:
            self.probes = 0
            self.opened_at = time.monotonic()
            self.probe_at = self.opened_at + max(self.probe_initial_s, retry_after_s or 0.0)
            self._set(OPEN)

    def _close(self) -> None:
        down_s = round(time.monotonic() - self.opened_at, 1) if self.opened_at is not None else None
        self.results.clear()
        self.opened_at = None
        self._set(CLOSED, down_s=down_s)

    def _set(self, state: str, **extra: object) -> None:
        was, self.state = self.state, state
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if (was == CLOSED) != (state == CLOSED):
            self.changes += 1
            fields = {"connector": self.connector, "endpoint": self.endpoint, "state": state, **extra}
            if state == OPEN:
                log.warning("circuit.opened", window=self.window, **fields,
                            reason="most requests to the endpoint fail transiently", hint="probing")
            else:
                log.info("circuit.closed", probes=self.probes, **fields, reason="the endpoint answers again",
                         hint="waiting keys resume")
            if self.on_change is not None:
                self.on_change(state)
