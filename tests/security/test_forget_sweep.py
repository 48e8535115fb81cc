"""After `subjects forget`, no clear value of the subject anywhere (issue 51), end to end on Apache Kafka: a
`kafold daemon` process hosts a `customer` aggregate whose e-mail, name, street and phone are protected, a
projection of it (one subject's phone refused by PostgreSQL, its next event held), a webhook (one subject's
receiver fails: its events park) and a `kafka` effect. One subject is forgotten with the CLI, another over HTTP;
the dead letter is discarded, the parked events released, the projection refreshed, the keys purged. Then every
byte of every topic on the broker, a full `pg_dump`, the keys table's data file, the daemon's logs and every
webhook body sent after the forget are searched for the forgotten subjects' values (unique to this run): they are
only where docs/security.md says they may stay. A `pg_dump` taken before the forget, restored into a fresh
database, gives the placeholder once a daemon has started on it. The domain functions below are the aggregate's."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import pgserver
import psycopg
import pytest
from confluent_kafka import KafkaError, TopicPartition
from confluent_kafka.admin import ConfigResource
from psycopg import sql

from kafold import config, kafka_clients
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import KAFOLD, Outside, kafold_cli, raw_bytes
from tests.daemon.daemon_support import get_json
from tests.support import ROOT, child_env, kafka_toml, wait_for
from tests.support.receiver import Receiver, Req

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MASTER_VAR = "KAFOLD_TEST_FORGET_SWEEP_MASTER"
TOKEN_VAR = "KAFOLD_TEST_FORGET_SWEEP_TOKEN"
PLACEHOLDER = "[erased]"
PG_BIN = Path(pgserver.__file__).parent / "pginstall" / "bin"


# ---- the aggregate (pure) ------------------------------------------------------------------------------
def initial() -> dict[str, Any]:
    return {}


_EVENTS = {"Register": "Registered", "SetPhone": "PhoneSet", "Move": "Moved", "Rename": "Renamed"}


def evolve(state: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    return {**state, **{k: v for k, v in event.items() if k != "type"}}


def decide(command: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
    data = {k: v for k, v in command.items() if k not in ("type", "command_id", "aggregate_id")}
    return [{"type": _EVENTS[command["type"]], **data}]


# ---- the world -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Person:
    """A subject and its values, unique to this run (the broker and PostgreSQL are shared by the tests)."""

    id: str
    email: str
    name: str
    street: str
    phone: str

    @classmethod
    def of(cls, who: str, u: str) -> Person:
        return cls(f"{who}-{u}", f"{who}.{u}@example.com", f"{who.title()} Sweep{u}", f"{u} {who.title()} Street",
                   f"tel-{u}-{who}")

    @property
    def values(self) -> tuple[str, ...]:
        return self.email, self.name, self.street, self.phone


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    token: str

    def call(self, method: str, path: str) -> tuple[int, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, orjson.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(90)


def _toml(kafka: KafkaConfig, pg_url: str, prefix: str, table: str, url: str, port: int) -> str:
    return f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{prefix}"
http_port = {port}
api_token_env = "{TOKEN_VAR}"
python_path = ["{ROOT}"]
batch_max_wait_ms = 50

[postgres]
url = "{pg_url}"

[privacy]
master_key_env = "{MASTER_VAR}"
placeholder = "{PLACEHOLDER}"
erasure_topic = "{prefix}.erasures"
key_purge_interval_s = 10.0

[[aggregates]]
name = "customer"
initial = "{__name__}:initial"
evolve = "{__name__}:evolve"
decide = "{__name__}:decide"
partitions = 2
events_topic = "{prefix}.events"
commands_topic = "{prefix}.commands"
results_topic = "{prefix}.results"
snapshot_topic = "{prefix}.snapshots"

[[aggregates.protect]]
type = "Registered"
fields = ["email", "name", "street"]

[[aggregates.protect]]
type = "PhoneSet"
fields = ["phone"]

[[aggregates.protect]]
type = "Moved"
fields = ["street"]

[[aggregates.protect]]
type = "Renamed"
fields = ["name"]

[[connectors]]
name = "{table}"
class = "postgres-projection"
topics = ["{prefix}.events"]
[connectors.config]
table = "{table}"
key_columns = ["customer_id"]
[connectors.config.columns]
customer_id = "text"
email = "text"
name = "text"
street = "text"
phone = "text"
[[connectors.config.on]]
type = "Registered"
set = {{ email = "payload.email", name = "payload.name", street = "payload.street" }}
[[connectors.config.on]]
type = "PhoneSet"
action = "update"
set = {{ phone = "payload.phone" }}
[[connectors.config.on]]
type = "Moved"
action = "update"
set = {{ street = "payload.street" }}
[[connectors.config.on]]
type = "Renamed"
action = "update"
set = {{ name = "payload.name" }}

[[connectors]]
name = "hook-{table}"
class = "webhook"
topics = ["{prefix}.events"]
[connectors.config]
url = "{url}"
allow_http = true
max_attempts = 2
backoff_initial_s = 0.05
backoff_max_s = 0.2
request_poll_s = 0.2

[[connectors]]
name = "copy-{table}"
class = "kafka"
topics = ["{prefix}.events"]
[connectors.config]
topic = "{prefix}.derived"

[[topics]]
name = "{prefix}.derived"
partitions = 1
"""


def _start(conf: Path, log: Path, port: int, token: str) -> Daemon:
    with open(log, "ab") as out:  # debug logs: the most a daemon ever writes
        proc = subprocess.Popen([KAFOLD, "--debug", "--log-format", "json", "daemon", "-c", str(conf)],
                                stdout=out, stderr=subprocess.STDOUT, env=child_env())
    d = Daemon(proc, log, port, token)
    wait_for(lambda: proc.poll() is not None or _answers(port), "the daemon's HTTP server", 120)
    assert proc.poll() is None, log.read_text()[-4000:]
    return d


def _answers(port: int) -> bool:
    try:
        return get_json(port, "/health")[0] == 200
    except OSError:
        return False


def _rows(pg_url: str, table: str) -> dict[str, tuple[Any, ...]]:
    try:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            return {r[0]: r[1:] for r in conn.execute(sql.SQL(
                "SELECT customer_id, email, name, street, phone FROM {}").format(sql.Identifier(table)))}
    except psycopg.errors.UndefinedTable:
        return {}


def _count(pg_url: str, query: str, *params: Any) -> int:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return int(row[0]) if row else 0


def _every_topic(kafka: KafkaConfig) -> dict[str, bytes]:
    """Every key, value and header of every partition of every topic on the broker (internal ones included),
    from the first stored offset to the end, aborted transactional writes included (read_uncommitted)."""
    c = kafka_clients.consumer(kafka, f"kt.sweep.{uuid.uuid4().hex[:8]}", **{
        "enable.partition.eof": True, "isolation.level": "read_uncommitted"})
    out: dict[str, bytearray] = {}
    try:
        wanted: list[TopicPartition] = []
        for name, meta in c.list_topics(timeout=30).topics.items():
            out[name] = bytearray()
            for p in meta.partitions:
                low, high = c.get_watermark_offsets(TopicPartition(name, p), timeout=30, cached=False)
                if high > low:
                    wanted.append(TopicPartition(name, p, low))
        c.assign(wanted)
        left = {(tp.topic, tp.partition) for tp in wanted}
        deadline = time.monotonic() + 240
        while left and time.monotonic() < deadline:
            batch: list[Any] = c.consume(10000, 0.5)
            for m in batch:
                if m.error() is None:
                    out[m.topic()] += (m.key() or b"") + (m.value() or b"")
                    for _, v in m.headers() or ():
                        out[m.topic()] += v or b""
                elif m.error().code() == KafkaError._PARTITION_EOF:
                    left.discard((m.topic(), m.partition()))
        assert not left, f"did not reach the end of {sorted(left)[:5]}"
    finally:
        c.close()
    return {k: bytes(v) for k, v in out.items()}


def _topic_configs(kafka: KafkaConfig, *names: str) -> dict[str, dict[str, str]]:
    admin = kafka_clients.admin(kafka)
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in names])
    return {res.name: {k: v.value for k, v in f.result(30).items()} for res, f in futures.items()}


def _pg_dump(url: str, *args: str) -> bytes:
    run = subprocess.run([str(PG_BIN / "pg_dump"), "-d", url, *args], capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()
    return run.stdout


def _found(values: tuple[str, ...], where: dict[str, bytes]) -> dict[str, list[str]]:
    """Place -> the values found in its bytes (places holding none are left out)."""
    out = {place: [v for v in values if v.encode() in data] for place, data in where.items()}
    return {k: v for k, v in out.items() if v}


def _keys_file(pg_url: str) -> bytes:
    """The keys table's data file after a checkpoint, or b'' when the data directory is not readable here."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
        data = conn.execute("SHOW data_directory").fetchone()[0]  # type: ignore[index]
        rel = conn.execute("SELECT pg_relation_filepath('kafold.subject_keys'::regclass)").fetchone()[0]  # type: ignore[index]
    try:
        return (Path(data) / rel).read_bytes()
    except OSError:
        return b""


@dataclass
class Run:
    u: str
    prefix: str
    table: str
    conf: Path
    pg_url: str
    ann: Person  # forgotten with the CLI
    bob: Person  # forgotten over HTTP
    cat: Person  # kept
    receiver: Receiver
    failing: set[str]
    forgot_at: int = 0  # index in receiver.requests of the first request after the forget
    wrapped: dict[str, bytes] = field(default_factory=dict)

    def after_forget(self) -> list[Req]:
        """Every webhook request received since the first forget."""
        with self.receiver.lock:
            return self.receiver.requests[self.forgot_at:]


@pytest.fixture
def run(kafka_config: KafkaConfig, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Run]:
    u = uuid.uuid4().hex[:10]
    monkeypatch.setenv(MASTER_VAR, base64.b64encode(os.urandom(32)).decode())
    monkeypatch.setenv(TOKEN_VAR, f"token-{u}")
    failing: set[str] = set()

    async def behaviour(req: Req) -> tuple[int, dict[str, str]] | None:
        return (500, {}) if req.key in failing else None

    receiver = Receiver(behaviour)
    prefix, table = f"kt.forget-sweep.{u}", f"sweep_{u}"
    conf = tmp_path / "kafold.toml"
    conf.write_text(_toml(kafka_config, pg_url, prefix, table, receiver.start(), free_port()))
    r = Run(u, prefix, table, conf, pg_url, Person.of("ann", u), Person.of("bob", u), Person.of("cat", u),
            receiver, failing)
    failing.add(r.bob.id)
    try:
        yield r
    finally:
        receiver.stop()


def test_after_a_forget_no_clear_value_of_the_subject_is_anywhere_but_where_the_docs_say(
        run: Run, kafka_config: KafkaConfig, pg_url: str, tmp_path: Path) -> None:
    kafold_cli("topics", "ensure", "-c", str(run.conf), check=True, timeout=120)
    cfg = config.load_file(run.conf).config
    client = Outside(kafka_config, cfg.aggregates[0])
    token = os.environ[TOKEN_VAR]
    daemon = _start(run.conf, tmp_path / "daemon.log", cfg.daemon.http_port, token)
    ann, bob, cat = run.ann, run.bob, run.cat
    try:
        for p in (ann, bob, cat):
            client.send(f"reg-{p.id}", p.id, "Register", {"email": p.email, "name": p.name, "street": p.street})
        client.send(f"phone-{ann.id}", ann.id, "SetPhone", {"phone": f"{ann.phone}\x00"})  # refused: a NUL
        client.send(f"move-{ann.id}", ann.id, "Move", {"street": f"{ann.street} 2"})  # held behind it
        client.send(f"move-{bob.id}", bob.id, "Move", {"street": f"{bob.street} 2"})  # parked with bob's first
        # a command the runtime refuses (an unknown field): dead-lettered on the aggregate's DLQ topic as sent
        bad = {"command_id": f"bad-{ann.id}", "type": "Move", "aggregate_id": ann.id, "data": {"street": ann.street},
               "note": ann.email}
        client.producer.produce(cfg.aggregates[0].topic("commands"), key=ann.id.encode(), value=orjson.dumps(bad),
                                headers=[("kafold-command-id", f"bad-{ann.id}".encode())])
        client.wait(120)
        wait_for(lambda: ann.email.encode() in raw_bytes(kafka_config, cfg.aggregates[0].dlq_topic),
                 "the refused command dead-lettered", 60)
        client.results.pop(f"bad-{ann.id}", None)  # its result, if read meanwhile: rejected
        assert all(r[-1]["status"] == "accepted" for r in client.results.values()), client.results
        wait_for(lambda: _count(pg_url, "SELECT count(*) FROM kafold.dead_letters WHERE connector = %s",
                                run.table) == 2, "ann's dead letter and held event", 120)
        wait_for(lambda: _count(pg_url, "SELECT count(*) FROM kafold.effect_parked WHERE connector = %s",
                                f"hook-{run.table}") == 2, "bob's events parked", 120)
        wait_for(lambda: len(_rows(pg_url, run.table)) == 3, "three rows", 60)
        assert _rows(pg_url, run.table)[cat.id] == (cat.email, cat.name, cat.street, None)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            run.wrapped = {s: bytes(w) for s, w in conn.execute(
                "SELECT subject, wrapped_key FROM kafold.subject_keys WHERE subject = ANY(%s)", ([ann.id, bob.id],))}
        assert sorted(run.wrapped) == sorted([ann.id, bob.id])
        backup = tmp_path / "before-forget.dump"
        backup.write_bytes(_pg_dump(pg_url, "-Fc"))

        # the forgets: ann with the CLI, bob over HTTP
        run.forgot_at = len(run.receiver.requests)
        forget = kafold_cli("subjects", "forget", ann.id, "-c", str(run.conf), "--actor", "dpo", "--yes", "--json",
                            timeout=120)
        assert forget.returncode == 0 and orjson.loads(forget.stdout)["key_deleted"] is True, forget.stderr
        status, body = daemon.call("POST", f"/subjects/{bob.id}/forget")
        assert status == 200 and body["key_deleted"] is True, body

        # what the docs prescribe after a forget: release, discard, refresh; and new traffic of every subject
        run.failing.clear()
        retry = kafold_cli("effects", "parked", "retry", bob.id, "-c", str(run.conf), "--wait", "60", timeout=120)
        assert retry.returncode == 0, retry.stdout + retry.stderr
        with psycopg.connect(pg_url, autocommit=True) as conn:
            head = conn.execute("SELECT id FROM kafold.dead_letters WHERE connector = %s AND reason = 'db-rejected'",
                                (run.table,)).fetchone()
        assert head is not None
        discard = kafold_cli("dlq", "discard", str(head[0]), "-c", str(run.conf), timeout=120)
        assert discard.returncode == 0, discard.stdout + discard.stderr
        wait_for(lambda: _count(pg_url, "SELECT count(*) FROM kafold.dead_letters WHERE connector = %s AND status IN "
                                "('new', 'held')", run.table) == 0, "the held event released", 60)
        for p in (ann, bob):
            refresh = kafold_cli("projection", "refresh", run.table, "--subject", p.id, "-c", str(run.conf),
                                 "--no-progress", timeout=300)
            assert refresh.returncode == 0, refresh.stdout + refresh.stderr
        for p in (ann, bob, cat):
            client.send(f"rename-{p.id}", p.id, "Rename", {"name": f"renamed-{p.id}"})
        client.wait(120)
        wait_for(lambda: {cat.id, ann.id, bob.id} <= {r.key for r in run.after_forget()
                                                      if r.status == 200 and orjson.loads(r.body)["type"] == "Renamed"},
                 "the renames delivered", 120)
        wait_for(lambda: _rows(pg_url, run.table).get(ann.id, ())[1:2] == (f"renamed-{ann.id}",), "renamed", 60)
        kafold_cli("keys", "purge", "-c", str(run.conf), check=True, timeout=120)
        for p in (ann, bob):
            assert daemon.call("GET", f"/aggregates/customer/{p.id}")[1]["state"]["email"] == PLACEHOLDER
        assert daemon.call("GET", f"/aggregates/customer/{cat.id}")[1]["state"]["email"] == cat.email
    finally:
        client.close()
        daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log.read_text()[-4000:]

    released = [orjson.loads(r.body) for r in run.after_forget() if r.key == bob.id and r.status == 200]
    assert {(b["type"], b["payload"].get("email", b["payload"].get("street"))) for b in released} >= {
        ("Registered", PLACEHOLDER), ("Moved", PLACEHOLDER)}  # bob's parked events, released after the forget
    rows = _rows(pg_url, run.table)
    assert rows[ann.id] == (PLACEHOLDER, f"renamed-{ann.id}", PLACEHOLDER, PLACEHOLDER)
    assert rows[bob.id] == (PLACEHOLDER, f"renamed-{bob.id}", PLACEHOLDER, None)

    # ---- the sweep ----
    forgotten = ann.values + bob.values
    places = {f"topic {name}": data for name, data in _every_topic(kafka_config).items()}
    places["pg_dump"] = _pg_dump(pg_url)
    places["keys data file"] = _keys_file(pg_url)
    places["daemon log"] = daemon.log.read_bytes()
    places["webhook bodies after the forget"] = b"\n".join(r.body for r in run.after_forget())
    # the controls: the sweep finds a kept subject's values where they are meant to be
    assert cat.email.encode() in places["pg_dump"]
    assert f"renamed-{cat.id}".encode() in places["webhook bodies after the forget"]
    assert b"kfenc1:" in places[f"topic {run.prefix}.derived"] and b"kfenc1:" in places[f"topic {run.prefix}.events"]
    assert b'"event": "daemon.stopped"' in places["daemon log"]  # the whole log, to the daemon's last line
    # where docs/security.md says a clear value may stay ("Where personal data may stay")
    agg = cfg.aggregates[0]
    allowed = {f"topic {agg.topic('commands')}", f"topic {agg.dlq_topic}"}
    found = _found(forgotten, places)
    assert {p: v for p, v in found.items() if p not in allowed} == {}
    assert set(found) == allowed  # they do hold them: what clients sent
    # ... and keep them no longer than the docs say (config.PROTECTED_COMMANDS_TOPIC_CONFIGS)
    kept = _topic_configs(kafka_config, agg.topic("commands"), agg.dlq_topic)
    assert kept[agg.topic("commands")]["retention.ms"] == "86400000"
    assert kept[agg.topic("commands")]["segment.ms"] == "3600000"
    assert kept[agg.dlq_topic]["retention.ms"] == "604800000"
    if places["keys data file"]:
        assert not any(w in places["keys data file"] for w in run.wrapped.values())

    # ---- a backup from before the forget, restored into a fresh database, then a daemon started on it ----
    restored = f"sweep_restore_{run.u}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(restored)))
    try:
        url = _database(pg_url, restored)
        load = subprocess.run([str(PG_BIN / "pg_restore"), "--no-owner", "-d", url, str(backup)],
                              capture_output=True, timeout=300)
        assert load.returncode == 0, load.stderr.decode()[-4000:]
        with psycopg.connect(url, autocommit=True) as conn:  # the restore alone brings the keys back
            held = conn.execute("SELECT count(*) FROM kafold.subject_keys WHERE subject = ANY(%s)",
                                ([ann.id, bob.id],)).fetchone()
        assert held == (2,)
        conf2 = tmp_path / "restored.toml"
        conf2.write_text(run.conf.read_text().replace(f'url = "{pg_url}"', f'url = "{url}"').replace(
            f"http_port = {cfg.daemon.http_port}", f"http_port = {(port := free_port())}"))
        again = _start(conf2, tmp_path / "restored.log", port, token)
        try:
            for p in (ann, bob):
                wait_for(lambda p=p: again.call("GET", f"/aggregates/customer/{p.id}")[0] == 200,  # type: ignore[misc]
                         "the restored daemon's partitions", 120)
                state = again.call("GET", f"/aggregates/customer/{p.id}")
                assert state[0] == 200 and state[1]["state"]["email"] == PLACEHOLDER, state
                assert state[1]["state"]["street"] == PLACEHOLDER
            assert again.call("GET", f"/aggregates/customer/{cat.id}")[1]["state"]["email"] == cat.email
        finally:
            again.stop()
        with psycopg.connect(url, autocommit=True) as conn:
            held = conn.execute("SELECT count(*) FROM kafold.subject_keys WHERE subject = ANY(%s)",
                                ([ann.id, bob.id],)).fetchone()
        assert held == (0,)
        # the restored projection rows are the backup's, made before the forget: a rebuild folds them again
        assert _rows(url, run.table)[bob.id][0] == bob.email  # what docs/operations.md#backup-and-restore says
        rebuild = kafold_cli("projection", "rebuild", run.table, "-c", str(conf2), timeout=300)
        assert rebuild.returncode == 0, rebuild.stdout + rebuild.stderr
        again_rows = _rows(url, run.table)
        assert [again_rows[p.id][0] for p in (ann, bob, cat)] == [PLACEHOLDER, PLACEHOLDER, cat.email]
        assert _found(forgotten, {"restored pg_dump": _pg_dump(url)}) == {}
        logs = {"restored daemon log": (tmp_path / "restored.log").read_bytes(),
                "webhook bodies after the forget": b"\n".join(r.body for r in run.after_forget())}
        assert _found(forgotten, logs) == {}
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(restored)))



def _database(url: str, name: str) -> str:
    """`url` with another database name (its path)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))
