"""Records a second per connector and commands a second per aggregate over the last minute, for /status and the
status page: the daemon samples its own counters every few seconds (no I/O), so every viewer reads the same rate."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

WINDOW_S = 60.0  # the rate is over the samples of the last minute
SAMPLE_S = 5.0


class Rates:
    """Samples of cumulative counts by name; `per_second` is the rise between the oldest and newest sample of the
    window. A count that fell (a task restarted, a reload: its runner counts from zero again) counts from zero."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, dict[str, int]]] = deque()

    def due(self, now: float) -> bool:
        return not self.samples or now - self.samples[-1][0] >= SAMPLE_S

    def sample(self, totals: Mapping[str, int], now: float) -> None:
        self.samples.append((now, dict(totals)))
        while len(self.samples) > 2 and now - self.samples[1][0] >= WINDOW_S:
            self.samples.popleft()

    def per_second(self) -> dict[str, float]:
        """Each name's rate over the window; empty until two samples were taken (the first SAMPLE_S after start)."""
        if len(self.samples) < 2:
            return {}
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        if t1 <= t0:
            return {}
        return {name: round((n - first.get(name, 0) if n >= first.get(name, 0) else n) / (t1 - t0), 1)
                for name, n in last.items()}
