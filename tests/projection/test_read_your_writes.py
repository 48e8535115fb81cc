"""Read-your-writes on Apache Kafka and PostgreSQL with a real daemon (the bank aggregate, its `accounts`
projection and a `log` sink): a caller that waited on its result's token always reads its own write, across random
interleavings of commands and waits and a daemon restart; a wait not covered in time is reported as such (408,
NotVisible); `kafold.covers` answers inside a read transaction as of that transaction's snapshot; bad tokens are
400 / BadToken / SQLSTATE 22023."""

from __future__ import annotations

import base64
import io
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zlib
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kafold import config, tokens, topics
from kafold.client import BadToken, CommandClient, DaemonClient, NotVisible
from kafold.config import KafkaConfig
from kafold.daemon.host import DaemonHost
from kafold.messages import Result
from kafold.testing import free_port
from kafold.tools import cli
from tests.aggregates.agg_support import accounts_projection_toml, bank_daemon_toml
from tests.daemon.daemon_support import get_json
from tests.support import wait_for

PROJECTION, LOG = "accounts", "audit"


class Bank:
    """A daemon (restartable) of the bank aggregate with a projection and a log sink, and a client of both."""

    def __init__(self, path: Path, kafka: KafkaConfig, pg_url: str, port: int, table: str, unique: str) -> None:
        self.path, self.pg_url, self.port, self.table, self.unique = path, pg_url, port, table, unique
        loaded = config.load_file(path)
        assert topics.ensure(kafka, config.topic_map(loaded.config).values()).ok
        self.agg = loaded.config.aggregates[0]
        self.daemon = DaemonClient(f"http://127.0.0.1:{port}")
        self.client = CommandClient(kafka, self.agg, self.daemon)
        self.restarts = 0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._exit: list[int] = []

    def start(self) -> None:
        loaded = config.load_file(self.path)
        self._stop, self._exit = threading.Event(), []
        host = DaemonHost(loaded.config, loaded.base, self._stop, config_path=self.path)
        self.host = host
        self._thread = threading.Thread(target=lambda: self._exit.append(host.run()), name="test-daemon")
        self._thread.start()

    def stop(self) -> None:
        assert self._stop is not None and self._thread is not None
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive() and self._exit == [0], f"the daemon did not stop cleanly: {self._exit}"

    def restart(self) -> None:
        """Stop cleanly and start again, without waiting for it to be ready (callers meet it recovering)."""
        self.stop()
        self.start()
        self.restarts += 1

    def ready(self) -> None:
        wait_for(lambda: get_json(self.port, "/ready")[0] == 200, "the daemon ready", 120)

    def send(self, account: str, kind: str, data: dict[str, Any]) -> Result:
        result = self.client.send(self.client.command(account, kind, data), timeout=90)
        assert result is not None
        return result

    def balance(self, account: str) -> int | None:
        with psycopg.connect(self.pg_url) as conn:
            row = conn.execute(f'SELECT balance FROM "{self.table}" WHERE account_id = %s', (account,)).fetchone()
        return None if row is None else int(row[0])

    def waits_answered(self, result: str) -> float:
        """kafold_consistency_waits_total of the projection for `result`, as /metrics shows it."""
        return next((s.value for f in text_string_to_metric_families(self.host.metrics.render().decode())
                     for s in f.samples if s.name == "kafold_consistency_waits_total"
                     and s.labels == {"connector": PROJECTION, "result": result}), 0.0)

    def wait(self, token: str, connector: str = PROJECTION, timeout_ms: int = 5000) -> tuple[int, Any]:
        query = urllib.parse.urlencode({"token": token, "timeout_ms": str(timeout_ms)})
        return get_json(self.port, f"/connectors/{connector}/wait?{query}")


@pytest.fixture(scope="module")
def bank(kafka_config: KafkaConfig, pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bank]:
    unique, port = f"kt.ryw.{uuid.uuid4().hex[:8]}", free_port()
    table = f"ryw_{uuid.uuid4().hex[:10]}"
    path = tmp_path_factory.mktemp("ryw") / "kafold.toml"
    path.write_text(f"""
{bank_daemon_toml(kafka_config, unique, port, partitions=2)}
[postgres]
url = "{pg_url}"

{accounts_projection_toml(PROJECTION, unique + ".events", table)}

[[connectors]]
name = "{LOG}"
class = "log"
topics = ["{unique}.events"]
""")
    b = Bank(path, kafka_config, pg_url, port, table, unique)
    b.start()
    try:
        b.ready()
        yield b
    finally:
        b.client.close()
        b.stop()


# ---- the property: whoever waited on its token reads its own write ------------------------------------------------

# A plan: deposits to a few accounts (sent without waiting for visibility), waits on some of them (each followed by a
# read of the account's row), and maybe a daemon restart between two steps.
Step = tuple[str, int, int]  # ("send", account, amount) | ("wait", index of an earlier send, 0)
plans = st.lists(st.one_of(st.tuples(st.just("send"), st.integers(0, 2), st.integers(1, 50)),
                           st.tuples(st.just("wait"), st.integers(0, 30), st.just(0))), min_size=2, max_size=10)

examples = {"n": 0}


def test_a_caller_that_waited_on_its_token_reads_its_own_write(bank: Bank) -> None:
    @settings(max_examples=8, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(plan=plans, restart_at=st.one_of(st.none(), st.integers(0, 10)))
    def prop(plan: list[Step], restart_at: int | None) -> None:
        examples["n"] += 1
        if bank.restarts == 0 and examples["n"] == 3 and restart_at is None:
            restart_at = len(plan) // 2  # at least one restart in the run, wherever the plan stands
        if bank.restarts >= 2:
            restart_at = None  # each one costs a group join and a recovery: two are enough
        accounts = [f"a{uuid.uuid4().hex[:8]}" for _ in range(3)]
        for a in accounts:
            bank.send(a, "OpenAccount", {"owner": a})
        sent: list[tuple[str, int, Result]] = []  # (account, balance after the deposit, its result)
        totals = dict.fromkeys(accounts, 0)
        for i, (kind, x, amount) in enumerate(plan):
            if i == restart_at:
                bank.restart()
            if kind == "send":
                account = accounts[x]
                result = bank.send(account, "Deposit", {"amount": amount})
                assert result.accepted and result.token is not None, result
                totals[account] += amount
                sent.append((account, totals[account], result))
            elif sent:
                account, after, result = sent[x % len(sent)]
                bank.client.wait_visible(result, PROJECTION, timeout=120)
                seen = bank.balance(account)
                # Deposits only add: the row includes this one (and maybe later ones), never less.
                assert seen is not None and seen >= after, (account, seen, after, result)
                bank.client.wait_visible(result, LOG, timeout=120)  # a sink whose truth is its Kafka offsets

    prop()
    assert bank.restarts >= 1


# ---- a wait that is not covered, and the SQL function inside read transactions -----------------------------------

def _pause(bank: Bank, paused: bool) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{bank.port}/connectors/{PROJECTION}/"
                                 f"{'pause' if paused else 'resume'}", method="PUT", data=b"")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status in (200, 202)
    state = "PAUSED" if paused else "RUNNING"
    wait_for(lambda: get_json(bank.port, f"/connectors/{PROJECTION}/status")[1]["connector"]["state"] == state,
             f"the projection {state}")


def test_a_wait_not_covered_in_time_is_reported_and_covers_follows_the_read_snapshot(bank: Bank) -> None:
    bank.ready()
    account = f"t{uuid.uuid4().hex[:8]}"
    opened = bank.send(account, "OpenAccount", {"owner": "ty"})
    bank.client.wait_visible(opened, PROJECTION, timeout=60)
    _pause(bank, True)
    try:
        deposit = bank.send(account, "Deposit", {"amount": 7})
        assert deposit.token is not None
        with pytest.raises(NotVisible, match=f"connector '{PROJECTION}' did not cover the token within 1.0s"):
            bank.client.wait_visible(deposit, PROJECTION, timeout=1.0)
        timeouts = bank.waits_answered("timeout")
        status, body = bank.wait(deposit.token, timeout_ms=300)
        (topic, partition), offset = next(iter(tokens.parse(deposit.token).items()))
        assert status == 408 and body["covered"] is False, body
        assert bank.waits_answered("timeout") == timeouts + 1  # /metrics counts the wait that timed out
        assert [(b["topic"], b["partition"], b["offset"]) for b in body["behind"]] == [(topic, partition, offset)]
        assert body["behind"][0]["committed"] <= offset

        covers = "SELECT kafold.covers(%s, %s)"
        with psycopg.connect(bank.pg_url) as before:
            before.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            with before.transaction():
                assert before.execute(covers, (PROJECTION, deposit.token)).fetchone() == (False,)
                assert before.execute(covers, (PROJECTION, opened.token)).fetchone() == (True,)
                _pause(bank, False)
                covered = bank.waits_answered("covered")
                bank.client.wait_visible(deposit, PROJECTION, timeout=60)
                assert bank.waits_answered("covered") == covered + 1
                # The same snapshot: the deposit is still not covered, and the row read here does not have it.
                assert before.execute(covers, (PROJECTION, deposit.token)).fetchone() == (False,)
                assert before.execute(f'SELECT balance FROM "{bank.table}" WHERE account_id = %s',
                                      (account,)).fetchone() == (0,)
        with psycopg.connect(bank.pg_url) as after:
            # READ COMMITTED: the check in the same statement as the read proves that row includes the deposit.
            row = after.execute(f'SELECT balance, kafold.covers(%s, %s) FROM "{bank.table}" WHERE account_id = %s',
                                (PROJECTION, deposit.token, account)).fetchone()
            assert row == (7, True)
            assert after.execute(covers, ("no-such-connector", deposit.token)).fetchone() == (False,)
    finally:
        _pause(bank, False)


def test_the_cli_waits_until_the_projection_shows_the_command(bank: Bank) -> None:
    bank.ready()
    account = f"c{uuid.uuid4().hex[:8]}"
    bank.send(account, "OpenAccount", {"owner": "cli"})
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(["command", "send", "-c", str(bank.path), "account", account, "Deposit", "--data",
                         '{"amount": 12}', "--wait-visible", PROJECTION, "--timeout", "60"])
    # The daemon of this test runs in this process and logs to the same stdout: the result is the JSON line.
    printed = next(json.loads(line) for line in out.getvalue().splitlines() if line.startswith('{"command_id"'))
    assert code == 0 and printed["status"] == "accepted" and printed["token"].startswith("kf1."), printed
    assert bank.balance(account) == 12  # read after the command returned: no polling


# ---- bad tokens ------------------------------------------------------------------------------------------------

def _forged(body: bytes) -> str:
    return "kf1." + base64.urlsafe_b64encode(body + zlib.adler32(body).to_bytes(4, "big")).rstrip(b"=").decode()


def test_forged_truncated_foreign_and_future_tokens_are_refused(bank: Bank) -> None:
    bank.ready()
    good = tokens.encode({(f"{bank.unique}.events", 0): 0})
    bad = {
        "truncated": good[:-3],
        "altered": good[:6] + ("A" if good[6] != "A" else "B") + good[7:],
        "forged body": _forged(b'{"t":{"0":-4}}'),
        "not a token": "hello",
        "future version": "kf2." + good.removeprefix("kf1."),
    }
    foreign = tokens.encode({("some.other.topic", 0): 3})
    for what, token in bad.items():
        status, body = bank.wait(token)
        assert status == 400 and body["message"].startswith("token: "), (what, body)
        with pytest.raises(BadToken):
            bank.daemon.wait(PROJECTION, token, timeout=5)
        with psycopg.connect(bank.pg_url) as conn, pytest.raises(psycopg.errors.InvalidParameterValue,
                                                                 match=r"kafold\.covers: "):
            conn.execute("SELECT kafold.covers(%s, %s)", (PROJECTION, token))
    status, body = bank.wait(foreign)
    assert status == 400 and "names topic 'some.other.topic', which connector accounts does not read" in \
        body["message"], body
    with pytest.raises(BadToken, match="does not read"):
        bank.daemon.wait(PROJECTION, foreign, timeout=5)
    assert bank.wait(good, connector="nope")[0] == 404
    assert bank.wait(good, timeout_ms=-1)[0] == 400 and bank.wait(good, timeout_ms=10**9)[0] == 400
    status, body = get_json(bank.port, f"/connectors/{PROJECTION}/wait")
    assert status == 400 and "empty" in body["message"]


def test_a_duplicate_repeats_the_token_of_its_first_decision(bank: Bank) -> None:
    bank.ready()
    account = f"d{uuid.uuid4().hex[:8]}"
    bank.send(account, "OpenAccount", {"owner": "dup"})
    command = bank.client.command(account, "Deposit", {"amount": 3})
    first, again = bank.client.send(command, timeout=90), bank.client.send(command, timeout=90)
    assert first is not None and again is not None and again.duplicate and not first.duplicate
    assert first.token is not None and again.token == first.token
    bank.client.wait_visible(again, PROJECTION, timeout=60)
    assert bank.balance(account) == 3


def test_a_duplicate_decided_before_a_restart_carries_a_token_covering_its_first_decision(bank: Bank) -> None:
    bank.ready()
    account = f"r{uuid.uuid4().hex[:8]}"
    bank.send(account, "OpenAccount", {"owner": "restarted"})
    command = bank.client.command(account, "Deposit", {"amount": 4})
    first = bank.client.send(command, timeout=90)
    assert first is not None and first.token is not None and not first.duplicate
    bank.restart()  # the new writer remembers no token: the duplicate's comes from the replay's end
    bank.ready()
    again = bank.client.send(command, timeout=90)
    assert again is not None and again.duplicate and again.token is not None
    (where, offset), = tokens.parse(first.token).items()
    assert tokens.parse(again.token).get(where, -1) >= offset  # it covers the first decision's events
    bank.client.wait_visible(again, PROJECTION, timeout=60)
    assert bank.balance(account) == 4
