"""examples/faust_extension as a user runs it, on a real broker: the bank aggregate handles commands sent with
kafold's client while the example's Faust module counts the events in a Faust table and serves the counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kafold import config, topics
from kafold.client import CommandClient
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import bank_daemon_toml
from tests.daemon.daemon_support import daemon_in_process
from tests.support import EXAMPLES, wait_for

EXAMPLE = EXAMPLES / "faust_extension"


def test_the_example_configuration_validates() -> None:
    loaded = config.load_file(EXAMPLE / "kafold.toml")
    assert loaded.config.daemon.faust_modules == ("ledger_watch",)


@pytest.mark.timeout(300)
def test_the_faust_example_counts_the_aggregates_events(tmp_path: Path, kafka_config: KafkaConfig, unique: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    events = f"{unique}.events"
    (tmp_path / "kafold.toml").write_text(bank_daemon_toml(
        kafka_config, unique, free_port(), partitions=4,  # as the example's table: Faust wants its source's count
        python_path=(str(EXAMPLE), str(EXAMPLES / "bank")), daemon_extra='faust_modules = ["ledger_watch"]'))
    loaded = config.load_file(tmp_path / "kafold.toml")  # imports ledger_watch: its topic is set before setup
    monkeypatch.setattr(sys.modules["ledger_watch"], "TOPIC", events)
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    account = loaded.config.aggregates[0]
    with daemon_in_process(tmp_path / "kafold.toml") as d:
        wait_for(lambda: d.get("/ready")[0] == 200, "the aggregate runtime to go live", 120)
        with CommandClient(kafka_config, account) as client:
            for name, data in [("OpenAccount", {"owner": "Ada"}), ("Deposit", {"amount": 900}),
                               ("Withdraw", {"amount": 600}), ("Withdraw", {"amount": 5000})]:
                client.send(client.command("acc-1", name, data), timeout=30)
        want = {"AccountOpened": 1, "MoneyDeposited": 1, "MoneyWithdrawn": 1}  # the last withdrawal is refused
        wait_for(lambda: d.get("/ledger-watch/counts")[1] == want, "the example's table counting the events", 120)
