"""A burst of control calls on one connector (pause, restart twice, restart task 0, a reload that changes it, then
resume or pause), sent from several threads at once to a running daemon projecting into PostgreSQL on a real broker:
the calls are applied one at a time, so no task runner is left behind (runners started = stopped + running), the
final state is the last call's, and the connector projects (or, paused, does not)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kafold import config
from kafold.config import KafkaConfig, PostgresConfig
from kafold.daemon.host import DaemonHost
from kafold.daemon.tasks import TaskSlot
from kafold.envelope import Event
from kafold.errors import RetriableError
from kafold.schema import toml_value
from tests.daemon.test_daemon_http import metric_samples
from tests.projection.projection_support import COLUMNS, RULES, deposited, encoded, opened, read_table, table_name
from tests.support import create_topic, free_port, kafka_toml, produce, wait_for

NAME = "proj"
ROUNDS = 6  # each round on the code before the fix left runners behind; several make the failure certain


def _write_config(path: Path, kafka: KafkaConfig, pg_url: str, unique: str, topic: str, table: str, port: int,
                  on_unknown: str = "skip") -> None:
    rules = "".join("\n[[connectors.config.on]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in rule.items())
                    for rule in RULES)
    path.write_text(f"""
{kafka_toml(kafka)}
[postgres]
url = "{pg_url}"

[daemon]
group_prefix = "{unique}"
http_port = {port}
batch_max_records = 50
batch_max_wait_ms = 100
shutdown_grace_s = 5

[[connectors]]
name = "{NAME}"
class = "postgres-projection"
topics = ["{topic}"]
on_unknown_type = "{on_unknown}"

[connectors.config]
table = "{table}"
key_columns = ["account_id"]
columns = {toml_value(COLUMNS)}
{rules}
""")


@contextmanager
def _daemon(path: Path) -> Iterator[DaemonHost]:
    """The daemon of `path` in a thread, with its configuration file (so POST /reload works); stopped cleanly."""
    loaded = config.load_file(path)
    stop = threading.Event()
    host = DaemonHost(loaded.config, loaded.base, stop, config_path=path)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(host.run()), name="test-daemon")
    thread.start()
    try:
        yield host
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and result == [0], f"the daemon did not stop cleanly: {result}"


def _call(port: int, method: str, path: str) -> int:
    """One call on its own connection (urllib: a client that is not kafold's); the HTTP status."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=b"" if method in ("PUT", "POST") else None)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _status(port: int) -> tuple[str, list[str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/connectors/{NAME}/status", timeout=10) as resp:
        body = json.loads(resp.read())
    return body["connector"]["state"], [t["state"] for t in body["tasks"]]


class Runners:
    """Every task slot the daemon ever showed for the connector (a reload replaces them), and their counts."""

    def __init__(self, host: DaemonHost) -> None:
        self.host = host
        self.seen: dict[int, TaskSlot] = {}
        self.current()

    def current(self) -> list[TaskSlot]:
        group = self.host.group(NAME)
        slots = list(group.slots) if group is not None else []
        self.seen.update({id(s): s for s in slots})
        return slots

    def check(self) -> dict[str, int]:
        """Started = stopped + running, over every slot seen: a runner nobody stopped is a leak."""
        current = self.current()
        counts = [s.runners for s in self.seen.values()]
        started, stopped = sum(c["started"] for c in counts), sum(c["stopped"] for c in counts)
        running = sum(s.runners["running"] for s in current)
        assert started == stopped + running, f"runners: {started} started, {stopped} stopped, {running} running"
        assert running == len(current), f"{running} runners for {len(current)} tasks"
        return {"started": started, "stopped": stopped, "running": running}


def _burst(port: int, path: Path, rewrite: Any, last: str, with_reload: bool) -> None:
    """Pause, restart twice, restart task 0 (and a reload) at once from several threads; then `last`."""
    calls = [("PUT", f"/connectors/{NAME}/pause"), ("POST", f"/connectors/{NAME}/restart"),
             ("POST", f"/connectors/{NAME}/restart"), ("POST", f"/connectors/{NAME}/tasks/0/restart")]
    if with_reload:
        rewrite()
        calls.append(("POST", "/reload"))
    barrier = threading.Barrier(len(calls))

    def send(call: tuple[str, str]) -> int:
        barrier.wait()
        return _call(port, *call)

    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(send, calls))
    assert all(200 <= a < 300 for a in answers), dict(zip((p for _, p in calls), answers, strict=True))
    assert _call(port, "PUT", f"/connectors/{NAME}/{last}") == 202


def _projected(pg: PostgresConfig, table: str, account: str) -> dict[str, Any] | None:
    try:
        return read_table(pg, table).get(account)
    except (psycopg.Error, RetriableError):  # the table is made by the task's first start
        return None


def _events(account: str) -> list[Event]:
    return [opened(account), deposited(account, 2, 5), deposited(account, 3, 7)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("last", ["resume", "pause"])
def test_a_burst_of_control_calls_is_applied_in_order_and_leaves_no_runner_behind(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path,
        last: str) -> None:
    topic, table, port = f"{unique}.events", table_name(), free_port()
    create_topic(kafka_config, topic, partitions=2)
    path = tmp_path / "kafold.toml"
    modes = iter(["dead-letter", "skip"] * ROUNDS)

    def rewrite() -> None:  # a change of the connector's settings: the reload restarts it
        _write_config(path, kafka_config, pg_url, unique, topic, table, port, next(modes))

    _write_config(path, kafka_config, pg_url, unique, topic, table, port)
    produce(kafka_config, topic, encoded(_events("acc-0"), 2))
    with _daemon(path) as host:
        runners = Runners(host)
        wait_for(lambda: _projected(pg_config, table, "acc-0") is not None, "the first events projected", 90)
        for r in range(1, ROUNDS + 1):
            final = last if r == ROUNDS else "resume"
            _burst(port, path, rewrite, final, with_reload=r % 2 == 0)
            expected = "PAUSED" if final == "pause" else "RUNNING"

            def settled(expected: str = expected) -> bool:
                runners.check()  # at every look, from the moment the calls returned
                return _status(port) == (expected, [expected])

            wait_for(settled, f"round {r}: the connector {expected}", 90)
            account = f"acc-{r}"
            produce(kafka_config, topic, encoded(_events(account), 2))
            if final == "resume":
                def projected(account: str = account) -> bool:
                    return (_projected(pg_config, table, account) or {}).get("balance") == 12

                wait_for(projected, f"round {r}: the events produced after the burst projected", 90)
            else:
                runner = runners.current()[0].runner
                polls: int = runner.counts["polls"]
                wait_for(lambda: runner.counts["polls"] >= polls + 30, "more polls while paused", 60)  # noqa: B023
                assert _projected(pg_config, table, account) is None, "projected while paused"
                assert _status(port) == ("PAUSED", ["PAUSED"])
            counts = runners.check()
        # At least one restart per round (a restart queued behind a reload is already done by it, so skipped).
        assert counts["running"] == 1 and counts["started"] > ROUNDS
        # The same counts on /metrics (since the last reload: a reload replaces the task's slot).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        key = (("connector", NAME), ("task", "0"))
        started, stopped, running = (metric_samples(text, f"kafold_task_runners_{n}")[key]
                                     for n in ("started_total", "stopped_total", "running"))
        assert started == stopped + running and running == 1, (started, stopped, running)
