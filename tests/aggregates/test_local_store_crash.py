"""kill -9 around the transaction commit with a local state store, for a domain of datetimes, tuples and Decimals
(tests/aggregates/cart_domain.py): the restarted runtime trusts the store only up to the committed events it
records, replays the tail past it, decides every command once, and ends with the state and the idempotency window of
a full replay (the window's outcomes from the store up to its results offset, the rest from the tails)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kafold.client import CommandClient
from kafold.config import DaemonConfig, KafkaConfig
from kafold.daemon.aggregates import AggregateRuntime, recovery
from kafold.daemon.aggregates.store import StateStore
from kafold.daemon.aggregates.window import unpack
from kafold.domain import AggregateDomain
from tests.aggregates.agg_support import create_topics, results, running
from tests.aggregates.local_proc import cart_config
from tests.support import child_env, wait_for

T0 = datetime(2024, 5, 1, 12, tzinfo=UTC)
CARTS = 30
# (where the child kills itself, at which batch): after a commit before its store write (the store lags), before a
# commit (the batch aborts; the store holds the batch before), and after a commit again
CRASHES = [("after_commit", 4), ("before_commit", 3), ("after_commit", 2)]


def _plan(rng: random.Random) -> list[tuple[str, str, dict[str, Any]]]:
    carts = [f"cart-{i:02d}" for i in range(CARTS)]
    plan: list[tuple[str, str, dict[str, Any]]] = [
        (c, "OpenCart", {"at": (T0 + timedelta(minutes=i)).isoformat()}) for i, c in enumerate(carts)]
    for i in range(330):
        c = rng.choice(carts)
        if i % 37 == 36:
            plan.append((c, "CheckOut", {"at": (T0 + timedelta(hours=rng.choice((1, 60)))).isoformat()}))
        else:
            lines = [{"sku": f"sku-{rng.randrange(99)}", "price": f"{rng.randint(1, 99999) / 100:.2f}"}
                     for _ in range(rng.randint(1, 3))]
            if i % 7 == 3:  # rejected ("nothing to add"): an outcome known from its result only, in every batch
                lines = []
            plan.append((c, "AddItems", {"lines": lines, **({"note": "gift"} if i % 5 == 0 else {})}))
    return plan


def _outcome(runtime: AggregateRuntime, aggregate_id: str, command_id: str) -> Any:
    """The runtime's outcome of `command_id`: from memory, else from its partition's local store."""
    entry = runtime.store.entries.get(aggregate_id)
    if entry is not None and command_id in entry.recent:
        return unpack(entry.recent[command_id])
    assert runtime.local is not None
    for n in list(runtime.gates):
        found = runtime.local.outcome(n, aggregate_id, command_id)
        if found is not None:
            return unpack(found)
    return None


def _child(kafka: KafkaConfig, name: str, state_dir: Path, point: str, nth: int, log: Any) -> Any:
    return subprocess.Popen([sys.executable, "-m", "tests.aggregates.local_proc", kafka.bootstrap_servers, name,
                             str(state_dir), point, str(nth)], stdout=log, stderr=log, env=child_env())


@pytest.mark.apache_kafka
@pytest.mark.timeout(180)
def test_kill_around_the_commit_never_trusts_the_store_past_committed_events(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, broker_kind: str) -> None:
    if broker_kind != "kafka":
        pytest.skip("tansu returns aborted transactions' records to read_committed readers (KAFOLD_TEST_BROKER=kafka)")
    agg = cart_config(unique)
    create_topics(kafka_config, agg)
    state_dir = tmp_path / "state"
    rng = random.Random(56)
    plan = _plan(rng)
    logfile = tmp_path / "runtime.log"
    with CommandClient(kafka_config, agg) as client, logfile.open("ab") as log:
        cmds = [client.command(a, k, d) for a, k, d in plan]
        client.send_many(cmds, wait=False)
        for point, nth in CRASHES:
            proc = _child(kafka_config, agg.name, state_dir, point, nth, log)
            assert proc.wait(60) == -9, f"the child did not reach its crash point {point} #{nth}"
        retried = rng.sample(cmds, 20)  # a client retrying on a timeout, with the same ids
        client.send_many(retried, wait=False)
        proc = _child(kafka_config, agg.name, state_dir, "none", 0, log)
        try:
            wait_for(lambda: len(results(kafka_config, agg)) >= len(cmds) + len(retried), timeout=60,
                     what="every command and retry answered")
        finally:
            proc.kill()
            proc.wait()
    got: dict[str, list[dict[str, Any]]] = {}
    for r in results(kafka_config, agg):
        got.setdefault(r["command_id"], []).append(r)
    for c in cmds:  # one decision per command id; a retry repeats it
        firsts = [r for r in got[c.command_id] if not r["duplicate"]]
        assert len(firsts) == 1, got[c.command_id]
        assert all((r["status"], r["version"], r["event_ids"]) == (firsts[0]["status"], firsts[0]["version"],
                                                                   firsts[0]["event_ids"]) for r in got[c.command_id])
    lines = [json.loads(x) for x in logfile.read_text().splitlines() if x.startswith("{")]
    trusted = [x for x in lines if x.get("event") == "aggregate.local_store_trusted"]
    assert any(x["tail"] > 0 for x in trusted), "no restart trusted a store that lagged the events"

    # the state a restart on the same directory decides on (store + tail) equals a full replay of the events
    domain = AggregateDomain.load(agg)
    daemon = DaemonConfig(group_prefix="kt", state_dir=str(state_dir))
    with running(AggregateRuntime(kafka_config, daemon, agg, domain, instance_id="crash")) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live", timeout=45)
        assert all(g.start > 0 for g in r.runtime.gates.values()), "the store was not trusted"
        live = {c: r.runtime.get(c) for c in {a for a, _, _ in plan}}
        # LIVE once its commands resumed (gate.py); their position is known once the committed offset was read
        wait_for(lambda: set(r.runtime.positions) >= set(r.runtime.gates), timeout=30, what="commands resumed")
        decided = {c.command_id: _outcome(r.runtime, c.aggregate_id, c.command_id) for c in cmds}
    replay: dict[str, Any] = {}
    reader = recovery.reader(kafka_config, agg.name)
    try:
        for n in range(agg.partitions):  # a full replay of each events and results partition, every cart's key
            states = StateStore(10**6)
            recovery.reload(reader, agg.topic("events"), domain, states, n, set(live), results=agg.topic("results"))
            replay.update({aid: e for aid, e in states.entries.items() if e.version > 0 or e.recent})
    finally:
        reader.close()
    for cart, found in live.items():
        entry = replay.get(cart)
        assert found is not None and entry is not None
        assert (found[0], found[1]) == (entry.state, entry.version), cart
    for c in cmds:  # the window: every command id's first outcome, as a full replay of events + results knows it
        seen = replay[c.aggregate_id].recent.get(c.command_id)
        assert seen is not None and decided[c.command_id] == unpack(seen), c.command_id
    assert any(x[0].total > 0 and x[0].last is not None for x in live.values() if x)
