"""A `kafold daemon` hosting a domain whose state holds aware datetimes in several UTC offsets and in a named zone
(Europe/Paris, moved across a DST change), tuples, Decimals with exponents and more digits than a float keeps, and
frozen dataclasses nested in a tuple, a dict and each other (tests/aggregates/book_domain.py), on Apache Kafka:
killed -9 in the middle of a command stream with a local state store, then restarted on that store; then, after a
snapshot run (in the kafold process; a Spark job under the `spark` mark) and a tail of commands, started on an empty
state_dir (a new host) that restores from the snapshot topic. Each time the states it serves on
GET /aggregates/book/{id} equal a full replay of the events, field by field with their types (a Decimal's digits and
exponent, a datetime's offset, zone and fold), and the live states read before the kill equal the replay at their
versions."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from kafold import config, topics
from kafold.config import KafkaConfig
from kafold.domain import AggregateDomain
from kafold.testing import free_port
from tests.aggregates.agg_support import KAFOLD, Outside, events, kafold_cli
from tests.daemon.daemon_support import get_json
from tests.support import ROOT, child_env, kafka_toml, wait_for

M = "tests.aggregates.book_domain"
BOOKS = [f"book-{i:02d}" for i in range(12)]
T0 = datetime(2024, 10, 27, 0, 30, tzinfo=UTC)
OFFSETS = [timezone(timedelta(hours=h, minutes=m)) for h, m in ((5, 30), (-3, 0), (0, 0), (14, 0), (-9, -30))]
# quantities and prices a float would spoil: exponents, 20+ significant digits, trailing zeros, a negative
QTYS = ["1E+3", "2.5E-7", "0.000000000000000000123", "12345678901234567.89", "-4.10", "7"]


def _toml(kafka: KafkaConfig, unique: str, port: int, state_dir: Path) -> str:
    return f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{unique}"
http_port = {port}
python_path = ["{ROOT}"]
state_dir = "{state_dir}"
batch_max_records = 5
batch_max_wait_ms = 20

[snapshots]
engine = "local"

[[aggregates]]
name = "book"
initial = "{M}:initial"
evolve = "{M}:evolve"
decide = "{M}:decide"
partitions = 2
cache_max_aggregates = 3
events_topic = "{unique}.events"
commands_topic = "{unique}.commands"
results_topic = "{unique}.results"
snapshot_topic = "{unique}.snapshots"
"""


class Stream:
    """The command stream: per book an OpenBook, then Trades at increasing instants written in rotating offsets
    (some backdated or out of the book's limits: rejected), and CloseBooks at the end."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.minute = dict.fromkeys(BOOKS, 0)
        self.n = 0

    def _at(self, book: str, step: int) -> str:
        self.minute[book] += step
        return (T0 + timedelta(minutes=self.minute[book])).astimezone(self.rng.choice(OFFSETS)).isoformat()

    def _cmd(self, book: str, kind: str, data: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]]:
        self.n += 1
        return f"{book}-{self.n}", book, kind, data

    def opens(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        return [self._cmd(b, "OpenBook", {"at": self._at(b, 0), "owner": b.upper(), "low": "1E-9",
                                          "high": "1E+13"}) for b in BOOKS]

    def trades(self, n: int) -> list[tuple[str, str, str, dict[str, Any]]]:
        out = []
        for i in range(n):
            book = self.rng.choice(BOOKS)
            price = f"{self.rng.randint(1, 10**12)}.{self.rng.randint(0, 10**15):015d}"
            if i % 11 == 10:
                price = "2E+13"  # above the book's limit: rejected
            at = self._at(book, self.rng.randint(1, 90))
            if i % 13 == 12:  # backdated by an hour, in another offset: rejected (compared as instants)
                at = (datetime.fromisoformat(at) - timedelta(hours=1)).astimezone(self.rng.choice(OFFSETS)).isoformat()
            out.append(self._cmd(book, "Trade", {"asset": f"a{self.rng.randrange(4)}",
                                                 "qty": self.rng.choice(QTYS), "price": price, "at": at}))
        return out

    def closes(self, books: list[str]) -> list[tuple[str, str, str, dict[str, Any]]]:
        return [self._cmd(b, "CloseBook", {"at": self._at(b, 5)}) for b in books]


def same(a: Any, b: Any, path: str = "state") -> str | None:
    """Where `a` and `b` differ in value or type, at any depth (a Decimal by its digits and exponent, a datetime by
    its instant, offset, zone and fold); None when they are the same."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} {a!r} != {type(b).__name__} {b!r}"
    if dataclasses.is_dataclass(a):
        return next((d for f in dataclasses.fields(a)
                     if (d := same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}"))), None)
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        return next((d for k in a if (d := same(a[k], b[k], f"{path}[{k!r}]"))), None)
    if isinstance(a, tuple):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True)) if (d := same(x, y, f"{path}[{i}]"))),
                    None)
    if isinstance(a, Decimal):
        return None if a.as_tuple() == b.as_tuple() else f"{path}: {a!r} != {b!r}"
    if isinstance(a, datetime):  # the instant, the offset, the zone (a ZoneInfo or a fixed offset) and the fold
        return None if (a, a.utcoffset(), a.tzinfo, a.fold) == (b, b.utcoffset(), b.tzinfo, b.fold) else \
            f"{path}: {a.isoformat()} ({a.tzinfo!r}) != {b.isoformat()} ({b.tzinfo!r})"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def replay(kafka: KafkaConfig, agg: config.AggregateConfig, domain: AggregateDomain) -> dict[str, list[Any]]:
    """A full replay of the events topic with the domain's own evolve: book -> its states by version (index 0:
    the initial state). Never through the state's JSON form."""
    out: dict[str, list[Any]] = {}
    for e in sorted(events(kafka, agg), key=lambda e: (e["aggregate_id"], e["version"])):
        states = out.setdefault(e["aggregate_id"], [domain.initial()])
        assert e["version"] == len(states), e
        states.append(domain.evolve(states[-1], domain.event(e["type"], e["payload"], e.get("schema_version", 1))))
    return out


def check(served: dict[str, Any], states: list[Any], domain: AggregateDomain, what: str) -> None:
    """A state served as JSON is the replay's at its version: the same JSON (a Decimal's text, a datetime's
    offset), and read back with the domain's types, the same values of the same types at every depth."""
    want = states[served["version"]]
    assert served["state"] == json.loads(json.dumps(domain.state_to_json(want))), (what, served)
    diff = same(domain.state_from_json(served["state"]), want)
    assert diff is None, (what, diff)


def read_all_books(port: int) -> dict[str, dict[str, Any]]:
    got = {}
    for book in BOOKS:
        status, body = get_json(port, f"/aggregates/book/{book}")
        assert status == 200, (book, status, body)
        got[book] = body
    return got


@contextmanager
def daemon(conf: Path, log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`kafold daemon` in a child process (JSON logs to `log`), killed -9 on exit if still running."""
    with log.open("ab") as out:
        proc = subprocess.Popen([KAFOLD, "--log-format", "json", "daemon", "-c", str(conf)], stdout=out,
                                stderr=subprocess.STDOUT, env=child_env(env))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def logged(log: Path, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("event") == event]


def answered(client: Outside, cids: list[str]) -> int:
    for m in client.consumer.consume(1000, 0.1):
        if m.error() is None:
            r = json.loads(m.value())
            client.results.setdefault(r["command_id"], []).append(r)
    return sum(1 for c in cids if c in client.results)


@pytest.mark.apache_kafka
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["local", pytest.param("spark", marks=pytest.mark.spark)])
def test_rich_state_survives_kill_and_snapshot_restore_as_a_full_replay(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, broker_kind: str, engine: str) -> None:
    """`engine`: the snapshot run's, in the kafold process or a Spark job (local[2], its own JVM)."""
    if broker_kind != "kafka":
        pytest.skip("tansu returns aborted transactions' records to read_committed readers (KAFOLD_TEST_BROKER=kafka)")
    if engine == "spark":
        pytest.importorskip("pyspark")
    port = free_port()
    conf = tmp_path / "kafold.toml"
    conf.write_text(_toml(kafka_config, unique, port, tmp_path / "state"))
    loaded = config.load_file(conf)
    agg = loaded.config.aggregates[0]
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    domain = AggregateDomain.load(agg)
    stream = Stream(random.Random(56))
    client = Outside(kafka_config, agg)

    def send(cmds: list[tuple[str, str, str, dict[str, Any]]]) -> list[str]:
        for cid, book, kind, data in cmds:
            client.send(cid, book, kind, data)
        assert client.producer.flush(30) == 0
        return [c[0] for c in cmds]

    def ready() -> bool:
        return get_json(port, "/ready")[0] == 200

    try:
        # (a) kill -9 in the middle of a command stream; the restart trusts its local store and replays the tail
        first_log, second_log = tmp_path / "daemon-1.log", tmp_path / "daemon-2.log"
        with daemon(conf, first_log) as proc:
            wait_for(ready, "the daemon ready", 120)
            send(stream.opens() + stream.trades(60))
            client.wait()
            before = read_all_books(port)  # the live states, every command so far decided
            rest = send(stream.trades(300))
            wait_for(lambda: answered(client, rest) >= 20, "the stream under way", 60)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
        assert answered(client, rest) < len(rest), "the kill came after the stream's end"
        with daemon(conf, second_log) as proc:
            wait_for(ready, "the daemon ready after the kill", 120)
            client.wait()
            assert all(len(client.results[c]) == 1 for c in client.sent), "a command answered twice"
            trusted = logged(second_log, "aggregate.local_store_trusted")
            assert {x["partition"] for x in trusted} == {0, 1}, "the restart did not use its local store"
            after = read_all_books(port)
            assert any(b["read_from"] == "store" for b in after.values()), "no state served from the store"
            replayed = replay(kafka_config, agg, domain)
            for book in BOOKS:
                check(before[book], replayed[book], domain, f"{book} live before the kill")
                check(after[book], replayed[book], domain, f"{book} after the restart")
                assert after[book]["version"] == len(replayed[book]) - 1, book
            outcomes = [r[0]["status"] for r in client.results.values()]
            assert outcomes.count("rejected") > 20 and outcomes.count("accepted") > 200, "the stream did not run"

            # (b) a snapshot run, a tail of commands past it, then a new host: an empty state_dir
            run = kafold_cli("snapshot", "run", "-c", str(conf), "--engine", engine, "--master", "local[2]",
                             "--no-progress", check=True).stdout
            assert any(line.split()[:2] == ["book", engine] for line in run.splitlines()), run
            send(stream.trades(40) + stream.closes(BOOKS[::2]))
            client.wait()
        third_log = tmp_path / "daemon-3.log"
        with daemon(conf, third_log, {"KAFOLD_DAEMON__STATE_DIR": str(tmp_path / "new-host")}):
            wait_for(ready, "the daemon ready on a new host", 120)
            restored = read_all_books(port)
        caught_up = logged(third_log, "aggregate.caught_up")
        assert {x["partition"] for x in caught_up} == {0, 1}
        assert all(x["snapshot_version"] is not None and x["start"] > 0 for x in caught_up), caught_up
        replayed = replay(kafka_config, agg, domain)
        for book in BOOKS:
            check(restored[book], replayed[book], domain, f"{book} restored from the snapshot topic")
            assert restored[book]["version"] == len(replayed[book]) - 1, book
        assert {b["state"]["status"] for b in restored.values()} == {"open", "closed"}
        # `kafold state get`: another process restoring from the snapshot topic + events, the same state
        got = json.loads(kafold_cli("state", "get", "book", BOOKS[0], "-c", str(conf), check=True).stdout)
        assert got["obtained"]["snapshots_used_in_partition"] > 0
        check(got, replayed[BOOKS[0]], domain, "kafold state get")
    finally:
        client.close()
