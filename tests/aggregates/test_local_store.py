"""The local state store (daemon/aggregates/local.py) on Apache Kafka: a working set far larger than the cache is
decided from disk with no partition scan; a retried command id gets its first outcome from the store; a deleted or
corrupted store is rebuilt from the events; the store is trusted on restart and only the tail is replayed."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path
from typing import Any

import lmdb
import orjson
import pytest
from structlog.testing import capture_logs

from kafold.client import CommandClient
from kafold.config import KafkaConfig
from kafold.daemon.aggregates import AggregateRuntime, local, recovery
from kafold.daemon.aggregates.restorer import SnapshotRestorer
from kafold.errors import FatalError
from kafold.snapshot.fold import Domain
from kafold.spark_jobs.runs import run_local
from tests.aggregates.agg_support import (
    BANK,
    DAEMON,
    bank_config,
    bank_domain,
    create_topics,
    events,
    fold_balances,
    read_all,
    running,
)
from tests.support import wait_for

ACCOUNTS, CACHE, COMMANDS = 500, 10, 2000


def _runtime(kafka: KafkaConfig, agg: Any, state_dir: Path, instance: str = "i1", restorer: Any = None) -> Any:
    daemon = dataclasses.replace(DAEMON, state_dir=str(state_dir), batch_max_records=200)
    return AggregateRuntime(kafka, daemon, agg, bank_domain(agg), instance_id=instance, restorer=restorer)


class CountingRestorer(SnapshotRestorer):
    """The snapshot restorer, counting its restores (each one reads the snapshot topic)."""

    calls = 0

    def restore(self, partition: int, low: int, end: int) -> recovery.Base:
        self.calls += 1
        return super().restore(partition, low, end)


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """Every partition scan for evicted aggregates (recovery.reload), with the ids it was for."""
    seen: list[set[str]] = []
    real = recovery.reload

    def counting(*args: Any, **kw: Any) -> int:
        seen.append(set(args[5]))
        return real(*args, **kw)

    monkeypatch.setattr(recovery, "reload", counting)
    return seen


def _plan(rng: random.Random, accounts: list[str], n: int) -> list[tuple[str, str, int]]:
    plan = [(a, "OpenAccount", 0) for a in accounts]
    while len(plan) < n:
        plan.append((rng.choice(accounts), rng.choice(("Deposit", "Deposit", "Withdraw")), rng.randint(1, 100)))
    return plan


def _model(plan: list[tuple[str, str, int]]) -> tuple[dict[str, int], list[bool]]:
    balance: dict[str, int] = {}
    accepted = []
    for aid, kind, amount in plan:
        ok = kind != "Withdraw" or amount <= balance[aid]
        balance[aid] = balance.get(aid, 0) + (amount if kind == "Deposit" else -amount if ok and kind == "Withdraw"
                                              else 0)
        accepted.append(ok)
    return balance, accepted


def _send(client: CommandClient, plan: list[tuple[str, str, int]]) -> list[Any]:
    cmds = [client.command(a, k, {"owner": a} if k == "OpenAccount" else {"amount": x}) for a, k, x in plan]
    got = client.send_many(cmds, timeout=60)
    return [got[c.command_id] for c in cmds]


def test_working_set_fifty_times_the_cache_decides_from_disk(kafka_config: KafkaConfig, unique: str,
                                                              tmp_path: Path, scans: list[set[str]]) -> None:
    """500 accounts through a cache of 10: every decision equals the model's, and no partition is ever scanned."""
    agg = dataclasses.replace(bank_config(unique, partitions=2), cache_max_aggregates=CACHE)
    create_topics(kafka_config, agg)
    rng = random.Random(56)
    accounts = [f"acc-{i:04d}" for i in range(ACCOUNTS)]
    plan = _plan(rng, accounts, COMMANDS)
    balance, accepted = _model(plan)
    with running(_runtime(kafka_config, agg, tmp_path / "state")) as r, CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        got = _send(c, plan)
        assert [x.accepted for x in got] == accepted
        rt = r.runtime
        assert len(rt.store) <= CACHE + 200  # the LRU is trimmed after each batch
        assert rt.store.evictions > ACCOUNTS
        # an aggregate that is not cached is answered from the store
        cold = next(a for a in accounts if a not in rt.store.entries)
        state, _, where = rt.get(cold)
        assert where == "store" and state.balance == balance[cold]
    assert scans == [] and rt.counts["reloads"] == 0
    assert {a: b for a, (_, b, _) in fold_balances(events(kafka_config, agg)).items()} == balance


def test_retry_after_eviction_gets_first_outcome_from_the_store(kafka_config: KafkaConfig, unique: str,
                                                                 tmp_path: Path, scans: list[set[str]]) -> None:
    """A command id whose aggregate and window entry left memory (evicted, idempotency_max_ids of 1) is answered
    with its first outcome, nothing written."""
    agg = dataclasses.replace(bank_config(unique), cache_max_aggregates=2, idempotency_max_ids=1)
    create_topics(kafka_config, agg)
    with capture_logs() as logged, running(_runtime(kafka_config, agg, tmp_path / "state")) as r, \
            CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        c.send(c.command("a", "OpenAccount", {"owner": "a"}))
        first = c.send(c.command("a", "Deposit", {"amount": 5}, command_id="dep-a"))
        refused = c.send(c.command("a", "Withdraw", {"amount": 500}, command_id="wd-a"))
        _send(c, [(f"o-{i}", "OpenAccount", 0) for i in range(20)])  # push "a" and its ids out of memory
        # trimmed once the batch's store write is done: a moment after its results are visible to the client
        wait_for(lambda: "a" not in r.runtime.store.entries, what="'a' evicted from the cache")
        again = c.send(c.command("a", "Deposit", {"amount": 5}, command_id="dep-a"))
        refused_again = c.send(c.command("a", "Withdraw", {"amount": 500}, command_id="wd-a"))
    assert first is not None and again is not None and refused is not None and refused_again is not None
    assert again.duplicate and (again.version, again.event_ids) == (first.version, first.event_ids)
    assert refused_again.duplicate and not refused_again.accepted and refused_again.reason == refused.reason
    assert [e["version"] for e in events(kafka_config, agg) if e["aggregate_id"] == "a"] == [1, 2]
    assert scans == []
    names = {x["event"] for x in logged}
    assert "aggregate.idempotency_window_memory_full" in names and "aggregate.idempotency_window_full" not in names


@pytest.mark.parametrize("damage", ["trusted", "deleted", "garbage", "bad_record", "ahead"])
def test_restart_trusts_an_intact_store_and_rebuilds_a_damaged_one(kafka_config: KafkaConfig, unique: str,
                                                                    tmp_path: Path, damage: str,
                                                                    scans: list[set[str]]) -> None:
    """Restart on the same directory: an intact store is trusted (only the tail is replayed); a deleted,
    unreadable or ahead-of-the-events one is rebuilt at the open (no snapshots here: a full replay) and fills again;
    a damaged record is found when it is read (the open checks the meta record only): the runtime stops, and its
    restart rebuilds the partition; the state is right either way."""
    agg = dataclasses.replace(bank_config(unique), cache_max_aggregates=5)
    create_topics(kafka_config, agg)
    state_dir = tmp_path / "state"
    accounts = [f"acc-{i:03d}" for i in range(50)]
    plan = _plan(random.Random(7), accounts, 300)
    balance, _ = _model(plan)
    with running(_runtime(kafka_config, agg, state_dir)) as r, CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        _send(c, plan)
    store = state_dir / agg.name / "0"
    if damage == "deleted":
        shutil.rmtree(store)
    elif damage == "garbage":  # the file overwritten: LMDB cannot open it
        data = store / "data.mdb"
        data.write_bytes(random.Random(1).randbytes(data.stat().st_size))
    elif damage in ("bad_record", "ahead"):  # one record's bytes changed; the offset past the committed events
        env = lmdb.open(str(store))
        with env.begin(write=True) as txn:
            if damage == "bad_record":
                key = local.state_key(accounts[3])
                value = bytearray(txn.get(key))
                value[-2] ^= 0x01
                txn.put(key, bytes(value))
            else:
                meta = orjson.loads(txn.get(local.META)[4:])
                txn.put(local.META, local._sealed(orjson.dumps({**meta, "offset": meta["offset"] + 1000})))
        env.close()
    if damage == "bad_record":  # the open reads the meta record only: the damage is found by the first read of it
        with running(_runtime(kafka_config, agg, state_dir, "i2")) as r:
            wait_for(lambda: r.runtime.ready, what="runtime live on the damaged store", timeout=45)
            assert r.runtime.gates[0].start > 0  # trusted at the open
            with pytest.raises(FatalError, match="damaged"):
                r.runtime.get(accounts[3])
            wait_for(lambda: bool(r.error), what="the runtime stopping on the damaged store")
        assert isinstance(r.error[0], FatalError) and "damaged" in str(r.error[0])
    with running(_runtime(kafka_config, agg, state_dir, "i2")) as r, CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live again", timeout=45)
        gate = r.runtime.gates[0]
        replayed = gate.events_replayed
        got = {a: r.runtime.get(a) for a in accounts}
        more = c.send(c.command(accounts[0], "Deposit", {"amount": 1}))
    assert {a: g[0].balance for a, g in got.items() if g is not None} == balance
    assert more is not None and more.accepted
    if damage == "trusted":
        assert replayed == 0 and gate.start > 0
    else:
        assert gate.start == 0 and replayed > len(accounts)
    assert scans == []


def test_a_new_host_fills_its_store_from_snapshots_and_a_restart_skips_them(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, scans: list[set[str]]) -> None:
    """An empty store (a new host) restores from the snapshot topic + tail and fills the store from it; the next
    restart on that host trusts the store and reads no snapshot."""
    agg = dataclasses.replace(bank_config(unique), cache_max_aggregates=5)
    create_topics(kafka_config, agg)
    accounts = [f"acc-{i:03d}" for i in range(40)]
    plan = _plan(random.Random(9), accounts, 200)
    more = _plan(random.Random(10), accounts, 100)[len(accounts):]  # no OpenAccount
    balance, _ = _model(plan + more)
    with running(_runtime(kafka_config, agg, tmp_path / "old-host")) as r, CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        _send(c, plan)
        run_local(kafka_config, agg, Domain.load(agg, [str(BANK)]), [0])  # a snapshot, then a tail after it
        _send(c, more)
    new_host = tmp_path / "new-host"
    first = CountingRestorer(kafka_config, agg, bank_domain(agg))
    with running(_runtime(kafka_config, agg, new_host, "i2", first)) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live on the new host", timeout=45)
        gate = r.runtime.gates[0]
        assert first.calls == 1 and gate.snapshot_version is not None and gate.start > 0
    again = CountingRestorer(kafka_config, agg, bank_domain(agg))
    with running(_runtime(kafka_config, agg, new_host, "i2", again)) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live after a restart", timeout=45)
        got = {a: r.runtime.get(a) for a in accounts}
        gate = r.runtime.gates[0]
    assert again.calls == 0 and gate.snapshot_version is None and gate.events_replayed == 0
    assert {a: g[0].balance for a, g in got.items() if g is not None} == balance
    assert all(g is not None and g[2] in ("store", "memory") for g in got.values())
    assert scans == []


@pytest.mark.parametrize("damage", ["trusted", "results_ahead"])
def test_a_trusted_restart_reads_only_the_results_tail_and_answers_retries_from_the_store(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, damage: str, scans: list[set[str]]) -> None:
    """The store records the results offset its window reflects: a restart on it reads none of the results
    before that offset (the runtime's `recovery_results_read`), yet a command id retried after the restart, its
    result before the offset, gets its first outcome back (a rejection: known from its result only). A store whose
    results offset lies past the committed results is not trusted: rebuilt, with the whole window read."""
    agg = dataclasses.replace(bank_config(unique), cache_max_aggregates=5)
    create_topics(kafka_config, agg)
    state_dir = tmp_path / "state"
    accounts = [f"acc-{i:03d}" for i in range(30)]
    plan = _plan(random.Random(11), accounts, 200)
    with running(_runtime(kafka_config, agg, state_dir)) as r, CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        _send(c, plan)
        refused = c.send(c.command(accounts[0], "Withdraw", {"amount": 10**9}, command_id="wd-big"))
        deposit = c.send(c.command(accounts[1], "Deposit", {"amount": 3}, command_id="dep-3"))
        _send(c, [(a, "Deposit", 1) for a in accounts[2:]])  # later results: the two above lie well before the end
        assert r.runtime.counts["recovery_results_read"] == 0  # an empty topic when it started
    assert refused is not None and not refused.accepted and deposit is not None and deposit.accepted
    written = len(plan) + 2 + len(accounts) - 2
    store = state_dir / agg.name / "0"
    env = lmdb.open(str(store))
    with env.begin(write=True) as txn:
        meta = orjson.loads(txn.get(local.META)[4:])
        if damage == "results_ahead":
            txn.put(local.META, local._sealed(orjson.dumps({**meta, "results": meta["results"] + 1000})))
    env.close()
    records = read_all(kafka_config, agg.topic("results"))
    assert len(records) == written  # one partition: one result per command
    # every result is reflected (offsets count the transactions' commit markers too)
    assert meta["results"] == max(m.offset() for m in records) + 1
    with running(_runtime(kafka_config, agg, state_dir, "i2")) as r, CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live again", timeout=45)
        refused_again = c.send(c.command(accounts[0], "Withdraw", {"amount": 10**9}, command_id="wd-big"))
        deposit_again = c.send(c.command(accounts[1], "Deposit", {"amount": 3}, command_id="dep-3"))
        read, gate = r.runtime.counts["recovery_results_read"], r.runtime.gates[0]
    if damage == "trusted":
        assert gate.start > 0 and read == 0  # the results tail past the recorded offset is empty
    else:
        assert gate.start == 0 and read == written  # rebuilt: the whole window's results read
    assert refused_again is not None and refused_again.duplicate and not refused_again.accepted
    assert refused_again.reason == refused.reason and refused_again.version == refused.version
    assert deposit_again is not None and deposit_again.duplicate
    assert (deposit_again.version, deposit_again.event_ids) == (deposit.version, deposit.event_ids)
    assert scans == []


def test_ids_dropped_from_memory_during_a_replay_reach_the_store(kafka_config: KafkaConfig, unique: str,
                                                                  tmp_path: Path, scans: list[set[str]]) -> None:
    """A new host replays a history with idempotency_max_ids of 1: nearly every id leaves memory before its gate's
    seal records an offset past its events. After a restart on that store (trusted: nothing replayed), each of those
    ids, acceptances and a rejection alike, retried gets its first outcome back and writes nothing."""
    agg = dataclasses.replace(bank_config(unique), cache_max_aggregates=50, idempotency_max_ids=1)
    create_topics(kafka_config, agg)
    accounts = [f"acc-{i:02d}" for i in range(10)]
    with running(_runtime(kafka_config, agg, tmp_path / "old-host")) as r, CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        _send(c, [(a, "OpenAccount", 0) for a in accounts])
        deposits = [c.command(a, "Deposit", {"amount": 7}, command_id=f"dep-{a}") for a in accounts]
        first = c.send_many(deposits, timeout=60)
        refused = c.send(c.command(accounts[0], "Withdraw", {"amount": 10**9}, command_id="wd-big"))
    new_host = tmp_path / "new-host"
    with running(_runtime(kafka_config, agg, new_host, "i2")) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live on the new host", timeout=45)
        assert r.runtime.gates[0].start == 0 and r.runtime.store.window.dropped_early > len(accounts)
    with running(_runtime(kafka_config, agg, new_host, "i2")) as r, CommandClient(kafka_config, agg) as c:
        wait_for(lambda: r.runtime.ready, what="runtime live after a restart", timeout=45)
        assert r.runtime.gates[0].events_replayed == 0 and r.runtime.gates[0].start > 0
        again = c.send_many([c.command(a, "Deposit", {"amount": 7}, command_id=f"dep-{a}") for a in accounts],
                            timeout=60)
        refused_again = c.send(c.command(accounts[0], "Withdraw", {"amount": 10**9}, command_id="wd-big"))
    for a in accounts:
        got, was = again[f"dep-{a}"], first[f"dep-{a}"]
        assert got is not None and was is not None
        assert got.duplicate and (got.version, got.event_ids) == (was.version, was.event_ids), a
    assert refused is not None and refused_again is not None
    assert refused_again.duplicate and refused_again.reason == refused.reason
    assert all(e["version"] <= 2 for e in events(kafka_config, agg))  # one OpenAccount and one deposit each
    assert len(events(kafka_config, agg)) == 2 * len(accounts)
    assert scans == []
