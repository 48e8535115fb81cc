"""A protected aggregate's commands (clear, as clients send them) are kept a bounded time: the topics kafold creates
for it carry retention and segment settings; an aggregate without `protect` rules gets none; `[[topics]]` wins."""

from __future__ import annotations

from pathlib import Path

from kafold import config

BASE = """
[kafka]
bootstrap_servers = "x:1"

[privacy]
master_key_env = "KAFOLD_TEST_RETENTION_MASTER"

[[aggregates]]
name = "customer"
initial = "m:initial"
evolve = "m:evolve"
decide = "m:decide"
"""
PROTECT = """
[[aggregates.protect]]
type = "Registered"
fields = ["email"]
"""
ENV = {"KAFOLD_TEST_RETENTION_MASTER": "A" * 43 + "="}


def _topics(text: str, tmp_path: Path) -> dict[str, config.TopicSpec]:
    return config.topic_map(config.parse(text, tmp_path / "kafold.toml", ENV).config)


def test_a_protected_aggregates_commands_and_dead_letters_are_kept_a_bounded_time(tmp_path: Path) -> None:
    topics = _topics(BASE + PROTECT, tmp_path)
    assert topics["customer.commands"].configs == {"retention.ms": "86400000", "segment.ms": "3600000"}
    assert topics["kafold.dlq.aggregate.customer"].configs == {"retention.ms": "604800000", "segment.ms": "86400000"}
    assert topics["customer.events"].configs == {} and topics["customer.results"].configs == {}


def test_an_unprotected_aggregate_keeps_the_brokers_defaults(tmp_path: Path) -> None:
    topics = _topics(BASE, tmp_path)
    assert topics["customer.commands"].configs == {} and topics["kafold.dlq.aggregate.customer"].configs == {}


def test_topics_entries_override_the_bound(tmp_path: Path) -> None:
    topics = _topics(BASE + PROTECT + '[[topics]]\nname = "customer.commands"\npartitions = 4\n'
                     'configs = { "retention.ms" = "3600000" }\n', tmp_path)
    assert topics["customer.commands"].configs == {"retention.ms": "3600000", "segment.ms": "3600000"}
