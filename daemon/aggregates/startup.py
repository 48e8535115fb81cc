"""A runtime's start beside the sibling worker processes of its daemon: its phases and their one deadline.

Started together, a daemon's worker processes (workers.py) must not each take the commands partitions as they come:
the first one built would join the group alone, take every partition and decide on them, and the next one's join
would move half of them away at once (the classic protocol is eager), their new owner replaying what was just
decided, the group paused meanwhile (group.initial.rebalance.delay.ms 0; Kafka's default 3 s delay hides it only
within those 3 s). So a worker's start goes through these phases, each left on the parent's word:

- BUILDING: the runtime makes its topics, producer and consumer;
- JOINING: built, it waits to join the group until every sibling is built too (they then join in one rebalance);
- HOLDING: in the group, it restores and replays its partitions but decides nothing until every sibling has had
  its first assignment (no partition is decided right before it moves);
- DECIDING: it decides.

One deadline for the whole start: a worker waits for its siblings at most `wait_s` (START_WAIT_S) from when it is
built, to join with them and then to decide with them; past it, it goes on alone (a sibling that never comes
holds no one for long). A runtime that is not a worker (`StartUp.without_siblings`) decides from the start.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from kafold import logs

log = logs.get(__name__)

START_WAIT_S = 30.0  # what a worker waits for its siblings in all, from when it is built, before it goes on alone
WORD_POLL_S = 0.05  # how soon a stop is seen while waiting at JOINING


class Phase(enum.IntEnum):
    """Where a start is; ordered, a start only ever moves forward."""

    BUILDING = 0
    JOINING = 1
    HOLDING = 2
    DECIDING = 3


def _nothing() -> None:
    return None


class StartUp:
    """One runtime's start (module docstring), a value the worker hands its runtime. The runtime calls `built` right
    before it joins the group (which tells the parent through `announce`, then waits at JOINING) and asks
    `may_decide` per batch; the parent's words (`let_join`, `let_decide`) arrive on another thread."""

    def __init__(self, aggregate: str, announce: Callable[[], None] = _nothing, wait_s: float = START_WAIT_S,
                 phase: Phase = Phase.BUILDING) -> None:
        self.aggregate, self.announce, self.wait_s = aggregate, announce, wait_s
        self.phase = phase
        self.deadline: float | None = None  # monotonic: set when built
        self.alone = False  # went on past the deadline without its siblings' word
        self.changed = threading.Condition()

    @classmethod
    def without_siblings(cls, aggregate: str) -> StartUp:
        """The start of a runtime that has no siblings to wait for (not a worker process): deciding at once."""
        return cls(aggregate, wait_s=0.0, phase=Phase.DECIDING)

    # ---- the parent's words (another thread) ---------------------------------------------------------------
    def let_join(self) -> None:
        self._reach(Phase.HOLDING)

    def let_decide(self) -> None:
        self._reach(Phase.DECIDING)

    def _reach(self, phase: Phase) -> None:
        with self.changed:
            if phase > self.phase:
                self.phase = phase
                self.changed.notify_all()

    # ---- the runtime's side -------------------------------------------------------------------------------
    def built(self, stopping: threading.Event) -> None:
        """Built: announce it, then wait for the word to join, a stop, or the deadline (then joins alone)."""
        if self.phase is Phase.DECIDING:
            return
        with self.changed:
            self.deadline = time.monotonic() + self.wait_s
            self.phase = max(self.phase, Phase.JOINING)
        self.announce()
        while not stopping.is_set():
            with self.changed:
                if self.phase >= Phase.HOLDING:
                    return
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._give_up()
                    return
                self.changed.wait(min(left, WORD_POLL_S))

    def may_decide(self, wait_s: float = 0.0) -> bool:
        """Whether commands may be decided; while held, first waits up to `wait_s` for the word or the deadline
        (the caller then polls again rather than spin on fetches sought back)."""
        if self.phase is Phase.DECIDING:
            return True
        with self.changed:
            if self.phase < Phase.DECIDING and self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._give_up()
                elif wait_s > 0:
                    self.changed.wait(min(left, wait_s))
            return self.phase is Phase.DECIDING

    def _give_up(self) -> None:
        """Past the deadline (the lock held): on alone, deciding from now on."""
        log.warning("aggregate.start_alone", aggregate=self.aggregate, phase=self.phase.name.lower(),
                    waited_s=self.wait_s)
        self.alone = True
        self.phase = Phase.DECIDING
        self.changed.notify_all()
