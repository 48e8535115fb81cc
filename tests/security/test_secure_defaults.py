"""Secure defaults against real services: Kafka SASL settings reach both clients, PostgreSQL TLS settings reach libpq,
a daemon start never logs a secret and binds its API to 127.0.0.1 behind the token, SQL identifiers are quoted, and
webhook signatures verify on the receiver's side."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg import sql

from kafold import db, kafka_clients, topics
from kafold.config import KafkaConfig, PostgresConfig, TopicSpec
from kafold.connectors.effects.signing import sign, verify_request
from kafold.connectors.projection import sql as q
from kafold.errors import RetriableError
from kafold.schema import Secret
from kafold.testing import free_port
from kafold.tools.dev import stack as devstack
from tests.daemon.daemon_support import write_config
from tests.projection.projection_support import encoded, ends_of, history, table_name, wait_for_offsets
from tests.security.hostile_corpus import CANARY, produce_raw
from tests.security.socket_relay import UnixRelay
from tests.support import create_topic, wait_for

SASL_PASSWORD = f"sasl-{uuid.uuid4().hex}"


# ---- Kafka: SASL settings reach both clients (the embedded broker speaks SCRAM when started with --authentication;
# it cannot hold users then, and this build has no TLS listener, so the exchange ends with "unknown-user") -------
@pytest.fixture(scope="module")
def auth_broker() -> Iterator[str]:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen([devstack._tansu_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url,
                             "--storage-engine", "memory://tansu/", "--authentication"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: _accepts(port), "the authenticating broker")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def scram(bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> KafkaConfig:
    monkeypatch.setenv("KAFOLD_TEST_SASL_PASSWORD", SASL_PASSWORD)
    return KafkaConfig(bootstrap_servers=bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
                       sasl_username="kafold-test", sasl_password=Secret("env:KAFOLD_TEST_SASL_PASSWORD"))


def test_confluent_client_authenticates_with_the_configured_scram_user(
        auth_broker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[KafkaError] = []
    admin = AdminClient(kafka_clients.librdkafka(scram(auth_broker, monkeypatch), error_cb=errors.append,
                                                 log_level=0))
    with pytest.raises(Exception, match=r"transport failure|timed out"):
        admin.list_topics(timeout=5)
    wait_for(lambda: admin.poll(0.2) >= 0 and any(e.code() == KafkaError._AUTHENTICATION for e in errors),
             "the authentication error", 30)
    text = " ".join(e.str() for e in errors)
    assert "SASL SCRAM authentication failed" in text and "unknown-user" in text
    assert SASL_PASSWORD not in text


def test_aiokafka_client_authenticates_with_the_configured_scram_user(
        auth_broker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    async def start() -> BaseException | None:
        client = AIOKafkaAdminClient(**kafka_clients.aiokafka_kwargs(scram(auth_broker, monkeypatch)),
                                     request_timeout_ms=5000)
        try:
            await asyncio.wait_for(client.start(), 30)
            return None
        except BaseException as e:
            return e
        finally:
            await client.close()

    error = asyncio.run(start())
    assert error is not None, "an unknown SCRAM user was let in"
    frames = {f.name for f in traceback.extract_tb(error.__traceback__)}
    assert "process_server_final_message" in frames, frames  # aiokafka ran the SCRAM exchange to its last step


def test_a_plaintext_client_is_refused_by_an_authenticating_broker(auth_broker: str) -> None:
    admin = kafka_clients.admin(KafkaConfig(bootstrap_servers=auth_broker), log_level=0)
    with pytest.raises(Exception, match=r"transport failure|timed out"):
        admin.list_topics(timeout=3)


# ---- PostgreSQL TLS ---------------------------------------------------------------------------------------------
@pytest.fixture
def tcp_pg(pg_url: str) -> Iterator[str]:
    """A postgresql:// URL reaching the embedded (non-TLS) server over TCP, through a relay to its Unix socket."""
    parts = urlsplit(pg_url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    if not query.get("host", "").startswith("/"):
        pytest.skip("needs the embedded PostgreSQL, which listens on a Unix socket without TLS")
    relay = UnixRelay(f"{query['host']}/.s.PGSQL.{query.get('port', '5432')}")
    try:
        yield f"postgresql://{parts.username}@127.0.0.1:{relay.port}{parts.path}"
    finally:
        relay.close()


def test_sslmode_require_against_a_server_without_tls_fails_clearly(tcp_pg: str) -> None:
    with db.connect(PostgresConfig(url=tcp_pg, sslmode="disable")) as conn:  # the relay itself works
        assert conn.execute("select 1").fetchone() == (1,)
    for url in (tcp_pg, tcp_pg + "?sslmode=disable"):  # the configured sslmode wins over the URL's
        with pytest.raises(RetriableError, match="server does not support SSL, but SSL was required"):
            db.connect(PostgresConfig(url=url, sslmode="require"))


# ---- a daemon start with secrets configured ----------------------------------------------------------------------
def test_daemon_start_logs_no_secret_and_binds_its_api_to_localhost_behind_the_token(
        tmp_path: Path, kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str) -> None:
    import psutil

    token, pg_password = f"token-{uuid.uuid4().hex}", f"pgpw-{uuid.uuid4().hex}"
    token_file = tmp_path / "api-token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    topic, table, port = f"{unique}.events", table_name(), free_port()
    create_topic(kafka_config, topic)
    topics.ensure(kafka_config, [TopicSpec("kafold.dlq.sink", 1, 1, {})])  # shared by the daemon tests' "sink"
    good = history(accounts=2, deposits=2)
    coords = produce_raw(kafka_config, topic, [*encoded(good, 1), (0, b"acc-0", b'{"payload": "' +
                                                                   CANARY.encode() + b'"', [])])
    rules = ('[{type = "AccountOpened", set = {owner = "payload.owner"}}, {type = "MoneyDeposited", action = "update", '
             'increment = {balance = "payload.amount"}}]')
    path = write_config(tmp_path, kafka_config, unique, topic, port=port, connector="postgres-projection",
                        config_toml=f'{{table = "{table}", key_columns = ["account_id"], columns = {{account_id = '
                                    f'"text", owner = "text", balance = "bigint"}}, on = {rules}}}',
                        daemon_extra=f'api_token_file = "{token_file}"\nlog_level = "debug"')
    env = {**os.environ, "KAFOLD_TEST_PG_PASSWORD": pg_password, "KAFOLD_POSTGRES__URL": pg_config.url,
           "KAFOLD_POSTGRES__PASSWORD_ENV": "KAFOLD_TEST_PG_PASSWORD"}
    proc = subprocess.Popen([sys.executable, "-m", "kafold.tools.cli", "--debug", "--log-format", "json", "daemon",
                             "-c", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for_offsets(pg_config, "sink", topic, ends_of(coords), timeout=120)
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening and {a.ip for a in listening} == {"127.0.0.1"}, listening
        assert _get(port, "/connectors", None)[0] == 401
        assert _get(port, "/connectors", "wrong")[0] == 401
        assert _get(port, "/connectors", token) == (200, '["sink"]')
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert '"dlq.record_dead_lettered"' in err and '"daemon.started"' in err  # the capture holds the daemon's log
    for secret in (token, pg_password, CANARY):
        assert secret not in out + err


def _get(port: int, path: str, token: str | None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---- SQL identifiers: validated at load (tests/security/test_bad_configs.py), always quoted when used -----------
def test_reserved_words_as_names_work_because_every_identifier_is_quoted(pg_config: PostgresConfig) -> None:
    table = f"user_{uuid.uuid4().hex[:6]}"
    with db.connect(pg_config) as conn:
        conn.execute(q.create_table("public", table, {"order": "text", "select": "bigint"}, ["order"],
                                    "_kafold_version"))
        conn.execute(sql.SQL("INSERT INTO {} ({}, {}) VALUES ('a', 1)").format(
            q.qualified("public", table), sql.Identifier("order"), sql.Identifier("select")))
        assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(q.qualified("public", table))).fetchone() == (1,)
        conn.execute(sql.SQL("DROP TABLE {}").format(q.qualified("public", table)))


def test_statements_quote_a_name_even_if_validation_were_bypassed() -> None:
    hostile = 'x"; DROP TABLE y; --'
    text = q.qualified("public", hostile).as_string(None)
    assert text == '"public"."x""; DROP TABLE y; --"'  # one identifier, the quote doubled


# ---- webhook signatures, the receiver's side ----------------------------------------------------------------------
def _signed(body: bytes, secrets: list[str], ts: int) -> dict[str, str]:
    return {"webhook-id": "evt-1", "webhook-timestamp": str(ts), "webhook-signature": sign("evt-1", ts, body, secrets)}


def test_verify_request_accepts_what_kafold_signs_and_rejects_any_change() -> None:
    body, now = b'{"event_id": "evt-1"}', int(time.time())
    headers = _signed(body, ["whsec_c2VjcmV0LWtleQ==", "old-secret"], now)
    assert verify_request(headers, body, ["whsec_c2VjcmV0LWtleQ=="])
    assert verify_request({k.title(): v for k, v in headers.items()}, body, ["old-secret"])  # any header case
    assert not verify_request(headers, body + b" ", ["old-secret"])
    assert not verify_request(headers, body, ["another-secret"])
    assert not verify_request({**headers, "webhook-id": "evt-2"}, body, ["old-secret"])
    assert not verify_request(_signed(body, ["old-secret"], now - 3600), body, ["old-secret"])  # replayed late
    for missing in headers:
        assert not verify_request({k: v for k, v in headers.items() if k != missing}, body, ["old-secret"])


@settings(max_examples=200)
@given(headers=st.dictionaries(st.sampled_from(["webhook-id", "webhook-timestamp", "webhook-signature", "x"]),
                               st.text(max_size=60)), body=st.binary(max_size=50))
def test_verify_request_never_raises_on_hostile_headers(headers: dict[str, str], body: bytes) -> None:
    assert verify_request(headers, body, ["s1"]) in (True, False)
