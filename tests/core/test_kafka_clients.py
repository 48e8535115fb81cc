"""Client settings built from [kafka]: what librdkafka and aiokafka receive."""

from __future__ import annotations

import json
import ssl
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Producer

from kafold import logs
from kafold.config import KafkaConfig
from kafold.errors import ConfigError
from kafold.kafka_clients import (
    LIBRDKAFKA_LOG,
    METADATA_REFRESH_MS,
    RECONNECT_BACKOFF_MS,
    _connect,
    aiokafka_kwargs,
    coordinator_changing,
    librdkafka,
    produce,
)
from kafold.schema import Secret
from kafold.testing import free_port

SYSTEM_CA = ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt"


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_SASL_PASSWORD", "s3cret")
    monkeypatch.setenv("TEST_KEY_PASSWORD", "k3y")


def test_plaintext_has_only_the_basics() -> None:
    conf = librdkafka(KafkaConfig(bootstrap_servers="b1:9092,b2:9092", client_id="svc"))
    assert conf == {"bootstrap.servers": "b1:9092,b2:9092", "client.id": "svc",
                    "security.protocol": "PLAINTEXT", "reconnect.backoff.ms": RECONNECT_BACKOFF_MS,
                    "topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS, "logger": LIBRDKAFKA_LOG}


def test_an_empty_broker_list_is_named_before_any_client_is_made() -> None:
    """A service's own code with `[kafka]` left empty (the dev stack's default) gets a ConfigError naming the key
    and the ways to fill it, not librdkafka's "Broker transport failure" on its first request."""
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match=r"\[kafka\] bootstrap_servers is empty.*KAFOLD_KAFKA__BOOTSTRAP_SERVERS"):
            librdkafka(KafkaConfig(bootstrap_servers=empty))


def test_librdkafkas_own_log_lines_come_out_as_structured_lines(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    log_file = tmp_path / "kafold.log"
    logs.configure("info", "json", str(log_file))
    try:
        producer = Producer(librdkafka(KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}")))
        deadline = time.monotonic() + 20
        while "Connection refused" not in log_file.read_text() and time.monotonic() < deadline:
            producer.poll(0.2)  # the client hands its log lines over while polled
        producer.flush(0)
    finally:
        logs.configure()
    lines = [json.loads(t) for t in log_file.read_text().splitlines() if "Connection refused" in t]
    assert lines, "librdkafka's connection failure did not reach kafold's log"
    assert (lines[0]["logger"], lines[0]["level"]) == ("kafold.librdkafka", "error")
    assert "FAIL" in lines[0]["event"]
    assert "|FAIL|" not in capfd.readouterr().err  # no raw librdkafka line on stderr


def test_a_client_option_given_by_the_caller_wins_over_kafolds_default() -> None:
    conf = librdkafka(KafkaConfig(bootstrap_servers="b:9092"), **{"reconnect.backoff.ms": 250})
    assert conf["reconnect.backoff.ms"] == 250


def test_sasl_ssl_reveals_secrets_and_maps_every_tls_setting(secrets: None) -> None:
    kafka = KafkaConfig(
        bootstrap_servers="b:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc", sasl_password=Secret("env:TEST_SASL_PASSWORD"), ssl_ca_location="/ca.pem",
        ssl_certificate_location="/cert.pem", ssl_key_location="/key.pem",
        ssl_key_password=Secret("env:TEST_KEY_PASSWORD"), ssl_check_hostname=False)
    conf = librdkafka(kafka)
    assert conf["security.protocol"] == "SASL_SSL"
    assert (conf["sasl.mechanism"], conf["sasl.username"], conf["sasl.password"]) == \
        ("SCRAM-SHA-512", "svc", "s3cret")
    assert conf["ssl.ca.location"] == "/ca.pem"
    assert conf["ssl.certificate.location"] == "/cert.pem"
    assert conf["ssl.key.location"] == "/key.pem"
    assert conf["ssl.key.password"] == "k3y"
    assert conf["ssl.endpoint.identification.algorithm"] == "none"


def test_hostname_verification_is_on_by_default_for_tls() -> None:
    conf = librdkafka(KafkaConfig(bootstrap_servers="b:9093", security_protocol="SSL"))
    assert conf["ssl.endpoint.identification.algorithm"] == "https"
    assert "ssl.ca.location" not in conf  # librdkafka then uses the system's CA store


def test_extra_settings_are_librdkafka_keys_and_win() -> None:
    extra = {"client.id": "other", "enable.idempotence": True}
    conf = librdkafka(KafkaConfig(bootstrap_servers="b:1"), **extra)
    assert conf["client.id"] == "other" and conf["enable.idempotence"] is True


def test_librdkafka_accepts_the_generated_sasl_settings(secrets: None) -> None:
    kafka = KafkaConfig(bootstrap_servers="127.0.0.1:1", security_protocol="SASL_PLAINTEXT",
                        sasl_mechanism="PLAIN", sasl_username="u",
                        sasl_password=Secret("env:TEST_SASL_PASSWORD"))
    Producer(librdkafka(kafka)).flush(0)  # raises KafkaException on an unknown key or bad value


def test_aiokafka_plaintext() -> None:
    kw = aiokafka_kwargs(KafkaConfig(bootstrap_servers="b:9092", client_id="svc"))
    assert kw == {"bootstrap_servers": "b:9092", "client_id": "svc", "security_protocol": "PLAINTEXT"}


def test_aiokafka_sasl_ssl_builds_a_verifying_context(secrets: None) -> None:
    kafka = KafkaConfig(bootstrap_servers="b:9093", security_protocol="SASL_SSL",
                        sasl_mechanism="SCRAM-SHA-256",
                        sasl_username="svc", sasl_password=Secret("env:TEST_SASL_PASSWORD"),
                        ssl_ca_location=SYSTEM_CA)
    kw = aiokafka_kwargs(kafka)
    assert (kw["sasl_mechanism"], kw["sasl_plain_username"], kw["sasl_plain_password"]) == \
        ("SCRAM-SHA-256", "svc", "s3cret")
    ctx = kw["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 0  # the CA file was loaded


def test_aiokafka_context_can_skip_hostname_checks() -> None:
    kafka = KafkaConfig(bootstrap_servers="b:9093", security_protocol="SSL", ssl_ca_location=SYSTEM_CA,
                        ssl_check_hostname=False)
    assert aiokafka_kwargs(kafka)["ssl_context"].check_hostname is False


def test_aiokafka_reports_a_missing_ca_file(tmp_path: Path) -> None:
    kafka = KafkaConfig(bootstrap_servers="b:9093", security_protocol="SSL",
                        ssl_ca_location=str(tmp_path / "nope.pem"))
    with pytest.raises(FileNotFoundError):
        aiokafka_kwargs(kafka)


def test_librdkafka_accepts_the_generated_tls_settings() -> None:
    """librdkafka loads the CA file when the client is created: a wrong path fails here, not at first use."""
    kafka = KafkaConfig(bootstrap_servers="127.0.0.1:1", security_protocol="SSL", ssl_ca_location=SYSTEM_CA)
    Producer(librdkafka(kafka)).flush(0)
    with pytest.raises(Exception, match=r"ssl\.ca\.location"):
        Producer(librdkafka(KafkaConfig(bootstrap_servers="127.0.0.1:1", security_protocol="SSL",
                                        ssl_ca_location="/nonexistent/ca.pem")))


def test_security_settings_of_another_protocol_are_not_sent() -> None:
    """PLAINTEXT sends no SASL or TLS keys (the loader refuses such a mix; the client builder never leaks one)."""
    conf = librdkafka(KafkaConfig(bootstrap_servers="b:1", sasl_username="u", ssl_ca_location="/ca.pem"))
    assert not [k for k in conf if k.startswith(("sasl.", "ssl."))]
    assert not {"sasl_plain_username", "ssl_context"} & set(aiokafka_kwargs(
        KafkaConfig(bootstrap_servers="b:1", sasl_username="u", ssl_ca_location="/ca.pem")))


def test_produce_waits_for_room_in_a_full_queue_instead_of_raising() -> None:
    # No broker on the port: each record's delivery fails after message.timeout.ms, which frees its queue slot.
    made = Producer({"bootstrap.servers": "127.0.0.1:1", "queue.buffering.max.messages": 1,
                     "message.timeout.ms": 200, "log_level": 0})
    reports: list[str] = []
    for i in range(3):  # the second and third find the one-record queue full
        produce(made, "t", f"v{i}".encode(), on_delivery=lambda err, msg: reports.append(msg.value().decode()))
    made.flush(10)
    assert reports == ["v0", "v1", "v2"]


def test_a_moving_or_loading_group_coordinator_is_asked_again_and_a_refusal_is_not() -> None:
    for code in (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._TIMED_OUT):
        assert coordinator_changing(KafkaError(code))
    assert coordinator_changing(KafkaError(KafkaError.UNKNOWN, retriable=True))
    assert not coordinator_changing(KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED))


def test_the_producer_warm_up_ends_quietly_when_its_producer_is_closed_under_it() -> None:
    """The idempotent producer's connect warm-up runs in a thread; an owner closing the producer first (a test's
    short-lived client, a stop during start) must not leave a traceback in that thread."""
    made = Producer({"bootstrap.servers": f"127.0.0.1:{free_port()}", "log_level": 0})
    made.close()
    with pytest.raises(RuntimeError):
        made.list_topics(timeout=0.1)  # what the warm-up meets
    _connect(made)  # returns, raising nothing
