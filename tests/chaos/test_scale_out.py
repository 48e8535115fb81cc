"""Scale-out on real consumer groups: three `kafold daemon` instances on one config share the connectors' groups and
the aggregate's partitions while traffic flows — joining, one leaving gracefully and coming back, then a rolling
restart (each killed -9 and started again, one by one); afterwards nothing is lost or applied twice. Once per
consumer group protocol ([kafka] group_protocol): classic, and KIP-848's consumer protocol (incremental
rebalances, the member epoch moving under commits)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import ConsumerGroupType, KafkaException
from confluent_kafka.admin import AdminClient

from kafold import kafka_clients
from tests.chaos.chaos_harness import Chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.apache_kafka]

GROUPS = ("chaos.items", "chaos.accounts", "chaos.hooks", "chaos.aggregate.account")


def _members(chaos: Chaos) -> dict[str, int]:
    """Per group, how many members hold at least one partition."""
    admin = AdminClient(kafka_clients.librdkafka(chaos.stack.kafka))
    out = {}
    for group, fut in admin.describe_consumer_groups(list(GROUPS), request_timeout=15).items():
        try:
            desc = fut.result()
        except KafkaException:  # not formed yet, or its coordinator loading: asked again
            out[group] = -1
            continue
        out[group] = sum(1 for m in desc.members if m.assignment and m.assignment.topic_partitions)
    return out


def _group_types(chaos: Chaos) -> dict[str, str]:
    """Per group, the protocol the broker sees it speak (CLASSIC or CONSUMER)."""
    admin = AdminClient(kafka_clients.librdkafka(chaos.stack.kafka))
    return {group: ConsumerGroupType(fut.result().type).name
            for group, fut in admin.describe_consumer_groups(list(GROUPS), request_timeout=15).items()}


def _wait_members(chaos: Chaos, want: int, timeout: float = 120.0) -> dict[str, int]:
    """Until every group has `want` members holding partitions (bounded): the instances really share the work."""
    deadline = time.monotonic() + timeout
    got: dict[str, int] = {}
    while time.monotonic() < deadline:
        got = _members(chaos)
        if all(got.get(g) == want for g in GROUPS):
            return got
        time.sleep(1.0)
    raise AssertionError(f"groups did not reach {want} members with partitions in {timeout:.0f}s: {got}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
def test_three_instances_join_leave_and_roll_while_traffic_flows(tmp_path: Path, broker_kind: str,
                                                                 group_protocol: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if broker_kind != "kafka":
        pytest.skip("tansu stalls a consumer group's rebalance once it has two members (docs/brokers.md): "
                    "several instances in one group run on Apache Kafka only")
    # [kafka] group_protocol of every daemon started below (each inherits this environment)
    monkeypatch.setenv("KAFOLD_KAFKA__GROUP_PROTOCOL", group_protocol)
    chaos = Chaos(tmp_path, seed=41, spark=False, broker="kafka", nodes=1, kinds=())
    try:
        first, second, third = chaos.daemon, chaos.add_daemon(), chaos.add_daemon()
        with chaos.loading(items_per_s=200, commands_per_s=20):
            first.start()
            _wait_members(chaos, 1)
            second.start()  # joining while traffic flows
            third.start()
            _wait_members(chaos, 3)
            types = _group_types(chaos)  # the opt-in really reached the groups
            second.stop()  # leaving gracefully: its partitions move to the other two
            _wait_members(chaos, 2)
            second.start()
            _wait_members(chaos, 3)
            for d in (first, second, third):  # a rolling restart, each instance killed -9
                d.restart9()
                time.sleep(3.0)
            _wait_members(chaos, 3)
        report = chaos.check(settle_timeout=240)
        order = chaos.order_violations()
        strict = chaos.strict_violations()
    finally:
        chaos.close()
    print(report.text())
    assert types == dict.fromkeys(GROUPS, group_protocol.upper()), types
    assert report.events > 2_000 and report.commands > 200, report.text()
    assert report.violations == [], report.text()
    assert order == [], order
    assert strict == [], strict
    assert [e for d in (first, second, third) for e in d.exits] == [], report.text()
