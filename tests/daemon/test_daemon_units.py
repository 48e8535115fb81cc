"""Pure logic of the daemon: caught-up decisions, event-time lag, bearer-token checks, Connect offset bodies."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kafold.connectors.api import TopicPartition
from kafold.daemon.connect_api import offsets_body
from kafold.daemon.http import authorized
from kafold.daemon.progress import PartitionProgress, ProgressTracker

TP = TopicPartition("t", 0)


def test_not_caught_up_before_both_list_offsets_and_a_fetch_response_were_seen() -> None:
    p = PartitionProgress(TP, position=10, listed_end=10)
    assert not p.advance().caught_up
    assert PartitionProgress(TP, position=10).advance(high_watermark=10).caught_up is False
    assert p.advance(high_watermark=10).caught_up


def test_target_takes_the_larger_of_list_offsets_and_the_first_fetch_watermark() -> None:
    # ListOffsets may under-report (the embedded broker returns the last batch's base offset + 1).
    p = PartitionProgress(TP, position=4, listed_end=4).advance(high_watermark=13)
    assert p.target == 13 and not p.caught_up and p.lag == 9
    assert p.advance(position=13).caught_up


def test_later_traffic_neither_moves_the_target_nor_unsets_caught_up() -> None:
    p = PartitionProgress(TP, position=5, listed_end=5).advance(high_watermark=5)
    assert p.caught_up
    later = p.advance(high_watermark=50)
    assert later.target == 5 and later.caught_up and later.lag == 45


def test_event_time_lag_counts_only_while_records_remain() -> None:
    behind = PartitionProgress(TP, position=5, listed_end=5, event_time_ms=1_000).advance(high_watermark=9)
    assert behind.lag_seconds(now_ms=61_000) == 60.0
    level = PartitionProgress(TP, position=9, listed_end=9, event_time_ms=1_000).advance(high_watermark=9)
    assert level.lag_seconds(now_ms=61_000) == 0.0


def test_bearer_token_check() -> None:
    assert authorized(None, "")
    assert authorized("abc", "Bearer abc") and authorized("abc", "bearer abc")
    assert not authorized("abc", "") and not authorized("abc", "Bearer abd") and not authorized("abc", "Basic abc")


def test_offsets_body_has_connects_shape() -> None:
    assert offsets_body({("t", 1): 7, ("t", 0): 3}) == {"offsets": [
        {"partition": {"kafka_topic": "t", "kafka_partition": 0}, "offset": {"kafka_offset": 3}},
        {"partition": {"kafka_topic": "t", "kafka_partition": 1}, "offset": {"kafka_offset": 7}}]}


def test_faust_agents_get_kafkas_security_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's Faust agents reach the brokers with [kafka]'s settings: none for PLAINTEXT, SASL (with TLS when
    asked) as Faust credentials; OAUTHBEARER, which Faust's transport is given no token for, is refused."""
    import faust

    from kafold.config import KafkaConfig
    from kafold.daemon.extensions import broker_credentials
    from kafold.errors import ConfigError
    from kafold.schema import Secret

    monkeypatch.setenv("TEST_FAUST_SASL", "pw")
    assert broker_credentials(KafkaConfig(bootstrap_servers="b:1")) is None
    scram = broker_credentials(KafkaConfig(bootstrap_servers="b:1", security_protocol="SASL_SSL",
                                           sasl_mechanism="SCRAM-SHA-512", sasl_username="svc",
                                           sasl_password=Secret("env:TEST_FAUST_SASL")))
    assert isinstance(scram, faust.SASLCredentials)
    assert (scram.username, scram.password, scram.mechanism.value, scram.protocol.value) == \
        ("svc", "pw", "SCRAM-SHA-512", "SASL_SSL")
    assert scram.ssl_context is not None and scram.ssl_context.check_hostname
    with pytest.raises(ConfigError, match="OAUTHBEARER"):
        broker_credentials(KafkaConfig(bootstrap_servers="b:1", security_protocol="SASL_PLAINTEXT",
                                       sasl_mechanism="OAUTHBEARER"))


@pytest.mark.parametrize(("daemon_setting", "own", "expected"), [
    (False, None, False), (True, None, True), (False, "true", True), (True, "false", False)])
def test_a_connector_runs_as_processes_by_its_own_task_processes_else_the_daemons(
        tmp_path: Path, daemon_setting: bool, own: str | None, expected: bool) -> None:
    from kafold.config import parse
    from kafold.daemon.tasks import in_processes

    line = f"task_processes = {own}\n" if own is not None else ""
    loaded = parse(f'[daemon]\ntask_processes = {str(daemon_setting).lower()}\n\n[[connectors]]\nname = "a"\n'
                   f'class = "log"\ntopics = ["t"]\n{line}', tmp_path / "kafold.toml", environ={})
    (connector,) = loaded.config.connectors
    assert in_processes(connector, loaded.config.daemon) is expected


def test_a_connectors_task_processes_must_be_a_boolean(tmp_path: Path) -> None:
    from kafold.config import parse
    from kafold.errors import ConfigError

    with pytest.raises(ConfigError, match="task_processes"):
        parse('[[connectors]]\nname = "a"\nclass = "log"\ntopics = ["t"]\ntask_processes = 3\n',
              tmp_path / "kafold.toml", environ={})


def test_a_partition_whose_committed_offset_lookup_failed_stays_pending_and_is_not_read_as_unstarted() -> None:
    """committed() reports a partition's own error in its entry (offset -1001, as for "none committed"): that
    partition is queried again at the next refresh instead of being taken as starting from the earliest offset."""
    tp = TopicPartition("t", 0)

    class Consumer:
        error: object = "COORDINATOR_NOT_AVAILABLE"

        def committed(self, tps: list[Any], timeout: float) -> list[Any]:
            return [SimpleNamespace(topic="t", partition=0, offset=-1001 if self.error else 5, error=self.error)]

        def offsets_for_times(self, tps: list[Any], timeout: float) -> list[Any]:
            return [SimpleNamespace(topic="t", partition=0, offset=0 if k.offset == -2 else 10, error=None)
                    for k in tps]

        def get_watermark_offsets(self, tp: Any, cached: bool) -> tuple[int, int]:
            return 0, 10

    tracker, consumer = ProgressTracker(), Consumer()
    tracker.assigned([tp])
    tracker.refresh(consumer, {}, set(), {}, {})
    assert tracker.snapshot[tp].position is None and tracker.snapshot[tp].committed is None
    consumer.error = None
    tracker.refresh(consumer, {}, set(), {}, {})
    assert (tracker.snapshot[tp].position, tracker.snapshot[tp].committed) == (5, 5)
