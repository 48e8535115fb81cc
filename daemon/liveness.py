"""Liveness of a sink task's consumer: its group membership from librdkafka's statistics, and a stuck-join guard.

Why: a consumer that joined its group but never gets an assignment does no work and raises no error; from the
outside it looks idle. librdkafka reports its group state every `STATS_INTERVAL_MS` (the `cgrp` object of its
statistics: state, join_state, how long in that state, rebalances). `GroupWatch` turns that into a warning while a
join has been pending for more than `WARN_AFTER_S`, and a verdict: a conforming coordinator completes or fails a
join within the rebalance timeout (members that do not rejoin in time are dropped), so a join still pending
after the rebalance timeout + the session timeout + `REJOIN_MARGIN_S` is wedged, and the runner leaves the group
and joins again with a fresh consumer (see daemon.runner: the partitions it holds are revoked first, so offsets
are committed as in any rebalance). Steady membership with no partitions (more members than partitions) is not
a stall.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from kafold.config import GroupProtocol, KafkaConfig

STATS_INTERVAL_MS = 5000
WARN_AFTER_S = 60.0
WARN_EVERY_S = 60.0
REJOIN_MARGIN_S = 30.0


@dataclass(frozen=True, slots=True)
class GroupState:
    """The `cgrp` part of one librdkafka statistics report."""

    state: str = "unknown"  # e.g. "up", "query-coord", "wait-coord"
    join_state: str = "unknown"  # e.g. "steady", "wait-join", "wait-sync", "wait-assign-call"
    state_age_ms: int = 0
    rebalance_age_ms: int = 0
    rebalances: int = 0
    rebalance_reason: str = ""
    assignment_size: int = 0

    @property
    def steady(self) -> bool:
        return self.state == "up" and self.join_state == "steady"

    @classmethod
    def from_stats(cls, stats_json: str | bytes) -> GroupState | None:
        """The group state in a statistics JSON document (None when it has no `cgrp`: not a group consumer)."""
        cgrp = orjson.loads(stats_json).get("cgrp")
        if not isinstance(cgrp, dict):
            return None
        return cls(str(cgrp.get("state", "unknown")), str(cgrp.get("join_state", "unknown")),
                   int(cgrp.get("stateage", 0)), int(cgrp.get("rebalance_age", 0)), int(cgrp.get("rebalance_cnt", 0)),
                   str(cgrp.get("rebalance_reason", "")), int(cgrp.get("assignment_size", 0)))


class GroupWatch:
    """Feeds on GroupState reports; says when to warn about a pending join and when it is wedged."""

    def __init__(self, rebalance_timeout_s: float, session_timeout_s: float, *, init_is_steady: bool = False) -> None:
        self.rejoin_after_s = rebalance_timeout_s + session_timeout_s + REJOIN_MARGIN_S
        # The consumer group protocol (KIP-848) leaves a member the broker assigned nothing (more members than
        # partitions) in join state "init" with no rebalance counted: in its statistics it looks like one still
        # joining (librdkafka 2.16, seen on Apache Kafka 4.3). Its join is heartbeats that librdkafka sends and
        # repeats by itself; the wedged JoinGroup this watch guards against is the classic protocol's. There, "up"
        # (the coordinator found and answering) in "init" counts as steady, else every idle member would leave
        # and join again, over and over.
        self.init_is_steady = init_is_steady
        self.current: GroupState | None = None
        self.unsteady_since: float | None = None  # monotonic time of the first non-steady report in a row
        self._warned_at: float | None = None

    @classmethod
    def for_kafka(cls, kafka: KafkaConfig) -> GroupWatch:
        """The watch for a consumer of [kafka]: its timeouts, its group protocol."""
        return cls(kafka.rebalance_timeout_ms / 1000, kafka.session_timeout_ms / 1000,
                   init_is_steady=kafka.group_protocol is GroupProtocol.CONSUMER)

    def reset(self, now: float | None = None) -> None:
        """A new consumer (subscribed at `now`): its join is pending from then on."""
        self.current = None
        self.unsteady_since = time.monotonic() if now is None else now
        self._warned_at = None

    def update(self, state: GroupState, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.current = state
        if state.steady or (self.init_is_steady and state.state == "up" and state.join_state == "init"):
            self.unsteady_since = self._warned_at = None
        elif self.unsteady_since is None:
            self.unsteady_since = now

    def pending_s(self, now: float | None = None) -> float:
        """How long the join has been pending (0 when steady)."""
        if self.unsteady_since is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.unsteady_since

    def should_warn(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self.pending_s(now) < WARN_AFTER_S:
            return False
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY_S:
            return False
        self._warned_at = now
        return True

    def wedged(self, now: float | None = None) -> bool:
        return self.pending_s(now) > self.rejoin_after_s

    def fields(self, now: float | None = None) -> dict[str, Any]:
        """What to log about the group (the latest report and how long the join has been pending)."""
        s = self.current or GroupState()
        return {"group_state": s.state, "join_state": s.join_state, "state_age_ms": s.state_age_ms,
                "rebalances": s.rebalances, "rebalance_reason": s.rebalance_reason,
                "assignment_size": s.assignment_size, "join_pending_s": round(self.pending_s(now), 1)}

    def observe(self, stats_json: str, log: Any, group_id: str) -> None:
        """librdkafka's statistics (served by consume(), in the consumer's thread): the group's state, a change of
        it logged."""
        state = GroupState.from_stats(stats_json)
        if state is None:
            return
        before = self.current
        if before is None or (before.state, before.join_state) != (state.state, state.join_state):
            log.info("runner.group_state", group=group_id, group_state=state.state, join_state=state.join_state,
                     assignment_size=state.assignment_size, rebalances=state.rebalances,
                     rebalance_reason=state.rebalance_reason)
        self.update(state)

    def look(self, log: Any, group_id: str) -> bool:
        """Warn while the group join is pending; True once it is wedged (past the rebalance timeout): the consumer
        is to leave the group and join again."""
        if self.unsteady_since is None:
            return False
        now = time.monotonic()
        if self.wedged(now):
            log.error("runner.group_rejoining", group=group_id, **self.fields(now),
                      reason="group join still pending past the rebalance and session timeouts",
                      hint="leaving the group and joining again with a new consumer")
            return True
        if self.should_warn(now):
            log.warning("runner.group_join_pending", reason="no partitions assigned yet", group=group_id,
                        **self.fields(now))
        return False
