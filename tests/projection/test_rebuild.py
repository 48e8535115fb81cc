"""Blue-green rebuilds: under live traffic that never pauses the rebuild converges and swaps, and the swapped table
equals the live result; a rebuild killed while copying or in the tail phase resumes and finishes."""

from __future__ import annotations

import contextlib
import itertools
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from kafold import db
from kafold.config import KafkaConfig, KafoldConfig, PostgresConfig
from kafold.connectors.projection import rebuild as rb
from kafold.connectors.projection import rebuild_state
from kafold.envelope import Event
from tests.projection.projection_support import (
    dead_letters,
    deposited,
    encoded,
    ends_of,
    fold,
    history,
    opened,
    read_table,
    running,
    settings,
    stored_offsets,
    table_name,
    wait_for_offsets,
)
from tests.projection.test_projection_kill9 import write_config
from tests.support import create_topic, new_producer, produce, wait_for

PARTITIONS = 4


def _oid(pgc: PostgresConfig, table: str) -> int | None:
    with db.connect(pgc) as conn:
        row = conn.execute("SELECT to_regclass(%s)::oid", (f"public.{table}",)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def _count(pgc: PostgresConfig, query: str, *params: Any) -> int:
    with db.connect(pgc) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def traffic(first_accounts: int, new_accounts: int) -> Iterator[Event]:
    """Endless live traffic: new accounts open, then every account keeps receiving deposits (versions in order;
    deposits to closed accounts are ignored by both the projection and the fold)."""
    version = {a: 12 for a in range(first_accounts)}  # history() used versions up to 11 (the closes)
    for a in range(first_accounts, first_accounts + new_accounts):
        yield opened(f"acc-{a}", f"owner-{a}")
        version[a] = 2
    for r in itertools.count():
        for a in sorted(version):
            yield deposited(f"acc-{a}", version[a], (a + r) % 97 + 1)
            version[a] += 1


class Producer(threading.Thread):
    """Produces live traffic at a constant pace, in small chunks, until stopped (it never pauses for the rebuild);
    keeps every event and its coordinates."""

    def __init__(self, kafka: KafkaConfig, topic: str, source: Iterator[Event], chunk: int = 40) -> None:
        super().__init__(daemon=True)
        self.kafka, self.topic, self.source, self.chunk = kafka, topic, source, chunk
        self.events: list[Event] = []
        self.coords: list[tuple[int, int]] = []
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            producer = new_producer(self.kafka)  # one client throughout, as a service's would be
            while not self.halt.is_set():
                batch = list(itertools.islice(self.source, self.chunk))
                self.coords += produce(self.kafka, self.topic, encoded(batch, PARTITIONS), producer, flush_s=60)
                self.events += batch
                self.halt.wait(0.05)  # pacing only: the test asserts no timing
        except BaseException as e:  # surfaced by the test
            self.error = e

    def produced(self, n: int) -> bool:
        """At least `n` events produced so far; raises the producer's error if it stopped on one."""
        if self.error is not None:
            raise AssertionError(f"the producer stopped: {self.error!r}")
        return len(self.events) >= n


class Reader(threading.Thread):
    """Reads the live table over and over, as a service would, recording any error."""

    def __init__(self, pgc: PostgresConfig, table: str) -> None:
        super().__init__(daemon=True)
        self.pgc, self.table = pgc, table
        self.reads = 0
        self.errors: list[BaseException] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with db.connect(self.pgc) as conn:
            while not self.halt.is_set():
                try:
                    conn.execute(f'SELECT count(*), sum(balance) FROM public."{self.table}"').fetchone()
                    self.reads += 1
                except psycopg.Error as e:
                    self.errors.append(e)
                self.halt.wait(0.01)


class RacedRebuild(rb.Rebuild):
    """Lets the live connector move ahead of the shadow before each swap attempt, so that the swap surely applies a
    tail while it holds the lock (what a busy live connector causes anyway)."""

    def _converge(self, consumer: Any) -> None:
        def live_ahead() -> bool:
            live = rebuild_state.offsets(self.plan.pgc, self.plan.name)
            return any(off > self.positions.get(tp, 0) for tp, off in live.items())
        wait_for(live_ahead, "the live connector to move ahead")
        super()._converge(consumer)


@pytest.mark.timeout(300)
def test_rebuild_under_live_traffic_swaps_in_a_table_equal_to_the_live_result(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str) -> None:
    topic, table, control = f"{unique}.events", table_name(), table_name()
    create_topic(kafka_config, topic, partitions=PARTITIONS)
    first = history(accounts=200, deposits=9, close_every=7)
    coords = produce(kafka_config, topic, encoded(first, PARTITIONS))
    live_cfg = settings(unique, topic, table)
    control_cfg = settings(f"{unique}-control", topic, control)  # the same projection, never rebuilt
    plan = rb.plan(KafoldConfig(kafka=kafka_config, postgres=pg_config, connectors=[live_cfg, control_cfg]),
                   Path("."), unique)
    with running(kafka_config, pg_config, live_cfg, unique, batch=200) as live, \
            running(kafka_config, pg_config, control_cfg, f"{unique}-c", batch=200) as ctrl:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), live)
        wait_for_offsets(pg_config, control_cfg.name, topic, ends_of(coords), ctrl)
        old_oid, live_conn = _oid(pg_config, table), live.task.writer.conn  # type: ignore[attr-defined]
        producer, reader = Producer(kafka_config, topic, traffic(200, 50)), Reader(pg_config, table)
        producer.start()
        reader.start()
        try:
            wait_for(lambda: producer.produced(400), "live traffic to flow")
            reports: list[rb.Progress] = []
            rebuild = RacedRebuild(plan, batch=100, max_tail=300, workers=2, on_progress=reports.append)
            produced_at_start = len(producer.events)
            result = rebuild.run()
            produced_at_swap = len(producer.events)
            assert producer.is_alive() and produced_at_swap > produced_at_start, producer.error  # flowed throughout
            assert result.phase == "swapped" and rebuild.tail > 0, (result, rebuild.tail)
            assert 0 < rebuild.copied_by_workers < rebuild.events, (rebuild.copied_by_workers, rebuild.events)
            # The bar's "behind" figure: records behind the live connector while copying, 0 at the swap.
            assert max(r.behind for r in reports) > 0, reports[:5]
            assert reports[-1].phase == "swapped" and reports[-1].behind == 0 and result.behind == 0, reports[-3:]
            assert [r.phase for r in reports if r.phase == "swapping"]  # the tail applied under the lock
            # The live writer keeps running on the same session while traffic continues after the swap.
            wait_for(lambda: producer.produced(produced_at_swap + 400), "traffic after the swap")
        finally:
            producer.halt.set()
            producer.join(30)
            reader.halt.set()
            reader.join(30)
        assert producer.error is None
        all_events, all_coords = first + producer.events, coords + producer.coords
        wait_for_offsets(pg_config, unique, topic, ends_of(all_coords), live)
        wait_for_offsets(pg_config, control_cfg.name, topic, ends_of(all_coords), ctrl)
        assert not live.failed and live.task.writer.conn is live_conn  # type: ignore[attr-defined]
    new_oid = _oid(pg_config, table)
    assert new_oid is not None and new_oid != old_oid  # the shadow became the live table
    assert _oid(pg_config, plan.shadow) is None and old_oid not in _oids_of(pg_config)  # old one dropped
    assert reader.reads > 0 and reader.errors == []  # the live table kept serving through the swap
    expected = fold(all_events)
    assert read_table(pg_config, table) == expected  # events after the swap landed in the new table
    assert read_table(pg_config, control) == expected  # ...which is what it would be without the rebuild
    state = rebuild_state.state(pg_config, unique)
    assert state is not None and state["phase"] == "swapped"
    assert stored_offsets(pg_config, plan.key, topic) == {}
    assert _count(pg_config, "SELECT count(*) FROM kafold.tracking WHERE projection = %s", plan.key) == 0


def _oids_of(pgc: PostgresConfig) -> set[int]:
    with db.connect(pgc) as conn:
        return {int(r[0]) for r in conn.execute("SELECT oid FROM pg_class WHERE relkind = 'r'").fetchall()}


@pytest.mark.timeout(300)
def test_a_rebuild_killed_halfway_resumes_and_finishes_correctly(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=2)
    events = history(accounts=800, deposits=24, close_every=9)  # a copy of a few seconds: room to kill it halfway
    poison = (1, b"acc-1", b"not an envelope", None)  # dead-lettered by the live connector and by the rebuild
    # Late duplicates of a closed account's events (acc-0): the live connector (deduplicating by version, the
    # default here) and the rebuild (resumed, nothing of it in memory) both know them by acc-0's tombstone.
    late = events[:3]
    coords = produce(kafka_config, topic, [*encoded(events[:5000], 2), poison, *encoded(events[5000:], 2),
                                           *encoded(late, 2)])
    with running(kafka_config, pg_config, settings(unique, topic, table), unique, batch=1000) as live:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), live)
    conf = write_config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, topic, table)
    log = tmp_path / "rebuild.log"
    cmd = [str(Path(sys.executable).parent / "kafold"), "--log-format", "json", "projection", "rebuild", unique,
           "-c", str(conf), "--batch", "20", "--max-tail", "500", "--workers", "2"]

    def covered() -> int:
        state = rebuild_state.state(pg_config, unique)
        return int(state["events"]) if state is not None else 0

    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    workers: list[psutil.Process] = []

    def under_way() -> bool:
        # The copy workers are noted as soon as they show (multiprocessing's spawned interpreters), not only when
        # the progress is seen: on a fast moment the copy of these events takes about a second.
        if len(workers) < 2 and proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                workers[:] = [c for c in psutil.Process(proc.pid).children()
                              if any("spawn_main" in part for part in c.cmdline())]
        return (len(workers) >= 2 and covered() >= 1000) or proc.poll() is not None

    try:
        wait_for(under_way, "the rebuild to be under way", 60)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert len(workers) >= 2, f"the copy workers were not running; see {log}"
    wait_for(lambda: all(_gone(w) for w in workers), "the copy workers to stop with their parent", 60)
    before = rebuild_state.state(pg_config, unique)
    assert before is not None and before["phase"] in rebuild_state.ACTIVE, f"not killed halfway; see {log}"
    assert 0 < before["events"] < len(events)
    # The daemon's /metrics shows the rebuild under way, read from PostgreSQL.
    gauges = _rebuild_gauges(kafka_config, pg_config, unique, topic, table)
    assert gauges == {"phase": before["phase"], "kafold_rebuild_active": 1.0,
                      "kafold_rebuild_offsets_covered": float(before["events"]),
                      "kafold_rebuild_offsets_behind": gauges["kafold_rebuild_offsets_behind"],
                      "kafold_projection_held_keys": 0.0}
    # What the shadow's checkpoints are behind the live ones (0 when the copy workers reached the targets just
    # before the kill, which is still a rebuild under way: the swap is pending): the gauge shows PostgreSQL's view.
    assert gauges["kafold_rebuild_offsets_behind"] == rebuild_state.progress(pg_config, unique)[2]  # type: ignore[index]
    shown = subprocess.run([*cmd[:4], "status", unique, "-c", str(conf)], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0 and before["phase"] in shown.stdout and "behind" in shown.stdout
    with open(log, "ab") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == 0, f"see {log}"
    after = rebuild_state.state(pg_config, unique)
    assert after is not None and after["phase"] == "swapped"
    assert after["started_at"] == before["started_at"]  # resumed, not restarted
    assert "rebuild.resumed" in log.read_text()
    assert read_table(pg_config, table) == fold(events) and "acc-0" not in read_table(pg_config, table)
    assert [d[:2] for d in dead_letters(pg_config, unique)] == [(topic, 1)]  # recorded once, by the live one
    assert _count(pg_config, "SELECT count(*) FROM kafold.tombstones WHERE namespace = %s", f"{unique}:rebuild") == 0
    assert dead_letters(pg_config, f"{unique}:rebuild") == []
    assert _oid(pg_config, f"{table[:48]}_kafold_rebuild") is None
    after_gauges = _rebuild_gauges(kafka_config, pg_config, unique, topic, table)
    assert after_gauges["kafold_rebuild_active"] == 0.0 and after_gauges["kafold_rebuild_offsets_behind"] == 0.0
    assert after_gauges["phase"] == "swapped"


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _rebuild_gauges(kafka: KafkaConfig, pgc: PostgresConfig, name: str, topic: str, table: str) -> dict[str, Any]:
    """The rebuild gauges a daemon hosting this projection exports (its metrics collector, fed by the host's
    connector groups), and under "phase" the one kafold_rebuild_phase shows as current."""
    from kafold.config import DaemonConfig
    from kafold.connectors.registry import instantiate
    from kafold.daemon.metrics import ConnectorCollector
    from kafold.daemon.tasks import ConnectorGroup, TaskSlot

    connector = instantiate(settings(name, topic, table), Path("."))
    slot = TaskSlot(connector, connector.task_configs(1)[0].with_services(kafka, pgc), kafka, DaemonConfig())
    collector = ConnectorCollector(lambda: [ConnectorGroup(connector, [slot])])
    families = list(collector.collect())
    (phase,) = [s.labels["phase"] for f in families if f.name == "kafold_rebuild_phase" for s in f.samples
                if s.value == 1.0 and s.labels["connector"] == name]
    return {"phase": phase} | {family.name: family.samples[0].value for family in families
                               if family.samples and family.samples[0].labels == {"connector": name}}


def test_rebuild_of_an_unknown_connector_is_a_clear_error_naming_it(tmp_path: Path) -> None:
    conf = write_config(tmp_path / "kafold.toml", KafkaConfig(bootstrap_servers="127.0.0.1:1"),
                        "postgresql://nobody@127.0.0.1:1/none", "known", "t.events", "accounts")
    for action in ("rebuild", "status"):
        done = subprocess.run([str(Path(sys.executable).parent / "kafold"), "projection", action, "nope", "-c",
                               str(conf)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2  # a configuration error, found before connecting to anything
        assert "no connector named 'nope'" in done.stderr and "configured: known" in done.stderr


def test_rebuild_with_keep_old_keeps_the_replaced_table_beside_the_new_one(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str) -> None:
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=2)
    events = history(accounts=60, deposits=5, close_every=11)
    coords = produce(kafka_config, topic, encoded(events, 2))
    live_cfg = settings(unique, topic, table)
    plan = rb.plan(KafoldConfig(kafka=kafka_config, postgres=pg_config, connectors=[live_cfg]), Path("."), unique)
    with running(kafka_config, pg_config, live_cfg, unique, batch=100) as live:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), live)
        old_oid = _oid(pg_config, table)
        result = rb.Rebuild(plan, keep_old=True, batch=50).run()
    assert result.phase == "swapped"
    expected = fold(events)
    assert read_table(pg_config, table) == expected and _oid(pg_config, table) != old_oid
    with db.connect(pg_config) as conn:
        kept = conn.execute("SELECT c.relname, (SELECT conname FROM pg_constraint WHERE conrelid = c.oid AND "
                            "contype = 'p') FROM pg_class c WHERE c.oid = %s", (old_oid,)).fetchone()
    assert kept is not None and kept[0].startswith(f"{table[:40]}_old_")  # the replaced table, renamed, kept
    assert kept[1] == f"{kept[0]}_pkey"  # its primary key renamed along, so the names do not clash
    assert read_table(pg_config, kept[0]) == expected  # it held the live result at the swap


@pytest.mark.timeout(300)
def test_a_rebuild_killed_in_the_tail_phase_resumes_and_finishes_under_traffic(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    """A long report query keeps the swap from locking the live table: the rebuild stays in the tail phase,
    retrying with a backoff, and is killed there; run again once the query is gone, it resumes and swaps while the
    traffic never stopped."""
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=PARTITIONS)
    first = history(accounts=100, deposits=5, close_every=9)
    coords = produce(kafka_config, topic, encoded(first, PARTITIONS))
    conf = write_config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, topic, table)
    log = tmp_path / "rebuild.log"
    cmd = [str(Path(sys.executable).parent / "kafold"), "--log-format", "json", "projection", "rebuild", unique,
           "-c", str(conf), "--batch", "50", "--max-tail", "400"]
    live_cfg = settings(unique, topic, table)
    with running(kafka_config, pg_config, live_cfg, unique, batch=100) as live:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), live)
        producer = Producer(kafka_config, topic, traffic(100, 20), chunk=20)
        producer.start()
        try:
            with db.connect(pg_config, autocommit=False) as report:  # ACCESS SHARE until rolled back
                report.execute(f'SELECT count(*) FROM public."{table}"').fetchone()
                with open(log, "ab") as out:
                    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
                try:
                    wait_for(lambda: "rebuild.retrying" in log.read_text() or proc.poll() is not None,
                             "a swap attempt to be refused the lock", 120)
                finally:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                report.rollback()
            before = rebuild_state.state(pg_config, unique)
            assert before is not None and before["phase"] == "catching-up", f"not in the tail phase; see {log}"
            assert "was not locked within" in log.read_text()
            with open(log, "ab") as out:
                done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=120)
            assert done.returncode == 0, f"see {log}"
            assert producer.is_alive()  # the traffic never paused
            produced_at_swap = len(producer.events)
            wait_for(lambda: len(producer.events) >= produced_at_swap + 100, "traffic after the swap")
        finally:
            producer.halt.set()
            producer.join(30)
        assert producer.error is None
        all_events, all_coords = first + producer.events, coords + producer.coords
        wait_for_offsets(pg_config, unique, topic, ends_of(all_coords), live)
        assert not live.failed
    after = rebuild_state.state(pg_config, unique)
    assert after is not None and after["phase"] == "swapped" and after["started_at"] == before["started_at"]
    text = log.read_text()
    assert "rebuild.resumed" in text and "rebuild.swapped" in text
    assert read_table(pg_config, table) == fold(all_events)
