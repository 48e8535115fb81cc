"""The README's code works as written: its service snippet runs against a daemon, its TOML validates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from kafold import config, kafka_clients, topics
from kafold.config import KafkaConfig
from kafold.envelope import decode
from kafold.testing import free_port
from tests.aggregates.agg_support import bank_daemon_toml
from tests.daemon.daemon_support import daemon_in_process
from tests.support import ROOT, wait_for

README = (ROOT / "README.md").read_text(encoding="utf-8")


def block(section: str, lang: str) -> str:
    """The first ```lang block under the README's `## section` heading."""
    body = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(rf"^```{lang}\n(.*?)^```", body, re.M | re.S)
    assert found, f"README.md: no ```{lang} block under '## {section}'"
    return found.group(1)


def test_readme_toml_validates() -> None:
    """The minimal configuration shown under "Configuration" is a valid kafold.toml."""
    loaded = config.parse(block("Configuration", "toml"), ROOT / "kafold.toml", environ={"PGPASSWORD": "x"})
    assert [c.name for c in loaded.config.connectors] == ["accounts"]
    assert "account.snapshots" in config.topic_map(loaded.config)


def test_readme_service_snippet_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kafka_config: KafkaConfig,
                                     unique: str) -> None:
    """The snippet under "Your service's side" writes its event and gets its command's result, printed as shown."""
    snippet = block("Your service's side", "python")
    (tmp_path / "kafold.toml").write_text(bank_daemon_toml(kafka_config, unique, free_port()) + """
[[topics]]
name = "order.events"
""")
    loaded = config.load_file(tmp_path / "kafold.toml")
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    monkeypatch.chdir(tmp_path)
    printed: list[str] = []  # the snippet's print (the daemon's log lines share stdout)
    with daemon_in_process(tmp_path / "kafold.toml") as d:
        wait_for(lambda: d.get("/ready")[0] == 200, "the aggregate runtime to go live")
        exec(compile(snippet, "README.md (Your service's side)", "exec"),
             {"__name__": "readme", "print": lambda *a: printed.append(" ".join(map(str, a)))})
    expected = re.search(r"# (accepted 1 None)$", snippet, re.M)
    assert expected and printed == [expected.group(1)]
    reader = kafka_clients.consumer(kafka_config, f"{unique}.reader")
    try:
        reader.assign([TopicPartition("order.events", 0, 0)])
        msgs = [m for m in reader.consume(10, 10) if m.error() is None]
    finally:
        reader.close()
    written = [decode(m.key(), m.value(), m.headers()) for m in msgs]
    assert [(e.type, e.aggregate_id, e.payload) for e in written] == [("OrderPlaced", "order-7", {"total": 4200})]
