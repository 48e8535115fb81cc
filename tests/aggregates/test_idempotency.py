"""The idempotency window, driven from outside: a command id retried within the window is decided once, whatever
happened in between (many commands, evictions, another instance, snapshots and restarts); after it, again."""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from kafold.config import AggregateConfig, KafkaConfig
from kafold.daemon.aggregates.restorer import SnapshotRestorer
from kafold.snapshot.fold import Domain
from kafold.spark_jobs.runs import run_local
from tests.aggregates.agg_support import (
    Outside,
    bank_config,
    bank_domain,
    create_topics,
    events,
    fold_balances,
    running,
    runtime,
)
from tests.support import wait_for

# The guarantee is run again on Apache Kafka in `make test` (marker apache_kafka).
pytestmark = pytest.mark.apache_kafka

SAME = ("status", "version", "event_ids", "reason")


def _no_event_id_twice(evs: list[dict[str, Any]]) -> None:
    twice = [i for i, n in Counter(e["event_id"] for e in evs).items() if n > 1]
    assert not twice, f"event ids written twice: {twice[:5]}"


def _projection(evs: list[dict[str, Any]]) -> dict[str, int]:
    """What a projection keyed on event id shows: each event id applied once."""
    seen: set[str] = set()
    unique = [e for e in evs if not (e["event_id"] in seen or seen.add(e["event_id"]))]  # type: ignore[func-returns-value]
    return {aid: balance for aid, (_, balance, _) in fold_balances(unique).items()}


def test_a_late_retry_after_40_and_after_10000_other_commands_is_decided_once(kafka_config: KafkaConfig,
                                                                               unique: str) -> None:
    agg = bank_config(unique)
    create_topics(kafka_config, agg)
    client = Outside(kafka_config, agg)
    with running(runtime(kafka_config, agg)) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        assert client.ask("open", "acc", "OpenAccount", {"owner": "ann"})["status"] == "accepted"
        first = client.ask("retry-1", "acc", "Deposit", {"amount": 50})
        for i in range(40):
            client.send(f"c40-{i}", "acc", "Deposit", {"amount": 1})
        again = client.ask("retry-1", "acc", "Deposit", {"amount": 50})
        for i in range(10_000):
            client.send(f"c10k-{i}", "acc", "Deposit", {"amount": 1})
        late = client.ask("retry-1", "acc", "Deposit", {"amount": 50})
        state = r.runtime.get("acc")
    client.close()
    assert (first["status"], first["version"], first["duplicate"]) == ("accepted", 2, False)
    for repeat in (again, late):
        assert repeat["duplicate"] and (repeat["status"], repeat["version"], repeat["event_ids"]) == (
            "accepted", 2, first["event_ids"]), repeat
    evs = events(kafka_config, agg)
    _no_event_id_twice(evs)
    assert [e["event_id"] for e in evs if e["causation_id"] == "retry-1"] == first["event_ids"]
    assert state is not None and state[0].balance == 50 + 40 + 10_000 == _projection(evs)["acc"]
    assert state[1] == len(evs) == 2 + 40 + 10_000


def test_retries_after_eviction_and_on_another_instance_repeat_the_first_outcome(kafka_config: KafkaConfig,
                                                                                unique: str) -> None:
    agg = bank_config(unique, cache_max_aggregates=2)
    create_topics(kafka_config, agg)
    client = Outside(kafka_config, agg)
    with running(runtime(kafka_config, agg, "i1")) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        rejected = client.ask("rej-1", "r", "Deposit", {"amount": 5})  # the account is not open yet
        assert rejected["status"] == "rejected" and rejected["reason"] == "account is new"
        client.ask("open-r", "r", "OpenAccount", {"owner": "r"})
        client.ask("open-e", "e", "OpenAccount", {"owner": "e"})
        accepted = client.ask("dep-e", "e", "Deposit", {"amount": 7})
        for other in ("x1", "x2", "x3"):  # push r and e out of the cache (2 aggregates)
            client.ask(f"open-{other}", other, "OpenAccount", {"owner": other})
        wait_for(lambda: r.runtime.store.is_evicted(0, "r") and r.runtime.store.is_evicted(0, "e"),
                 what="r and e evicted")
        got = r.runtime.get("e")
        assert got is not None and (got[0].balance, got[1], got[2]) == (7, 2, "events")
        # the state would now accept rej-1, the first outcome stands; both are rebuilt for the evicted aggregates
        for cid, aid, amount, first in (("rej-1", "r", 5, rejected), ("dep-e", "e", 7, accepted)):
            repeat = client.ask(cid, aid, "Deposit", {"amount": amount})
            assert repeat["duplicate"] and {k: repeat[k] for k in SAME} == {k: first[k] for k in SAME}, repeat
        assert r.runtime.counts["reloads"] >= 2
    with running(runtime(kafka_config, agg, "i2")) as r2:  # the partition moves to another instance
        wait_for(lambda: r2.runtime.ready, what="second instance live")
        assert client.ask("rej-1", "r", "Deposit", {"amount": 5})["duplicate"]
        assert client.ask("dep-e", "e", "Deposit", {"amount": 7})["duplicate"]
        state = r2.runtime.get("e")
    client.close()
    assert state is not None and state[0].balance == 7
    evs = events(kafka_config, agg)
    _no_event_id_twice(evs)
    assert sum(1 for e in evs if e["causation_id"] in ("rej-1", "dep-e")) == 1


def test_a_retry_after_the_window_is_decided_again_with_new_event_ids(kafka_config: KafkaConfig,
                                                                      unique: str) -> None:
    agg = bank_config(unique, idempotency_window_s=60)
    create_topics(kafka_config, agg)
    client = Outside(kafka_config, agg)
    now = int(time.time() * 1000)
    with running(runtime(kafka_config, agg)) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        client.ask("open", "w", "OpenAccount", {"owner": "w"}, at_ms=now - 120_000)
        first = client.ask("late-1", "w", "Deposit", {"amount": 10}, at_ms=now - 120_000)
        within = client.ask("late-1", "w", "Deposit", {"amount": 10}, at_ms=now - 61_000)  # 59 s later
        after = client.ask("late-1", "w", "Deposit", {"amount": 10}, at_ms=now)  # 120 s later: past the window
        state = r.runtime.get("w")
    client.close()
    assert within["duplicate"] and within["event_ids"] == first["event_ids"]
    assert not after["duplicate"] and after["status"] == "accepted" and after["version"] == 3
    assert set(after["event_ids"]).isdisjoint(first["event_ids"])
    assert state is not None and state[0].balance == 20
    evs = events(kafka_config, agg)
    _no_event_id_twice(evs)
    assert [e["occurred_at"][:19] for e in evs if e["causation_id"] == "late-1"] == [
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t / 1000)) for t in (now - 120_000, now)]


def _snapshot_run(kafka: KafkaConfig, agg: AggregateConfig) -> None:
    from tests.aggregates.agg_support import BANK

    run_local(kafka, agg, Domain.load(agg, [str(BANK)]), list(range(agg.partitions)))


def _balances(rt: Any, accounts: list[str]) -> dict[str, int | None]:
    return {a: (got[0].balance if (got := rt.get(a)) is not None else None) for a in accounts}


def test_random_retries_restarts_and_snapshot_runs_decide_each_command_id_once(kafka_config: KafkaConfig,
                                                                                unique: str) -> None:
    """A property over seeded random histories: commands with retries of any earlier id (any delay within the
    window), restarts and snapshot runs in between. The model decides each command id once, in send order."""
    agg = bank_config(unique, partitions=2)
    create_topics(kafka_config, agg)
    rng = random.Random(19)
    accounts = [f"p{i}" for i in range(12)]
    model: dict[str, int] = {}
    decided: dict[str, str] = {}  # command id -> "accepted" / "rejected", as the model decides it
    history: list[tuple[str, str, str, dict[str, Any]]] = []
    client = Outside(kafka_config, agg)

    def model_apply(cid: str, aid: str, kind: str, data: dict[str, Any]) -> None:
        if cid in decided:
            return
        if kind == "OpenAccount":
            ok = aid not in model
            model.setdefault(aid, 0)
        elif aid not in model:
            ok = False
        elif kind == "Deposit":
            ok, model[aid] = True, model[aid] + data["amount"]
        else:
            ok = data["amount"] <= model[aid]
            model[aid] -= data["amount"] if ok else 0
        decided[cid] = "accepted" if ok else "rejected"

    snapshot_runs = restarts = 0
    for round_ in range(8):
        restorer = SnapshotRestorer(kafka_config, agg, bank_domain(agg))
        with running(runtime(kafka_config, agg, f"i{round_}", restorer=restorer)) as r:
            wait_for(lambda r=r: r.runtime.ready, what="runtime live")  # type: ignore[misc]
            for _ in range(rng.randint(20, 120)):
                if history and rng.random() < 0.3:
                    cmd = rng.choice(history)  # a retry of an earlier id, sent again unchanged
                else:
                    aid = rng.choice(accounts)
                    kind = rng.choice(("OpenAccount", "Deposit", "Deposit", "Withdraw"))
                    data = {"owner": aid} if kind == "OpenAccount" else {"amount": rng.randint(1, 50)}
                    cmd = (f"c-{uuid.uuid4().hex[:12]}", aid, kind, data)
                    history.append(cmd)
                client.send(*cmd)
                model_apply(*cmd)
            client.wait()
            # A result is visible once its transaction commits, and the runtime marks the states that transaction
            # committed right after: a read without a version may trail the last result by that moment, so the
            # states are waited for (wait_for names the round), not sampled once
            wait_for(lambda r=r: _balances(r.runtime, accounts) == {a: model.get(a) for a in accounts},  # type: ignore[misc]
                     timeout=30, what=f"round {round_}: the runtime's states equal the model")
        restarts += 1
        if rng.random() < 0.5:
            _snapshot_run(kafka_config, agg)
            snapshot_runs += 1
    client.close()
    assert snapshot_runs and restarts == 8
    for cid, outcomes in client.results.items():
        firsts = [o for o in outcomes if not o["duplicate"]]
        assert len(firsts) == 1, f"{cid} decided {len(firsts)} times: {outcomes}"
        assert firsts[0]["status"] == decided[cid], (cid, outcomes)
        assert all((o["status"], o["version"], o["event_ids"]) == (firsts[0]["status"], firsts[0]["version"],
                                                                   firsts[0]["event_ids"]) for o in outcomes)
    evs = events(kafka_config, agg)
    _no_event_id_twice(evs)
    assert _projection(evs) == model


def test_a_snapshot_too_busy_to_carry_its_whole_window_has_the_rest_read_back(
        kafka_config: KafkaConfig, unique: str, monkeypatch: Any) -> None:
    """A snapshot carries at most MAX_SNAPSHOT_COMMANDS ids (a record stays under Kafka's size limit); a restore
    from one that carried fewer than its window reads the older ids back from the events."""
    from kafold.snapshot import fold

    monkeypatch.setattr(fold, "MAX_SNAPSHOT_COMMANDS", 5)
    agg = bank_config(unique)
    create_topics(kafka_config, agg)
    client = Outside(kafka_config, agg)
    with running(runtime(kafka_config, agg, "i1")) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        client.ask("open", "busy", "OpenAccount", {"owner": "b"})
        first = client.ask("old-1", "busy", "Deposit", {"amount": 3})
        for i in range(20):
            client.send(f"d-{i}", "busy", "Deposit", {"amount": 1})
        client.wait()
    _snapshot_run(kafka_config, agg)
    with running(runtime(kafka_config, agg, "i2", restorer=SnapshotRestorer(kafka_config, agg, bank_domain(agg)))
                 ) as r2:
        wait_for(lambda: r2.runtime.ready, what="runtime live again")
        assert r2.runtime.gates[0].snapshot_version is not None  # restored from the snapshot
        again = client.ask("old-1", "busy", "Deposit", {"amount": 3})
        state = r2.runtime.get("busy")
    client.close()
    assert again["duplicate"] and again["event_ids"] == first["event_ids"]
    assert state is not None and state[0].balance == 23
    _no_event_id_twice(events(kafka_config, agg))
