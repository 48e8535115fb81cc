"""The aggregate runtime on the real broker: request/reply, expected_version, idempotency, bad input."""

from __future__ import annotations

import threading
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from structlog.testing import capture_logs

from kafold.client import CommandClient
from kafold.config import KafkaConfig
from kafold.connectors.dlq import H_REASON
from kafold.daemon.aggregates import AggregateRuntime, dlq_topic
from kafold.errors import RetriableError
from tests.aggregates.agg_support import (
    DAEMON,
    Running,
    bank_config,
    bank_domain,
    committed_state,
    create_topics,
    events,
    read_all,
    results,
    running,
    runtime,
)
from tests.support import wait_for


def test_commands_yield_events_and_results_with_consecutive_versions(kafka_config: KafkaConfig,
                                                                     unique: str) -> None:
    agg = bank_config(unique, partitions=2)
    create_topics(kafka_config, agg)
    with running(runtime(kafka_config, agg)) as r, CommandClient(kafka_config, agg) as client:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        opened = client.send(client.command("acc-1", "OpenAccount", {"owner": "ann"}))
        deposit = client.send(client.command("acc-1", "Deposit", {"amount": 500}))
        too_much = client.send(client.command("acc-1", "Withdraw", {"amount": 900}))
        assert opened is not None and deposit is not None and too_much is not None
        assert (opened.status, opened.version) == ("accepted", 1)
        assert (deposit.status, deposit.version, len(deposit.event_ids)) == ("accepted", 2, 1)
        assert too_much.status == "rejected" and "insufficient funds" in (too_much.reason or "")
        assert too_much.version == 2 and too_much.event_ids == ()
        state = committed_state(r.runtime, "acc-1", 2)
        assert (state.status, state.balance) == ("open", 500)
    evs = events(kafka_config, agg)
    assert [(e["version"], e["type"]) for e in evs] == [(1, "AccountOpened"), (2, "MoneyDeposited")]
    assert [e["event_id"] for e in evs] == [*opened.event_ids, *deposit.event_ids]
    assert {e["causation_id"] for e in evs} == {opened.command_id, deposit.command_id}


def test_resent_command_id_applies_once(kafka_config: KafkaConfig, unique: str) -> None:
    agg = bank_config(unique)
    create_topics(kafka_config, agg)
    with running(runtime(kafka_config, agg)) as r, CommandClient(kafka_config, agg) as client:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        client.send(client.command("a", "OpenAccount", {"owner": "x"}))
        cmd = client.command("a", "Deposit", {"amount": 7}, command_id="dep-1")
        first, again = client.send(cmd), client.send(cmd)
        assert first is not None and again is not None
        assert again.duplicate and again.event_ids == first.event_ids and again.version == first.version == 2
    assert [e["version"] for e in events(kafka_config, agg)] == [1, 2]


def test_concurrent_expected_version_exactly_one_wins_per_version(kafka_config: KafkaConfig, unique: str) -> None:
    agg = bank_config(unique)
    create_topics(kafka_config, agg)
    rounds, contenders = 5, 4
    with running(runtime(kafka_config, agg)) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        with CommandClient(kafka_config, agg) as c:
            c.send(c.command("acc", "OpenAccount", {"owner": "x"}, expected_version=0))
        clients = [CommandClient(kafka_config, agg) for _ in range(contenders)]
        winners = []
        for version in range(1, rounds + 1):
            got: list = []
            barrier = threading.Barrier(contenders)

            def contend(cl: CommandClient, v: int, b: threading.Barrier, out: list) -> None:
                b.wait()
                out.append(cl.send(cl.command("acc", "Deposit", {"amount": 1}, expected_version=v)))

            threads = [threading.Thread(target=contend, args=(cl, version, barrier, got)) for cl in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            accepted = [g for g in got if g.status == "accepted"]
            assert len(got) == contenders and len(accepted) == 1, got
            assert all("expected version" in (g.reason or "") for g in got if g.status == "rejected")
            winners.append(accepted[0].version)
        for cl in clients:
            cl.close()
    assert winners == list(range(2, rounds + 2))
    assert [e["version"] for e in events(kafka_config, agg)] == list(range(1, rounds + 2))


def test_bad_commands_are_rejected_and_dead_lettered_and_the_rest_flows(kafka_config: KafkaConfig,
                                                                        unique: str) -> None:
    agg = bank_config(unique)
    create_topics(kafka_config, agg)
    p = Producer({"bootstrap.servers": kafka_config.bootstrap_servers})
    bad = [
        (b"acc", b"{not json", [("kafold-command-id", b"bad-json")]),
        (b"acc", b'{"command_id": "unknown-type", "type": "Teleport", "aggregate_id": "acc", "data": {}}', []),
        (b"acc", b'{"command_id": "bad-field", "type": "Deposit", "aggregate_id": "acc", "data": {"amount": "x"}}',
         []),
        (b"acc", b'{"command_id": "extra", "type": "Deposit", "aggregate_id": "acc", "data": {"amt": 1}}', []),
    ]
    with running(runtime(kafka_config, agg)) as r, CommandClient(kafka_config, agg) as client:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        client.send(client.command("acc", "OpenAccount", {"owner": "x"}))
        for key, value, headers in bad:
            p.produce(agg.topic("commands"), key=key, value=value, headers=headers, partition=0)
        p.flush(10)
        after = client.send(client.command("acc", "Deposit", {"amount": 3}))
        assert after is not None and after.status == "accepted" and after.version == 2
        assert r.runtime.error is None
    by_id = {res["command_id"]: res for res in results(kafka_config, agg)}
    for cid in ("bad-json", "unknown-type", "bad-field", "extra"):
        assert by_id[cid]["status"] == "rejected", cid
    assert "unknown command type 'Teleport'" in by_id["unknown-type"]["reason"]
    assert "'amount'" in by_id["bad-field"]["reason"] and "'amt'" in by_id["extra"]["reason"]
    dead = read_all(kafka_config, dlq_topic(agg))
    reasons = sorted(dict(m.headers())[H_REASON].decode() for m in dead)
    assert reasons == ["bad-json", "invalid-command", "invalid-command", "unknown-type"]
    assert [e["version"] for e in events(kafka_config, agg)] == [1, 2]


class _CommittedTimesOut:
    """The runtime's commands consumer, except that its first committed() lookup times out (as it does while
    the broker is paused): a lookup that times out is asked again, it does not stop the daemon."""

    def __init__(self, consumer: Any) -> None:
        self._consumer, self.failed = consumer, 0

    def committed(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            self.failed += 1
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to get committed offsets (test)"))
        return self._consumer.committed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


class _FlakyLookupRuntime(AggregateRuntime):
    def _start(self) -> None:
        super()._start()
        self.consumer = _CommittedTimesOut(self.consumer)


def _serve_one_command(kafka_config: KafkaConfig, unique: str, runtime_class: type[AggregateRuntime]
                       ) -> tuple[AggregateRuntime, Running, Any, list[Any]]:
    """Run `runtime_class` on a fresh aggregate until it serves one OpenAccount; (runtime, run, result, logs)."""
    agg = bank_config(unique)
    create_topics(kafka_config, agg)
    with capture_logs() as logs:
        rt = runtime_class(kafka_config, DAEMON, agg, bank_domain(agg), instance_id="i1")
        with running(rt) as r, CommandClient(kafka_config, agg) as client:
            wait_for(lambda: r.runtime.ready, what="runtime live")
            opened = client.send(client.command("acc-1", "OpenAccount", {"owner": "ann"}))
    return rt, r, opened, logs


def test_a_committed_offset_lookup_that_times_out_does_not_stop_the_runtime(kafka_config: KafkaConfig,
                                                                           unique: str) -> None:
    rt, r, opened, logs = _serve_one_command(kafka_config, unique, _FlakyLookupRuntime)
    assert opened is not None and (opened.status, opened.version) == ("accepted", 1)
    assert r.error == [] and r.runtime.error is None
    assert isinstance(rt.consumer, _CommittedTimesOut) and rt.consumer.failed == 1
    assert [e for e in logs if e["event"] == "aggregate.committed_offset_unavailable"]


class _FlakyRestoreRuntime(AggregateRuntime):
    """The first restore on assignment fails as it does while the broker is paused (ListOffsets times out)."""

    failures = 0

    def _restore(self, events: str, n: int) -> Any:
        if not self.failures:
            self.failures += 1
            raise RetriableError(f"{events}[{n}]: cannot list offsets: timed out (test)")
        return super()._restore(events, n)


def test_a_restore_that_fails_retriably_on_assignment_is_retried(kafka_config: KafkaConfig, unique: str) -> None:
    rt, r, opened, logs = _serve_one_command(kafka_config, unique, _FlakyRestoreRuntime)
    assert opened is not None and opened.status == "accepted"
    assert r.error == [] and rt.error is None and isinstance(rt, _FlakyRestoreRuntime) and rt.failures == 1
    assert [e for e in logs if e["event"] == "aggregate.restore_retrying"]
