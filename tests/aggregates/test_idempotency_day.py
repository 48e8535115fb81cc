"""A command id retried 20 hours later at 1,000 commands/s gets its first outcome back (issue 56), without waiting 20
hours: the window's clock is the command time (each command record's timestamp), so the commands are written with
timestamps 1 ms apart (1,000 a second) in bursts spread over 25 hours of command time, the runtime restarted on its
local store in between. Memory holds far fewer ids and aggregates than that (idempotency_max_ids, the cache): the
first outcome comes back from the store on disk, which is pruned by age (command time), not by a count."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from kafold.config import KafkaConfig
from kafold.daemon.aggregates import AggregateRuntime
from tests.aggregates.agg_support import DAEMON, Outside, bank_config, bank_domain, create_topics, events, running
from tests.support import wait_for

pytestmark = pytest.mark.apache_kafka

HOUR = 3_600_000
BURST, ACCOUNTS = 200, 300  # commands per burst (1 ms apart: 1,000/s), accounts they go to (cache: 20)


def _runtime(kafka: KafkaConfig, agg: Any, state_dir: Path) -> AggregateRuntime:
    daemon = dataclasses.replace(DAEMON, state_dir=str(state_dir), batch_max_records=100)
    return AggregateRuntime(kafka, daemon, agg, bank_domain(agg), instance_id="day")


def _bursts(client: Outside, t0: int, hours: range, tag: str) -> None:
    """One burst of BURST deposits at each hour of `hours` after t0, 1 ms apart, round the accounts."""
    for h in hours:
        for i in range(BURST):
            aid = f"acc-{(h * BURST + i) % ACCOUNTS:03d}"
            client.send(f"{tag}-{h}-{i}", aid, "Deposit", {"amount": 1}, at_ms=t0 + h * HOUR + i)
    client.wait(timeout=120)


def _on_disk(rt: AggregateRuntime, aggregate_id: str, command_id: str) -> bool:
    """The outcome of `command_id` is in the local store (expired ones linger there until swept)."""
    assert rt.local is not None
    return rt.local.outcome(0, aggregate_id, command_id) is not None


def test_a_command_retried_twenty_hours_later_at_1000_per_s_gets_its_first_outcome(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path) -> None:
    agg = dataclasses.replace(bank_config(unique), cache_max_aggregates=20, idempotency_max_ids=300)
    create_topics(kafka_config, agg, {"retention.ms": "-1"})  # records dated a day back stay
    state_dir = tmp_path / "state"
    t0 = int(time.time() * 1000) - 26 * HOUR  # the whole timeline lies in the past (no command from the future)
    client = Outside(kafka_config, agg)
    try:
        with running(_runtime(kafka_config, agg, state_dir)) as r:
            wait_for(lambda: r.runtime.ready, what="runtime live")
            for i in range(ACCOUNTS):
                client.send(f"open-{i}", f"acc-{i:03d}", "OpenAccount", {"owner": str(i)}, at_ms=t0 - 1000 + i)
            client.wait()
            first = client.ask("first", "acc-000", "Deposit", {"amount": 5}, at_ms=t0)
            other = client.ask("other", "acc-001", "Deposit", {"amount": 7}, at_ms=t0 + 1)
            refused = client.ask("refused", "acc-002", "Withdraw", {"amount": 10**9}, at_ms=t0 + 2)
            _bursts(client, t0, range(1, 11), "a")
            held = r.runtime.idempotency()
        with running(_runtime(kafka_config, agg, state_dir)) as r:  # a restart on the same host, mid-way
            wait_for(lambda: r.runtime.ready, what="runtime live again", timeout=60)
            assert r.runtime.gates[0].start > 0  # its store trusted
            _bursts(client, t0, range(11, 21), "b")
            assert "acc-000" not in r.runtime.store.entries  # evicted: the outcome is read from disk
            again = client.ask("first", "acc-000", "Deposit", {"amount": 5}, at_ms=t0 + 20 * HOUR + BURST)
            refused_again = client.ask("refused", "acc-002", "Withdraw", {"amount": 10**9},
                                       at_ms=t0 + 20 * HOUR + BURST + 1)
            assert _on_disk(r.runtime, "acc-001", "other")
            _bursts(client, t0, range(21, 26), "c")  # the window now starts after t0 + 1 h: t0's ids are pruned
            wait_for(lambda: not _on_disk(r.runtime, "acc-001", "other"), what="t0's outcomes swept from disk")
            late = client.ask("other", "acc-001", "Deposit", {"amount": 7}, at_ms=t0 + 25 * HOUR + BURST)
            figures = r.runtime.idempotency()
    finally:
        client.close()
    # far more ids than memory held (idempotency_max_ids; the ids of evicted aggregates left with them)
    assert held["ids_held"] <= 300 < len(client.sent) and figures["max_ids"] == 300
    assert again["duplicate"] and not first["duplicate"]
    assert (again["status"], again["version"], again["event_ids"]) == (first["status"], first["version"],
                                                                       first["event_ids"])
    assert refused_again["duplicate"] and refused_again["reason"] == refused["reason"]
    assert not late["duplicate"] and late["status"] == other["status"] and late["version"] > other["version"]
    evs = events(kafka_config, agg)
    assert [e for e in evs if e.get("causation_id") == "first"] == [e for e in evs if e["event_id"] in
                                                                    first["event_ids"]]  # one event, the first
    assert sum(1 for e in evs if e.get("causation_id") == "other") == 2  # decided again past the window
