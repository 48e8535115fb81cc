"""`kafold command send --wait` and `kafold state get` against a running aggregate runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kafold.config import KafkaConfig, TopicSpec
from kafold.tools import cli
from kafold.topics import ensure
from tests.aggregates.agg_support import BANK, bank_config, create_topics, running, runtime
from tests.support import wait_for


@pytest.mark.integration
def test_send_commands_then_get_state(kafka_config: KafkaConfig, unique: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Accepted and rejected commands print their results; the state is the fold of the accepted ones."""
    agg = bank_config(unique, partitions=3)
    create_topics(kafka_config, agg)
    ensure(kafka_config, [TopicSpec(agg.topic("snapshot"), 3, 1, {"cleanup.policy": "compact"})])
    toml = tmp_path / "kafold.toml"
    toml.write_text(f'[kafka]\nbootstrap_servers = "{kafka_config.bootstrap_servers}"\n'
                    f'[daemon]\npython_path = ["{BANK}"]\n'
                    f'[[aggregates]]\nname = "{agg.name}"\ninitial = "{agg.initial}"\nevolve = "{agg.evolve}"\n'
                    f'decide = "{agg.decide}"\npartitions = 3\n')
    base = ["command", "send", "-c", str(toml), agg.name, "acc-7"]
    with running(runtime(kafka_config, agg)) as r:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        assert cli.main([*base, "OpenAccount", "--data", '{"owner": "ann"}', "--wait"]) == 0
        assert cli.main([*base, "Deposit", "--data", '{"amount": 500}', "--wait"]) == 0
        assert cli.main([*base, "Withdraw", "--data", '{"amount": 900}', "--wait"]) == 1  # insufficient funds
        assert cli.main([*base, "Deposit", "--data", '{"amount": 1}', "--expected-version", "1", "--wait"]) == 1
    # stdout also carries the in-process runtime's log lines (the test's default structlog config): take results only
    outputs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [o["status"] for o in outputs] == ["accepted", "accepted", "rejected", "rejected"]
    assert "insufficient funds" in outputs[2]["reason"]
    assert cli.main(["state", "get", "-c", str(toml), agg.name, "acc-7"]) == 0
    out = capsys.readouterr().out
    got = json.loads(out[out.index("{"):])
    assert got["version"] == 2
    assert got["state"]["balance"] == 500 and got["state"]["owner"] == "ann"
    assert got["obtained"]["tail_events_replayed"] == 2
    assert cli.main(["state", "get", "-c", str(toml), agg.name, "nobody"]) == 1

