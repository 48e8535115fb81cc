"""The catch-up gate on the real broker: no command is decided before the events backlog is replayed."""

from __future__ import annotations

import threading

import pytest

from kafold.client import CommandClient
from kafold.config import KafkaConfig
from kafold.daemon.aggregates.gate import RECOVERING
from tests.aggregates.agg_support import bank_config, create_topics, produce_history, results, running, runtime
from tests.support import wait_for

ACCOUNTS, PER_ACCOUNT = 500, 100  # a 50k-event backlog in one partition


@pytest.mark.apache_kafka
def test_no_command_is_decided_before_the_backlog_is_replayed(kafka_config: KafkaConfig, unique: str,
                                                              broker_kind: str) -> None:
    """Each command withdraws an account's full balance with expected_version = its backlog version: a gate that
    opened before the replay reached the true end would decide on a partial state and reject or misnumber it.
    The true end is counted by the test (50k records from a non-transactional producer = offsets 0..49999), not
    taken from ListOffsets, which under-reports on the embedded broker (docs/brokers.md); on Apache Kafka the end
    the gate captured at assignment (ListOffsets) must be that exact end."""
    agg = bank_config(unique, partitions=1)
    create_topics(kafka_config, agg)
    accounts = [f"acc-{i:04d}" for i in range(ACCOUNTS)]
    balances = produce_history(kafka_config, agg, accounts, PER_ACCOUNT)
    true_end = ACCOUNTS * PER_ACCOUNT
    client = CommandClient(kafka_config, agg)
    cmds = [client.command(a, "Withdraw", {"amount": balances[a]}, expected_version=PER_ACCOUNT)
            for a in accounts]
    early, late = cmds[:200], cmds[200:]
    client.send_many(early, wait=False)  # queued before the runtime starts
    rt = runtime(kafka_config, agg)
    sent_while_recovering: list[bool] = []
    with running(rt) as r:
        wait_for(lambda: 0 in rt.gates, what="partition assigned")

        def send_late() -> None:
            sent_while_recovering.append(rt.gates[0].phase == RECOVERING)
            with CommandClient(kafka_config, agg) as c2:
                c2.send_many(late, wait=False)

        sender = threading.Thread(target=send_late)
        sender.start()
        sender.join(60)
        wait_for(lambda: rt.counts["commands"] >= len(cmds), timeout=60, what="all commands processed")
        gate = rt.gates[0]
        assert r.error == []
    client.close()
    assert gate.live and gate.decided_while_recovering == 0
    assert gate.events_replayed == true_end and gate.position >= true_end
    assert gate.eof_at is not None and gate.eof_at >= true_end
    if broker_kind == "kafka":
        assert gate.captured_end == true_end
    got = results(kafka_config, agg)
    assert [res["command_id"] for res in got] == [c.command_id for c in cmds]  # once each, in order
    assert all(res["status"] == "accepted" for res in got), [res for res in got if res["status"] != "accepted"][:3]
    assert {res["version"] for res in got} == {PER_ACCOUNT + 1}
    assert sent_while_recovering, "the late commands were not sent"
