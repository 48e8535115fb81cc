"""`kafold effects show` and `kafold effects reset-offsets`: the ledger answers, and a reset needs --yes."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kafold.config import KafkaConfig, PostgresConfig
from kafold.envelope import encode
from kafold.tools import cli
from tests.effects.effects_support import start_effects
from tests.support import committed, create_topic, make_event, produce, wait_for
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


def _config(path: Path, kafka: KafkaConfig, pg: PostgresConfig, hooks: str, topic: str, url: str) -> Path:
    path.write_text(f"""
[kafka]
bootstrap_servers = "{kafka.bootstrap_servers}"
[postgres]
url = "{pg.url}"
schema = "{pg.schema}"
[daemon]
group_prefix = "kt"

[[connectors]]
name = "{hooks}"
class = "webhook"
topics = ["{topic}"]
[connectors.config]
url = "{url}"
allow_http = true

[[connectors]]
name = "{hooks}-log"
class = "log"
topics = ["{topic}"]
""")
    return path


def test_show_and_reset_offsets(kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver,
                                unique: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    events = [make_event(f"k{i % 3}", i // 3 + 1) for i in range(6)]
    produce(kafka_config, topic, [(i % 2, *encode(e)) for i, e in enumerate(events)])
    url = receiver.url  # type: ignore[attr-defined]
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", {"url": url, "allow_http": True})
    try:
        wait_for(lambda: len(receiver.delivered_at()) == 6, "six deliveries", 60)
        group = run.runner.group_id
        wait_for(lambda: sum(committed(kafka_config, group, topic, 2).values()) == 6, "offsets committed", 60)
    finally:
        run.finish()
    assert group == f"kt.{unique}"  # the group the CLI derives from [daemon].group_prefix and the name
    cfg = _config(tmp_path / "kafold.toml", kafka_config, effects_pg, unique, topic, url)

    # The ledger answers "was it delivered, when, how many tries".
    assert cli.main(["effects", "show", events[0].event_id, "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"{unique}: succeeded after 1 attempt(s)" in out and topic in out
    assert cli.main(["effects", "show", "no-such-event", "-c", str(cfg)]) == 1
    assert "no effect recorded for event no-such-event" in capsys.readouterr().out

    # Without --yes nothing moves.
    assert cli.main(["effects", "reset-offsets", unique, "--to-earliest", "-c", str(cfg)]) == 1
    assert "Add --yes" in capsys.readouterr().out
    assert committed(kafka_config, group, topic, 2) == {0: 3, 1: 3}

    # With --yes the group goes back to the start: the next run re-reads the events, and the ledger (succeeded)
    # keeps the receiver from seeing them again.
    assert cli.main(["effects", "reset-offsets", unique, "--to-earliest", "--yes", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"{topic}[0]  -> 0" in out and f"{topic}[1]  -> 0" in out
    assert committed(kafka_config, group, topic, 2) == {0: 0, 1: 0}
    again = start_effects(kafka_config, effects_pg, unique, topic, "webhook", {"url": url, "allow_http": True})
    try:
        wait_for(lambda: committed(kafka_config, group, topic, 2) == {0: 3, 1: 3}, "re-committed", 60)
    finally:
        again.finish()
    assert len(receiver.requests) == 6  # deduplicated by the ledger: no effect fired twice

    # Only effect connectors can be reset; unknown names are named.
    assert cli.main(["effects", "reset-offsets", f"{unique}-log", "--to-latest", "--yes", "-c", str(cfg)]) == 1
    assert "is not an effect connector" in capsys.readouterr().err
    assert cli.main(["effects", "reset-offsets", "nope", "--to-latest", "--yes", "-c", str(cfg)]) == 1
    assert "no connector named 'nope'" in capsys.readouterr().err


def test_parked_retry_all_releases_every_parked_key_in_order(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.receiver import Req

    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    create_topic(kafka_config, f"kafold.dlq.{unique}", 1)
    broken = {"a", "b"}

    async def rejecting(req: Req) -> tuple[int, dict[str, str]] | None:
        return (422, {}) if req.key in broken and req.version == 2 else None

    receiver.behaviour = rejecting
    keys = ["a", "b", "c"]
    produce(kafka_config, topic, [(i % 2, *encode(make_event(k, v))) for v in (1, 2, 3) for i, k in enumerate(keys)])
    url = receiver.url  # type: ignore[attr-defined]
    cfg = _config(tmp_path / "kafold.toml", kafka_config, effects_pg, unique, topic, url)
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook",
                        {"url": url, "allow_http": True, "request_poll_s": 0.2})
    try:
        wait_for(lambda: cli.main(["effects", "parked", "list", "--connector", unique, "-c", str(cfg)]) == 0
                 and capsys.readouterr().out.count("key=") == 2, "two parked keys")
        assert cli.main(["effects", "parked", "list", "--connector", unique, "-c", str(cfg), "--json"]) == 0
        parked = orjson.loads(capsys.readouterr().out)
        assert len(parked) == 2 and {p["connector"] for p in parked} == {unique} and all(p["events"] >= 1
                                                                                       for p in parked)
        assert cli.main(["effects", "parked", "retry", "-c", str(cfg)]) == 1  # neither a key nor --all
        assert "--all" in capsys.readouterr().err
        broken.clear()
        assert cli.main(["effects", "parked", "retry", "--all", "--connector", unique, "-c", str(cfg)]) == 0
        assert "2 parked key(s) of " + unique + ": 2 released, 0 parked again, 0 not answered" in (
            capsys.readouterr().out)
    finally:
        run.finish()
    assert receiver.per_key() == {k: [1, 2, 3] for k in keys}
