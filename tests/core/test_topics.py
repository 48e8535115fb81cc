"""Topic creation and drift reporting against the real broker."""

from __future__ import annotations

import argparse
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from kafold import topics
from kafold.config import KafkaConfig, TopicSpec
from kafold.errors import FatalError, RetriableError
from kafold.tools.commands import topics as topics_cmd
from kafold.topics import ERROR, WARNING, Drift, TopicReport, TopicState


def _admin(kafka: KafkaConfig) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka.bootstrap_servers})


def _create(kafka: KafkaConfig, name: str, partitions: int, configs: dict[str, str] | None = None) -> None:
    admin = _admin(kafka)  # must outlive the futures
    futures = admin.create_topics([NewTopic(name, partitions, 1, config=configs or {})])
    for f in futures.values():
        f.result()


def _broker_view(kafka: KafkaConfig, name: str) -> tuple[int, dict[str, str]]:
    admin = _admin(kafka)
    partitions = len(admin.list_topics(name, timeout=10).topics[name].partitions)
    (fut,) = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, name)]).values()
    return partitions, {k: v.value for k, v in fut.result().items()}


def _aggregate_specs(prefix: str, partitions: int = 3) -> list[TopicSpec]:
    events = f"{prefix}.events"
    return [
        TopicSpec(events, partitions, 1, {}, purpose="events"),
        TopicSpec(f"{prefix}.commands", partitions, 1, {}, events, "commands"),
        TopicSpec(f"{prefix}.snapshots", partitions, 1, {"cleanup.policy": "compact"}, events, "snapshots"),
    ]


def test_ensure_creates_missing_topics_with_partitions_and_configs(
        kafka_config: KafkaConfig, unique: str) -> None:
    specs = _aggregate_specs(unique)
    report = topics.ensure(kafka_config, specs)
    assert sorted(report.created) == sorted(s.name for s in specs)
    assert report.ok and report.drift == []
    for s in specs:
        partitions, configs = _broker_view(kafka_config, s.name)
        assert partitions == s.partitions
        assert configs.get("cleanup.policy", "delete") == s.configs.get("cleanup.policy", "delete")


def test_second_ensure_is_a_no_op(kafka_config: KafkaConfig, unique: str) -> None:
    specs = _aggregate_specs(unique)
    topics.ensure(kafka_config, specs)
    again = topics.ensure(kafka_config, specs)
    assert again.created == []
    assert [t.action for t in again.topics] == ["exists"] * len(specs)
    assert again.ok and again.drift == []


def test_snapshot_topic_that_is_not_compacted_is_an_error_and_left_alone(
        kafka_config: KafkaConfig, unique: str) -> None:
    specs = _aggregate_specs(unique)
    snapshots = specs[2].name
    _create(kafka_config, snapshots, 3, {"cleanup.policy": "delete"})
    report = topics.ensure(kafka_config, specs)
    assert report.errors == [Drift(snapshots, "cleanup.policy", "compact", "delete", ERROR)]
    assert not report.ok
    assert _broker_view(kafka_config, snapshots)[1]["cleanup.policy"] == "delete"  # never altered


def test_partition_mismatch_of_copartitioned_topics_is_an_error(
        kafka_config: KafkaConfig, unique: str) -> None:
    specs = _aggregate_specs(unique, partitions=4)
    events = specs[0].name
    _create(kafka_config, events, 2)  # someone created the events topic by hand, with too few partitions
    report = topics.ensure(kafka_config, specs)
    by_topic = {t.spec.name: t for t in report.topics}
    assert by_topic[events].partitions == 2
    assert Drift(events, "partitions", "4", "2", ERROR) in by_topic[events].drift
    for derived in specs[1:]:  # created as specified (4), so they no longer line up with the events topic
        assert by_topic[derived.name].action == "created"
        assert Drift(derived.name, f"co-partitioning with {events}", "2 partitions", "4", ERROR) \
            in by_topic[derived.name].drift
    assert not report.ok


def test_partition_mismatch_of_a_standalone_topic_is_only_a_warning(
        kafka_config: KafkaConfig, unique: str) -> None:
    name = f"{unique}.audit"
    _create(kafka_config, name, 1)
    report = topics.ensure(kafka_config, [TopicSpec(name, 3, 1, {})])
    assert report.drift == [Drift(name, "partitions", "3", "1", WARNING)]
    assert report.ok


def test_check_reports_missing_topics_without_creating_them(kafka_config: KafkaConfig, unique: str) -> None:
    name = f"{unique}.later"
    report = topics.check(kafka_config, [TopicSpec(name, 1, 1, {})])
    assert [t.action for t in report.topics] == ["missing"] and not report.ok
    assert name not in _admin(kafka_config).list_topics(timeout=10).topics


def test_unreachable_broker_raises_a_retriable_kafold_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topics, "TIMEOUT_S", 1.0)
    with pytest.raises(RetriableError, match=r"127\.0\.0\.1:1"):
        topics.check(KafkaConfig(bootstrap_servers="127.0.0.1:1"), [TopicSpec("x", 1, 1, {})])


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    topics_cmd.register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return int(args.handler(args))


def test_cli_ensure_prints_a_table_and_fails_on_errors(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "kafold.toml"
    cfg.write_text(f"""
[kafka]
bootstrap_servers = "{kafka_config.bootstrap_servers}"

[[aggregates]]
name = "{unique}"
initial = "app:initial"
evolve = "app:evolve"
decide = "app:decide"
partitions = 2
""")
    assert _cli(["topics", "list", "-c", str(cfg)]) == 1  # nothing created yet
    assert "missing" in capsys.readouterr().out
    assert _cli(["topics", "ensure", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"{unique}.snapshots" in out and "created" in out
    # Point the aggregate's snapshot topic at an existing topic that is not compacted.
    snapshots = f"{unique}.other.snapshots"
    _create(kafka_config, snapshots, 2, {"cleanup.policy": "delete"})
    cfg.write_text(cfg.read_text() + f'snapshot_topic = "{snapshots}"\n')
    assert _cli(["topics", "ensure", "-c", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert "ERROR" in out and "cleanup.policy: expected compact, broker has delete" in out
    from kafold.tools import cli  # the whole command line: its logs go to stderr, the document alone to stdout

    assert cli.main(["topics", "list", "-c", str(cfg), "--json"]) == 1
    listed = orjson.loads(capsys.readouterr().out)
    assert listed["ok"] is False
    bad = next(t for t in listed["topics"] if t["name"] == snapshots)
    assert {"what": "cleanup.policy", "expected": "compact", "actual": "delete", "severity": "error"} in bad["drift"]
    assert {t["state"] for t in listed["topics"]} == {"exists"}


def test_table_lists_every_topic_and_each_drift() -> None:
    spec = TopicSpec("a.snapshots", 2, 1, {"cleanup.policy": "compact"}, "a.events", "snapshots")
    report = TopicReport((
        TopicState(TopicSpec("a.events", 2, 1, {}, purpose="events"), 2, "exists"),
        TopicState(spec, 3, "exists", (Drift("a.snapshots", "partitions", "2", "3", ERROR),
                                       Drift("a.snapshots", "cleanup.policy", "compact", "delete", ERROR))),
    ))
    lines = report.table().splitlines()
    assert lines[0].split() == ["TOPIC", "PURPOSE", "PARTITIONS", "STATE", "DRIFT"]
    assert lines[1].split() == ["a.events", "events", "2/2", "exists"]
    assert lines[2].startswith("a.snapshots") and "3/2" in lines[2] and "ERROR" in lines[2]
    assert lines[3].strip() == "error: cleanup.policy: expected compact, broker has delete"


class _LateBroker:
    """An admin client whose answering broker learns of each topic only on the second describe (as a broker of
    a three-node cluster may, just after the topic was created through another)."""

    def __init__(self, error: int) -> None:
        self.error, self.asked = error, []  # type: list[list[str]]

    def describe_configs(self, resources: list[ConfigResource], **_: object) -> dict[ConfigResource, object]:
        self.asked.append([r.name for r in resources])
        out = {}
        for r in resources:
            fut: Future = Future()
            if len(self.asked) == 1:
                fut.set_exception(KafkaException(KafkaError(self.error)))
            else:
                fut.set_result({})
            out[r] = fut
        return out


def test_configs_ask_again_for_a_topic_the_answering_broker_does_not_know_yet() -> None:
    client = _LateBroker(KafkaError.UNKNOWN_TOPIC_OR_PART)
    assert topics._configs(client, ["a", "b"]) == {"a": {}, "b": {}}  # type: ignore[arg-type]
    assert client.asked == [["a", "b"], ["a", "b"]]


def test_configs_do_not_ask_again_on_a_lasting_error() -> None:
    client = _LateBroker(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(FatalError, match="cannot describe the configs of topic 'a'"):
        topics._configs(client, ["a"])  # type: ignore[arg-type]
    assert len(client.asked) == 1


class _Listing:
    """An admin client whose metadata answers come from brokers that learn of a new topic one after another: the
    topic is listed by the second answer, not by the third, then by every later one."""

    def __init__(self, pattern: list[bool]) -> None:
        self.pattern, self.reads = pattern, 0

    def list_topics(self, **_: object) -> SimpleNamespace:
        listed = self.pattern[min(self.reads, len(self.pattern) - 1)]
        self.reads += 1
        meta = SimpleNamespace(error=None, partitions={0: SimpleNamespace(replicas=[1])})
        return SimpleNamespace(topics={"t": meta} if listed else {})


def test_metadata_is_read_until_it_lists_every_topic_asked_for() -> None:
    client = _Listing([False, True, False, True])
    meta = topics._metadata_listing(client, KafkaConfig(), {"t"})  # type: ignore[arg-type]
    assert "t" in meta and client.reads == 2


def test_metadata_that_never_lists_a_topic_is_returned_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topics, "TIMEOUT_S", 0.5)
    client = _Listing([False])
    assert topics._metadata_listing(client, KafkaConfig(), {"t"}) == {}  # type: ignore[arg-type]
    assert client.reads > 1
