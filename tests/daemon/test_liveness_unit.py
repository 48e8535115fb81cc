"""GroupState parsing of librdkafka statistics and GroupWatch's warn / wedged verdicts (pure logic)."""

from __future__ import annotations

import orjson

from kafold.daemon.liveness import REJOIN_MARGIN_S, WARN_AFTER_S, WARN_EVERY_S, GroupState, GroupWatch

STATS = orjson.dumps({"name": "rdkafka#consumer-1", "type": "consumer", "brokers": {}, "topics": {},
                      "cgrp": {"state": "up", "stateage": 4012, "join_state": "wait-join", "rebalance_age": 4001,
                               "rebalance_cnt": 3, "rebalance_reason": "group is rebalancing",
                               "assignment_size": 0}})


def test_the_group_part_of_a_statistics_report_is_read() -> None:
    s = GroupState.from_stats(STATS)
    assert s == GroupState("up", "wait-join", 4012, 4001, 3, "group is rebalancing", 0) and not s.steady
    assert GroupState.from_stats(b'{"name": "rdkafka#producer-1", "type": "producer"}') is None
    assert GroupState("up", "steady").steady and not GroupState("wait-coord", "steady").steady


def test_a_steady_group_is_never_pending_even_without_partitions() -> None:
    w = GroupWatch(300.0, 45.0)
    w.reset(now=0.0)
    w.update(GroupState("up", "steady", assignment_size=0), now=1.0)  # more members than partitions
    assert w.pending_s(now=10_000.0) == 0.0 and not w.should_warn(now=10_000.0) and not w.wedged(now=10_000.0)


def test_a_pending_join_is_warned_about_once_a_period_then_called_wedged() -> None:
    w = GroupWatch(300.0, 45.0)
    w.reset(now=0.0)
    w.update(GroupState("up", "wait-join"), now=5.0)
    assert w.pending_s(now=5.0) == 5.0  # pending since the subscription, not since the first report
    assert not w.should_warn(now=WARN_AFTER_S - 1)
    assert w.should_warn(now=WARN_AFTER_S + 1) and not w.should_warn(now=WARN_AFTER_S + 2)
    assert w.should_warn(now=WARN_AFTER_S + 1 + WARN_EVERY_S)
    limit = 300.0 + 45.0 + REJOIN_MARGIN_S
    assert not w.wedged(now=limit - 1) and w.wedged(now=limit + 1)
    assert w.fields(now=100.0)["join_pending_s"] == 100.0 and w.fields()["join_state"] == "wait-join"
    w.update(GroupState("up", "steady", assignment_size=4), now=limit + 2)
    assert not w.wedged(now=limit + 3) and w.pending_s(now=limit + 3) == 0.0
    w.update(GroupState("up", "wait-sync"), now=limit + 10)  # a later rebalance starts a new pending period
    assert w.pending_s(now=limit + 15) == 5.0
