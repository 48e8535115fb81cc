"""The `kafold dev` stack: idempotent start, detached processes, clean stop, filling in empty addresses."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import psycopg
import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from kafold.config import KafkaConfig, KafoldConfig, PostgresConfig
from kafold.daemon.aggregates.recovery import bounds
from kafold.retry import retrying
from kafold.testing import free_port, wait_for
from kafold.tools.commands import dev as dev_cmd
from kafold.tools.dev import apache_kafka
from kafold.tools.dev import stack as devstack

NO_BROKER = ("no broker configured and no `kafold dev` stack running — run `kafold dev up` or set "
             "[kafka].bootstrap_servers")
NO_PG = ("no PostgreSQL configured and no `kafold dev` stack running — run `kafold dev up` or set "
         "[postgres].url")


def _processes(state_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line mentions the state dir (tansu's does not: matched by port)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(state_dir) in cmd:
            out.append(p)
    return out


def _family(stack: devstack.DevStack) -> list[int]:
    pids = [stack.broker.pid, stack.postgres.pid]
    pids += [c.pid for c in psutil.Process(stack.postgres.pid).children(recursive=True)]
    return pids


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    dev_cmd.register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return int(args.handler(args))


@pytest.mark.integration
@pytest.mark.tansu  # the default dev stack (tansu)
def test_up_is_idempotent_and_down_leaves_no_process(tmp_path: Path) -> None:
    stack = devstack.up(tmp_path)
    try:
        assert devstack.up(tmp_path) == stack  # second up: same processes, same addresses
        assert devstack.status(tmp_path) == stack
        AdminClient({"bootstrap.servers": stack.bootstrap_servers}).list_topics(timeout=10)
        with psycopg.connect(stack.postgres_url) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
        family = _family(stack)
    finally:
        assert devstack.down(tmp_path) is True
    assert _gone(family)
    assert _processes(tmp_path) == []
    assert devstack.status(tmp_path) is None
    assert devstack.down(tmp_path) is False  # nothing left to stop


@pytest.mark.integration
@pytest.mark.tansu  # the default dev stack (tansu)
def test_an_ungraceful_down_kills_the_whole_stack_at_once(tmp_path: Path) -> None:
    family = _family(devstack.up(tmp_path))
    assert devstack.down(tmp_path, graceful=False) is True
    assert _gone(family)
    assert _processes(tmp_path) == []
    assert devstack.status(tmp_path) is None


def test_a_process_that_ignores_sigterm_is_killed_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devstack, "STOP_TIMEOUT_S", 0.5)
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline()  # its handler is in place
    devstack._stop(devstack.Proc.of(proc.pid), signal.SIGTERM)  # reaps it: our child
    assert not psutil.pid_exists(proc.pid)


def test_a_zombie_that_nothing_reaps_counts_as_stopped() -> None:
    # a grandchild whose parent never waits for it: a zombie, as a killed postmaster is where pid 1 does not reap
    code = "import subprocess, sys, time; p = subprocess.Popen(['true']); print(p.pid, flush=True); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        zombie = psutil.Process(int(parent.stdout.readline()))
        wait_for(lambda: zombie.status() == psutil.STATUS_ZOMBIE, "the grandchild to exit")
        assert devstack._wait_gone([zombie], devstack.KILL_TIMEOUT_S) == []
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.integration
@pytest.mark.tansu  # the default dev stack (tansu)
def test_postgres_data_survives_a_restart_of_the_stack(tmp_path: Path) -> None:
    try:
        with psycopg.connect(devstack.up(tmp_path).postgres_url, autocommit=True) as conn:
            conn.execute("create table kept (x int)")
        devstack.down(tmp_path)
        with psycopg.connect(devstack.up(tmp_path).postgres_url) as conn:
            assert conn.execute("select count(*) from kept").fetchone() == (0,)
    finally:
        devstack.down(tmp_path)


@pytest.mark.integration
@pytest.mark.tansu  # the default dev stack (tansu)
def test_a_fresh_start_drops_postgres_data_but_never_under_a_running_server(tmp_path: Path) -> None:
    try:
        with psycopg.connect(devstack.up(tmp_path).postgres_url, autocommit=True) as conn:
            conn.execute("create table kept (x int)")
        with psycopg.connect(devstack.up(tmp_path, fresh=True).postgres_url) as conn:  # running: left alone
            assert conn.execute("select to_regclass('kept') is not null").fetchone() == (True,)
        devstack.down(tmp_path)
        with psycopg.connect(devstack.up(tmp_path, fresh=True).postgres_url) as conn:
            assert conn.execute("select to_regclass('kept') is not null").fetchone() == (False,)
    finally:
        devstack.down(tmp_path)
    assert _processes(tmp_path) == []


@pytest.mark.integration
@pytest.mark.tansu  # the default dev stack (tansu)
def test_a_dead_broker_is_restarted_on_the_same_port(tmp_path: Path) -> None:
    try:
        first = devstack.up(tmp_path)
        psutil.Process(first.broker.pid).kill()
        psutil.Process(first.broker.pid).wait(10)
        assert devstack.status(tmp_path) is None
        second = devstack.up(tmp_path)
        assert second.broker.pid != first.broker.pid and second.postgres == first.postgres
        assert second.bootstrap_servers == first.bootstrap_servers
    finally:
        devstack.down(tmp_path)
    assert _processes(tmp_path) == []


@pytest.mark.integration
@pytest.mark.tansu  # the default dev stack (tansu)
def test_stack_outlives_the_process_that_started_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = "import sys; from pathlib import Path; from kafold.tools.dev import stack; stack.up(Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60, capture_output=True)
    try:
        stack = devstack.status(tmp_path)
        assert stack is not None
        assert _cli(["dev", "status", "--state-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"export KAFOLD_KAFKA__BOOTSTRAP_SERVERS={stack.bootstrap_servers}" in out
        assert "export KAFOLD_POSTGRES__URL=" in out and f"export KAFOLD_DEV_DIR={tmp_path}" in out
        family = _family(stack)
    finally:
        assert _cli(["dev", "down", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "stopped"
    assert _gone(family) and _processes(tmp_path) == []
    assert _cli(["dev", "status", "--state-dir", str(tmp_path)]) == 1


def test_effective_names_every_missing_address_when_no_stack_runs(tmp_path: Path) -> None:
    with pytest.raises(devstack.NotRunningError) as err:
        devstack.effective(KafoldConfig(), state_dir=tmp_path)
    assert str(err.value) == f"{NO_BROKER}\n{NO_PG}"
    with pytest.raises(devstack.NotRunningError) as err:
        devstack.effective(KafoldConfig(), state_dir=tmp_path, need=("kafka",))
    assert str(err.value) == NO_BROKER


def test_effective_keeps_configured_addresses_without_a_stack(tmp_path: Path) -> None:
    cfg = KafoldConfig(kafka=KafkaConfig(bootstrap_servers="k:9092"), postgres=PostgresConfig(url="postgresql://h/d"))
    assert devstack.effective(cfg, state_dir=tmp_path) is cfg


def test_effective_fills_only_empty_addresses_from_the_stack(dev_stack: devstack.DevStack) -> None:
    cfg = KafoldConfig(postgres=PostgresConfig(url="postgresql://elsewhere/db"))
    out = devstack.effective(cfg, state_dir=dev_stack.state_dir)
    assert out.kafka.bootstrap_servers == dev_stack.bootstrap_servers
    assert out.postgres.url == "postgresql://elsewhere/db"


def test_default_state_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KAFOLD_DEV_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert devstack.default_state_dir() == tmp_path / "kafold" / "dev"
    monkeypatch.setenv("KAFOLD_DEV_DIR", str(tmp_path / "mine"))
    assert devstack.default_state_dir() == tmp_path / "mine"


# ---- Apache Kafka in the dev stack (Java 17+ and Maven on the machine; the jars are fetched once into the cache)

def _topic_with_records(bootstrap: str, topic: str, replicas: int, count: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, 1, replicas)]).values():
        f.result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    for i in range(count):
        producer.produce(topic, str(i).encode())
    assert producer.flush(30) == 0


def _end_offset(bootstrap: str, topic: str) -> int:
    """The partition's end offset. Just after a node of a cluster restarts, the leader may answer that its high
    watermark is not caught up yet (OFFSET_NOT_AVAILABLE): asked again, bounded, as the aggregate recovery asks."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "kt-devstack"})
    try:
        return retrying(lambda: bounds(consumer, topic, 0)[1], within_s=60, first_delay=0.2, max_delay=2.0,
                        on_retry=lambda e, delay: None)
    finally:
        consumer.close()


def _kill(proc: devstack.Proc) -> None:
    psutil.Process(proc.pid).kill()
    psutil.Process(proc.pid).wait(10)


@pytest.mark.integration
def test_apache_kafka_keeps_its_log_across_a_kill_and_leaves_no_process(tmp_path: Path) -> None:
    try:
        stack = devstack.up(tmp_path, broker="kafka")
        assert (stack.kind, stack.nodes, stack.replication_factor) == ("kafka", 1, 1)
        assert devstack.up(tmp_path) == stack and devstack.status(tmp_path) == stack
        _topic_with_records(stack.bootstrap_servers, "kept", 1, 50)
        _kill(stack.broker)
        assert devstack.status(tmp_path) is None
        again = devstack.up(tmp_path)  # the killed node restarts on its port, from its log on disk
        assert again.kind == "kafka" and again.broker.pid != stack.broker.pid
        assert again.bootstrap_servers == stack.bootstrap_servers and again.postgres == stack.postgres
        assert _end_offset(again.bootstrap_servers, "kept") == 50
        assert (tmp_path / "kafka" / "node-1" / "broker.log").stat().st_size > 0
        family = _family(again)
    finally:
        devstack.down(tmp_path)
    assert _gone(family) and _processes(tmp_path) == []
    try:  # a clean stop keeps the log too
        assert _end_offset(devstack.up(tmp_path, broker="kafka").bootstrap_servers, "kept") == 50
    finally:
        assert devstack.down(tmp_path) is True
    assert _processes(tmp_path) == []


@pytest.mark.integration
def test_three_node_apache_kafka_replicates_three_ways_and_survives_a_node_kill(tmp_path: Path) -> None:
    try:
        stack = devstack.up(tmp_path, broker="kafka", nodes=3)
        assert len(stack.brokers) == 3 and len(stack.bootstrap_servers.split(",")) == 3
        cfg = devstack.effective(KafoldConfig(), state_dir=tmp_path)
        assert cfg.kafka.replication_factor == 3 and cfg.kafka.bootstrap_servers == stack.bootstrap_servers
        _topic_with_records(stack.bootstrap_servers, "replicated", 3, 20)
        admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
        part = admin.list_topics(timeout=30).topics["replicated"].partitions[0]
        assert sorted(part.replicas) == [1, 2, 3]
        described = admin.describe_configs([ConfigResource("topic", "replicated")])
        assert next(iter(described.values())).result(30)["min.insync.replicas"].value == "2"
        _kill(stack.brokers[1])
        again = devstack.up(tmp_path)  # only the dead node restarts
        assert again.brokers[0] == stack.brokers[0] and again.brokers[2] == stack.brokers[2]
        assert again.brokers[1] != stack.brokers[1]
        assert _end_offset(again.bootstrap_servers, "replicated") == 20
        with pytest.raises(devstack.DevStackError, match="3-node stack runs"):
            devstack.up(tmp_path, nodes=1)
        family = [b.pid for b in again.brokers]
    finally:
        devstack.down(tmp_path)
    assert _gone(family) and _processes(tmp_path) == []


def _path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only the named tools (links to the machine's)."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        assert found, f"{tool} is needed on this machine for the test"
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.mark.parametrize(("tools", "missing"), [((), "no `java` is on PATH"), (("java",), "no `mvn` is on PATH")])
def test_apache_kafka_without_java_or_maven_is_a_one_line_error(tmp_path: Path, tools: tuple[str, ...],
                                                               missing: str) -> None:
    env = {"PATH": _path_with(tmp_path, *tools), "HOME": str(tmp_path), "KAFOLD_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "kafold.tools.cli", "dev", "up", "--broker", "kafka", "--state-dir",
                           str(tmp_path / "state")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    assert missing in done.stderr and "apt-get install openjdk-17-jre-headless maven" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert _processes(tmp_path) == []


def test_java_versions_are_read_from_both_version_formats() -> None:
    from kafold.tools.dev import apache_kafka

    assert apache_kafka._java_major('openjdk version "17.0.15" 2025-04-15') == 17
    assert apache_kafka._java_major('openjdk version "21" 2023-09-19') == 21
    assert apache_kafka._java_major('java version "1.8.0_392"') == 8
    assert apache_kafka._java_major("no version here") == 0


def test_a_broker_kind_or_node_count_the_stack_cannot_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(devstack.DevStackError, match="unknown broker 'redpanda'; choose one of tansu, kafka"):
        devstack.up(tmp_path, broker="redpanda")
    with pytest.raises(devstack.DevStackError, match="--nodes 3: the dev stack runs 1 broker"):
        devstack.up(tmp_path, broker="tansu", nodes=3)
    assert _processes(tmp_path) == []


def test_new_cluster_ids_never_start_with_a_dash() -> None:
    assert not any(apache_kafka.new_cluster_id().startswith("-") for _ in range(2000))


@pytest.mark.integration
def test_a_cluster_id_starting_with_a_dash_formats(tmp_path: Path) -> None:
    # One random id in 64 starts with '-', which kafka-storage's parser read as an option (seen in CI).
    nodes = apache_kafka.layout(tmp_path, 1, [(free_port(), free_port())], cluster_id="-u8inXnAQ2y2nfri1zKfkw")
    apache_kafka.format_storage(apache_kafka.java(), apache_kafka.libs(), "-u8inXnAQ2y2nfri1zKfkw", nodes)
    assert "cluster.id=-u8inXnAQ2y2nfri1zKfkw" in (nodes[0].data / "meta.properties").read_text()
