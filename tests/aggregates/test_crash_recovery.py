"""kill -9 of the runtime process at random points, with clients retrying earlier command ids meanwhile: each
command decided once (its retries repeat that outcome), no duplicate events."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from kafold.client import CommandClient
from kafold.config import KafkaConfig
from tests.aggregates.agg_support import bank_config, create_topics, events, fold_balances, results
from tests.support import child_env

ACCOUNTS, COMMANDS, KILLS = 100, 10_000, 20


def _model(cmds: list[tuple[str, str, int]]) -> tuple[dict[str, int], dict[int, bool]]:
    """The independent expectation: balances, and whether each command (by index) is accepted."""
    balance: dict[str, int] = {}
    accepted: dict[int, bool] = {}
    for i, (aid, kind, amount) in enumerate(cmds):
        if kind == "OpenAccount":
            ok = aid not in balance
            balance.setdefault(aid, 0)
        elif kind == "Deposit":
            ok = True
            balance[aid] += amount
        else:
            ok = amount <= balance[aid]
            balance[aid] -= amount if ok else 0
        accepted[i] = ok
    return balance, accepted


@pytest.mark.slow
@pytest.mark.apache_kafka
def test_kill_minus_nine_at_random_points(kafka_config: KafkaConfig, unique: str, tmp_path: Path,
                                          broker_kind: str) -> None:
    """Asserted with Apache Kafka's semantics, exactly one decision per command. Broker quirk (tansu): its
    read_committed readers see the records of aborted transactions, so a batch cut by a kill stays visible and the
    restarted runtime may decide some of its commands again; the guarantee cannot hold there."""
    if broker_kind != "kafka":
        pytest.skip("tansu returns aborted transactions' records to read_committed readers (KAFOLD_TEST_BROKER=kafka)")
    agg = bank_config(unique, partitions=2)
    create_topics(kafka_config, agg)
    rng = random.Random(5)
    rng_retry = random.Random(6)
    accounts = [f"acc-{i:03d}" for i in range(ACCOUNTS)]
    plan = [(a, "OpenAccount", 0) for a in accounts]
    while len(plan) < COMMANDS:
        plan.append((rng.choice(accounts), rng.choice(("Deposit", "Withdraw")), rng.randint(1, 100)))
    client = CommandClient(kafka_config, agg)
    cmds = [client.command(aid, kind, {"owner": aid} if kind == "OpenAccount" else {"amount": amount})
            for aid, kind, amount in plan]

    retries: list[int] = []  # indexes of commands sent again with the same id, as a client does on a timeout

    def send() -> None:  # spread the commands over the kills
        for i in range(0, len(cmds), 125):
            again = [rng_retry.randrange(i) for _ in range(10)] if i else []
            retries.extend(again)
            client.send_many(cmds[i:i + 125] + [cmds[j] for j in again], wait=False)
            time.sleep(0.9)

    sender = threading.Thread(target=send)
    sender.start()
    log = (tmp_path / "runtime.log").open("ab")
    argv = [sys.executable, "-m", "tests.aggregates.agg_proc", kafka_config.bootstrap_servers, agg.name, "2", "crash"]
    kills = 0
    deadline = time.monotonic() + 240
    try:
        while kills < KILLS:
            proc = subprocess.Popen(argv, stdout=log, stderr=log, env=child_env())
            time.sleep(rng.uniform(2.0, 6.0))  # before, during or after the group join and recovery
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            assert time.monotonic() < deadline, f"only {kills} kills in time"
        sender.join(120)
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env=child_env())
        try:
            want = len(cmds) + len(retries)
            while len(results(kafka_config, agg)) < want and time.monotonic() < deadline:
                time.sleep(1)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    finally:
        client.close()
        log.close()
    got = results(kafka_config, agg)
    by_id: dict[str, list[dict]] = {}
    for r in got:
        by_id.setdefault(r["command_id"], []).append(r)
    assert kills >= KILLS
    assert set(by_id) == {c.command_id for c in cmds}, "a command has no result"
    sends = Counter(c.command_id for c in cmds) + Counter(cmds[j].command_id for j in retries)
    assert all(len(by_id[cid]) >= n for cid, n in sends.items()), "a retry has no result"
    evs = events(kafka_config, agg)
    balances, accepted = _model(plan)
    _assert_exactly_once(plan, cmds, by_id, evs, balances, accepted, sends)


def _assert_consistent_events(evs: list[dict]) -> dict[str, int]:
    """Versions consecutive per aggregate, no event twice; the folded balances."""
    versions: dict[str, list[int]] = {}
    for e in evs:
        versions.setdefault(e["aggregate_id"], []).append(e["version"])
    assert all(v == list(range(1, len(v) + 1)) for v in versions.values()), "versions not consecutive"
    assert len({e["event_id"] for e in evs}) == len(evs)
    return {a: b for a, (_, b, _) in fold_balances(evs).items()}


def _assert_exactly_once(plan: list[tuple[str, str, int]], cmds: list, by_id: dict[str, list[dict]],
                         evs: list[dict], balances: dict[str, int], accepted: dict[int, bool],
                         sends: Counter[str]) -> None:
    """Real Kafka: a batch cut by the kill is aborted and invisible, so every command has exactly one decision
    (one result not a repeat; each retry a repeat of it), the one the model predicts, and the events fold to the
    model's balances."""
    def one_decision(cid: str, rs: list[dict]) -> bool:
        firsts = [r for r in rs if not r["duplicate"]]
        return len(rs) == sends[cid] and len(firsts) == 1 and all(
            (r["status"], r["version"], r["event_ids"]) == (firsts[0]["status"], firsts[0]["version"],
                                                            firsts[0]["event_ids"]) for r in rs)

    assert all(one_decision(cid, rs) for cid, rs in by_id.items()), \
        [rs for cid, rs in by_id.items() if not one_decision(cid, rs)][:3]
    caused_by = {e["event_id"]: e["causation_id"] for e in evs}
    for i, c in enumerate(cmds):
        (r,) = [r for r in by_id[c.command_id] if not r["duplicate"]]
        assert (r["status"] == "accepted") == accepted[i], f"command {i}: {r}"
        if r["status"] == "accepted":
            assert r["event_ids"] and all(caused_by.get(e) == c.command_id for e in r["event_ids"]), r
    assert sorted(caused_by.values()) == sorted(c.command_id for i, c in enumerate(cmds) if accepted[i]), \
        "events without an accepted command, or an accepted command's events twice"
    assert _assert_consistent_events(evs) == balances

