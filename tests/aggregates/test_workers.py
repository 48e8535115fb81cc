"""Aggregate worker processes (`daemon.aggregate_processes`): commands decided exactly once across the workers of
one daemon, a worker killed -9 (its partitions move to the other worker, then it is started again), a second
instance taking partitions over, and reads answered by whichever worker of whichever instance holds the partition."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kafold import config, kafka_clients, topics
from kafold.client import CommandClient
from kafold.config import DaemonConfig, KafkaConfig
from kafold.daemon.aggregates import AggregateWorkers
from kafold.testing import free_port
from tests.aggregates.agg_proc import KAFKA
from tests.aggregates.agg_support import (
    BANK,
    bank_config,
    bank_daemon_toml,
    create_topics,
    events,
    fold_balances,
    results,
)
from tests.aggregates.test_state_routing import (
    INSTANCE_SECRET,
    KAFOLD,
    KEYS,
    SECRET_VAR,
    TOKEN,
    call,
    check,
    read,
    send_commands,
)
from tests.support import child_env, wait_for

PARTITIONS, ACCOUNTS = 4, 40

pytestmark = pytest.mark.apache_kafka


@contextmanager
def hosted(kafka: KafkaConfig, daemon: DaemonConfig, unique: str, instance: str) -> Iterator[AggregateWorkers]:
    workers = AggregateWorkers(kafka, daemon, bank_config(unique, partitions=PARTITIONS), Path("."),
                               instance_id=instance)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            workers.run()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield workers
    finally:
        workers.stop()
        thread.join(60)
        assert not thread.is_alive() and errors == []


def test_workers_decide_exactly_once_across_a_kill_and_a_second_instance(kafka_config: KafkaConfig, unique: str,
                                                                         tmp_path: Path, broker_kind: str) -> None:
    if broker_kind != "kafka":
        pytest.skip("tansu returns aborted transactions' records to read_committed readers (KAFOLD_TEST_BROKER=kafka)")
    kafka = KafkaConfig(bootstrap_servers=kafka_config.bootstrap_servers, **KAFKA)  # type: ignore[arg-type]
    agg = bank_config(unique, partitions=PARTITIONS)
    create_topics(kafka, agg)

    def daemon(n: str) -> DaemonConfig:
        return DaemonConfig(group_prefix="kt", batch_max_records=100, batch_max_wait_ms=20, aggregate_processes=2,
                            python_path=[str(BANK)], state_dir=str(tmp_path / n))

    accounts = [f"acc-{i:03d}" for i in range(ACCOUNTS)]
    sent: list[str] = []
    with CommandClient(kafka, agg) as client, hosted(kafka, daemon("a"), unique, "i1") as first:
        # The workers join in one rebalance, but the first one's report may still show every partition for a moment
        # (the eager protocol revokes them all on the second join): the split is waited for, not sampled once
        wait_for(lambda: first.ready and len(first.gates) == PARTITIONS
                 and {w.index for w in first.owners.values()} == {0, 1},
                 timeout=120, what="the partitions split between the two workers, all live")

        def deposit_round(amount: int) -> None:
            cmds = [client.command(a, "Deposit", {"amount": amount}) for a in accounts]
            sent.extend(c.command_id for c in cmds)
            answered = client.send_many(cmds, timeout=180)
            assert all(r.accepted for r in answered.values()) and len(answered) == len(cmds)

        opened = client.send_many([client.command(a, "OpenAccount", {"owner": a}) for a in accounts], timeout=120)
        assert all(r.accepted and r.version == 1 for r in opened.values())
        sent.extend(opened)
        deposit_round(1)

        victim = first.workers[0]
        killed_pid = victim.pid
        assert killed_pid is not None
        os.kill(killed_pid, signal.SIGKILL)  # kill -9: its open transaction is aborted by its successor
        deposit_round(2)  # decided by the other worker once the group moves the partitions, or by the new process
        wait_for(lambda: victim.restarts == 1 and victim.pid != killed_pid, timeout=60, what="the worker restarted")
        assert first.counts["workers_restarted"] == 1

        with hosted(kafka, daemon("b"), unique, "i2") as second:
            wait_for(lambda: second.ready and first.ready and len(first.gates) + len(second.gates) == PARTITIONS
                     and second.gates, timeout=180, what="the second instance holding partitions")
            deposit_round(4)
            # A read without a version may trail the last result by the moment between the transaction's commit
            # and the worker marking its states committed: each account's fourth version is waited for, then read
            for a in accounts:
                wait_for(lambda a=a: any(g is not None and g[1] == 4 for g in (w.get(a) for w in (first, second))),
                         timeout=30, what=f"{a} at version 4 on the instance holding it")
            for a in accounts:  # read on any instance: the one holding the partition answers, the other does not
                got = [w.get(a) for w in (first, second)]
                held = [g for g in got if g is not None]
                assert len(held) == 1, (a, got)
                state, version, _ = held[0]
                assert version == 4 and state.balance == 7, (a, held)

    answered = Counter(r["command_id"] for r in results(kafka, agg))
    assert set(answered) == set(sent) and set(answered.values()) == {1}, "each command answered once"
    written = events(kafka, agg)
    assert set(Counter(e["event_id"] for e in written).values()) == {1}, "no event written twice"
    by_aggregate: dict[str, list[int]] = {}
    for e in written:
        by_aggregate.setdefault(e["aggregate_id"], []).append(e["version"])
    assert all(v == [1, 2, 3, 4] for v in by_aggregate.values()) and len(by_aggregate) == ACCOUNTS
    assert fold_balances(written) == dict.fromkeys(accounts, ("open", 7, 4))


@pytest.mark.timeout(900)
def test_daemons_with_worker_processes_answer_every_key_on_every_instance(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, broker_kind: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `kafold daemon` processes with `aggregate_processes = 2` each (four workers in the group): /ready, every
    key read on either instance (sent on to the owner's instance, answered by its worker), a read waiting for a
    version, and the commands counted on /metrics across the workers."""
    if broker_kind != "kafka":
        pytest.skip("tansu stalls a consumer group's rebalance once it has two members (docs/brokers.md)")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    monkeypatch.setenv(SECRET_VAR, INSTANCE_SECRET)
    conf = tmp_path / "kafold.toml"
    conf.write_text(bank_daemon_toml(kafka_config, unique, 0, partitions=6, daemon_extra=(
        f'api_token_file = "{token_file}"\nshutdown_grace_s = 5.0\ninstance_secret_env = "{SECRET_VAR}"\n'
        f'aggregate_processes = 2\nstate_dir = "{tmp_path / "state"}"')))
    loaded = config.load_file(conf)
    agg = loaded.config.aggregates[0]
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    admin = AdminClient(kafka_clients.librdkafka(kafka_config))

    def shared() -> bool:
        try:
            if any(call(u + "/ready")[0] != 200 for u in urls):
                return False
        except OSError:
            return False
        group = f"{unique}.aggregate.account"
        try:
            desc = admin.describe_consumer_groups([group], request_timeout=10)[group].result()
        except KafkaException:
            return False
        return sum(1 for m in desc.members if m.assignment and m.assignment.topic_partitions) == 4

    try:
        for i, port in enumerate(ports):
            env = child_env({"KAFOLD_DAEMON__HTTP_PORT": str(port),
                             "KAFOLD_INSTANCE_ID": f"{unique}-{i}"})  # one state_dir per instance id below
            with open(tmp_path / f"daemon-{i}.log", "ab") as out:
                procs.append(subprocess.Popen([KAFOLD, "--log-format", "json", "daemon", "-c", str(conf)],
                                              stdout=out, stderr=subprocess.STDOUT, env=env))
        wait_for(shared, "two daemons of two workers each sharing the aggregate's partitions", 240)
        expected = send_commands(kafka_config, agg)
        owner: dict[str, str] = {}
        for url in urls:
            for key in KEYS:
                status, body, _, _ = read(f"{url}/aggregates/account/{key}", follow=False, tries_503=30)
                assert status == 200, (url, key, status, body)
                check(body, key, expected)
                assert owner.setdefault(key, body["served_by"]) == body["served_by"]
        assert set(owner.values()) == set(urls)
        key = KEYS[0]
        with CommandClient(kafka_config, agg) as client:
            done = client.send(client.command(key, "Deposit", {"amount": 1}))
        assert done is not None and done.accepted
        away = next(u for u in urls if u != owner[key])
        status, body, _, _ = read(f"{away}/aggregates/account/{key}?min_version={done.version}", follow=False)
        assert status == 200 and body["version"] == done.version, body
        def scraped() -> list[list[str]]:
            pages = []
            for url in urls:
                request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
                with urllib.request.urlopen(request, timeout=30) as resp:
                    pages.append(resp.read().decode().splitlines())
            return pages

        def accepted() -> float:  # each instance counts its own workers' decisions
            return sum(float(line.split()[-1]) for lines in scraped() for line in lines if line.startswith(
                'kafold_aggregate_commands_total{aggregate="account",outcome="accepted"}'))

        # a result is out when its transaction commits, a moment before the worker counts it and reports
        wait_for(lambda: accepted() == len(KEYS) * 3 + 1, timeout=30, what="every accepted command on /metrics")
        assert all(any(line.startswith("kafold_aggregate_local_store_bytes") for line in lines)
                   for lines in scraped())
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(60) for proc in procs]
    assert codes == [0, 0], [(tmp_path / f"daemon-{i}.log").read_text()[-3000:] for i in range(2)]
