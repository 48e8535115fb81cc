"""Chaos harness: a workload with known outcomes, faults injected while it runs, and an independent checker.

The stack is the harness's own (a tansu broker and a PostgreSQL cluster started for the run), so it can pause the
broker and stop PostgreSQL without disturbing anything else. The daemon runs as a subprocess on a TOML file that
hosts the bank aggregate (`account`, commands -> events), two projections (`accounts` over the aggregate's events,
`items` over events the harness publishes itself) and a webhook effect (`hooks`, over the same items) delivering
to a receiver in this process. Faults, by kind:

- `daemon-kill`: kill -9 of the daemon, restarted at once;
- `broker-pause`: SIGSTOP of the broker, SIGCONT after a pause;
- `pg-restart`: immediate stop of PostgreSQL (SIGQUIT: no checkpoint, sessions cut), then start again;
- `webhook-fail` / `webhook-hang` / `webhook-drop`: for a while the receiver answers 500, hangs past the client
  timeout, or applies the event and drops the connection without answering;
- `republish-dup` / `republish-old`: records already published are published again (the same bytes), or an older
  version of an item after newer ones;
- `snapshot-kill`: a snapshot run killed halfway (kill -9), alternately a Spark job and an in-process run; the
  final one (engine auto) runs to completion.

Invariants checked once the faults stop and the system settled (see `check`): each projection equals an independent
fold (0 missing, 0 duplicate rows); every command has exactly one result (content), versions per aggregate are
consecutive with no two events on one version; every item event was delivered >= 1 time and applied once per
idempotency key at the receiver; no key left parked; committed/stored offsets equal the end offsets; snapshot + tail
equals a full replay. Broker quirk (tansu, docs/brokers.md and tests/aggregates/test_transactions.py):
read_committed readers also see records of aborted transactions, so a command re-processed after a kill may show
its (identical) result and events twice on the topics: the checker compares distinct contents and dedups events by
their deterministic ids, which is what every kafold consumer does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil
from aiohttp import web
from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KafkaTP
from confluent_kafka.admin import AdminClient

from kafold import db, kafka_clients
from kafold.config import KafkaConfig, PostgresConfig, load_file
from kafold.envelope import Event, decode, encode
from kafold.errors import RetriableError
from kafold.tools.dev import stack as devstack
from tests.support import ROOT, free_port

KAFOLD = str(Path(sys.executable).parent / "kafold")
ITEMS = "chaos.items"
INSTANCE_ID = "chaos-1"  # the daemon's KAFOLD_INSTANCE_ID: its transactional ids end with it
ITEM_PARTITIONS = 4
KINDS = ("daemon-kill", "broker-pause", "pg-restart", "webhook-fail", "webhook-hang", "webhook-drop",
         "republish-dup", "republish-old", "snapshot-kill")
# On the three-node Apache Kafka cluster (`broker="kafka"`) besides the kinds above.
BROKER_KINDS = ("broker-kill", "leader-kill", "coordinator-kill", "controller-pause", "cluster-restart")


def kinds_for(broker: str, spark: bool) -> tuple[str, ...]:
    """The fault kinds a run injects: KINDS (snapshot-kill only with Spark), and the broker faults on Kafka."""
    return tuple(k for k in KINDS if spark or k != "snapshot-kill") + (BROKER_KINDS if broker == "kafka" else ())


# ---------------------------------------------------------------------------------------------- the receiver
class Receiver:
    """A webhook target on 127.0.0.1 that applies each idempotency key once and can be told to misbehave."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.applied: dict[str, int] = {}   # webhook-id -> times it was applied (must end at 1 for each)
        self.deliveries: Counter[str] = Counter()  # webhook-id -> requests received
        self.first_applied: dict[str, list[int]] = defaultdict(list)  # item -> versions in order of application
        self.lock = threading.Lock()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(15):
            raise RuntimeError("receiver did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get("webhook-id", "")
        body = orjson.loads(await request.read())
        mode = self.mode
        with self.lock:
            self.deliveries[key] += 1
        if mode == "fail":
            return web.Response(status=500)
        if mode == "hang":
            await asyncio.sleep(30)  # past the client's timeout
            return web.Response(status=500)
        with self.lock:
            if key not in self.applied:  # the receiver's own dedup by idempotency key
                self.applied[key] = 1
                self.first_applied[body["aggregate_id"]].append(body["version"])
        if mode == "drop" and request.transport is not None:
            request.transport.abort()  # applied, but the client never hears so: it must retry
        return web.Response(status=204)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# ---------------------------------------------------------------------------------------------- the stack
@dataclass
class Stack:
    """The run's own dev stack: tansu, or a three-node Apache Kafka cluster (`broker="kafka"`), and PostgreSQL."""

    state: Path
    kafka: KafkaConfig
    pg: PostgresConfig
    kind: str = "tansu"
    replication_factor: int = 1

    @classmethod
    def up(cls, state: Path, broker: str = "tansu", nodes: int = 1) -> Stack:
        s = devstack.up(state, broker=broker, nodes=nodes)
        return cls(state, KafkaConfig(bootstrap_servers=s.bootstrap_servers, session_timeout_ms=6000,
                                      heartbeat_interval_ms=1000), PostgresConfig(url=s.postgres_url), s.kind,
                   s.replication_factor)

    def brokers(self) -> list[devstack.Proc]:
        """The broker processes as the stack file knows them now (a restarted node has a new pid)."""
        return devstack.brokers_in(devstack.read_state(self.state))

    def pause_broker(self, seconds: float, node: int = 1) -> None:
        """SIGSTOP of broker `node` (1-based), SIGCONT after `seconds`."""
        pid = self.brokers()[node - 1].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    def kill_brokers(self, nodes: list[int], down_s: float) -> None:
        """kill -9 of the brokers `nodes` (1-based), then, after `down_s`, start them again on their ports and
        data dirs (the dev stack restarts only the dead nodes) and wait until all of them serve."""
        procs = self.brokers()
        for n in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[n - 1].pid, signal.SIGKILL)
        for n in nodes:
            deadline = time.monotonic() + 30
            while procs[n - 1].alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(down_s)
        again = devstack.up(self.state)
        if again.bootstrap_servers != self.kafka.bootstrap_servers:
            raise RuntimeError(f"the restarted cluster moved to {again.bootstrap_servers}")

    def _leader(self, topic: str, pick: Any) -> int:
        """The node id leading the partition of `topic` that `pick(partition count)` names, as the metadata says
        now; the cluster may be between faults (a topic not created yet, a leader being elected): asked again for
        up to 30 s, then any node (the fault is still a broker kill, of a node chosen at random)."""
        admin = AdminClient(kafka_clients.librdkafka(self.kafka))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                meta = admin.list_topics(topic, timeout=10).topics.get(topic)
                if meta is not None and meta.error is None and meta.partitions:
                    leader = int(meta.partitions[pick(len(meta.partitions))].leader)
                    if 1 <= leader <= len(self.brokers()):
                        return leader
            time.sleep(0.5)
        return random.randint(1, len(self.brokers()))

    def leader_of(self, topic: str, partition: int) -> int:
        """The node id leading `topic`[partition] now."""
        return self._leader(topic, lambda _count: partition)

    def transaction_coordinator(self, transactional_id: str) -> int:
        """The node id coordinating `transactional_id`'s transactions: the leader of its `__transaction_state`
        partition, abs(Java hashCode of the id) modulo the topic's partitions."""
        h = 0
        for unit in transactional_id.encode("utf-16-be").hex(" ", 2).split():  # Java hashes UTF-16 code units
            h = (31 * h + int(unit, 16)) & 0xFFFFFFFF
        h = h - (1 << 32) if h >= 1 << 31 else h
        return self._leader("__transaction_state", lambda count: (0 if h == -(1 << 31) else abs(h)) % count)

    def controller(self) -> int:
        """The node id of the active KRaft controller (the quorum leader), as node 1's raft state records it."""
        for node in range(1, len(self.brokers()) + 1):
            quorum = self.state / "kafka" / f"node-{node}" / "data" / "__cluster_metadata-0" / "quorum-state"
            with contextlib.suppress(OSError, ValueError):
                leader = int(orjson.loads(quorum.read_bytes()).get("leaderId", -1))
                if leader > 0:
                    return leader
        raise RuntimeError("no KRaft quorum leader recorded")

    def restart_postgres(self) -> None:
        proc = devstack._postmaster_pid(self.state)
        if proc is not None:
            os.kill(proc.pid, signal.SIGQUIT)  # PostgreSQL's immediate shutdown: no checkpoint, crash recovery next
            # Until its pid is gone, not only until it looks exited: the old postmaster removes its socket lock file on
            # its way out, and a new one that finds the file while kill(pid, 0) still reaches the old pid refuses to
            # start ("lock file … already exists", seen in CI). The retries cover a lock file that outlives the wait.
            deadline = time.monotonic() + 30
            while psutil.pid_exists(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        for attempt in range(3):
            try:
                devstack._start_postgres(self.state)
                return
            except devstack.DevStackError as e:
                if "lock file" not in str(e) or attempt == 2:
                    raise
                time.sleep(2.0)

    def down(self) -> None:
        for proc in self.brokers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        # The run's data is thrown away: no clean shutdown (three Kafka nodes handing leadership to each other on
        # SIGTERM take seconds for nothing).
        devstack.down(self.state, graceful=False)
        # The stack file knows the first postmaster only; a restarted one is found by its data directory.
        devstack._stop(devstack._postmaster_pid(self.state), None)


# ---------------------------------------------------------------------------------------------- config, daemon
def write_config(path: Path, stack: Stack, receiver: Receiver, http_port: int) -> Path:
    path.write_text(f"""
[kafka]
bootstrap_servers = "{stack.kafka.bootstrap_servers}"
replication_factor = {stack.replication_factor}
session_timeout_ms = 6000
heartbeat_interval_ms = 1000

[postgres]
url = "{stack.pg.url}"

[daemon]
python_path = ["{ROOT / 'examples' / 'bank'}"]
http_port = {http_port}
group_prefix = "chaos"
batch_max_records = 2000
shutdown_grace_s = 5

[[aggregates]]
name = "account"
initial = "bank_domain:initial"
evolve = "bank_domain:evolve"
decide = "bank_domain:decide"
partitions = 4
fingerprint = "account-v1"

[[connectors]]
name = "accounts"
class = "postgres-projection"
topics = ["account.events"]
[connectors.config]
table = "accounts"
key_columns = ["account_id"]
mapper = "bank_projection:account_row"
[connectors.config.columns]
account_id = "text"
owner = "text"
currency = "text"
balance = "bigint"
status = "text"
opened_at = "timestamptz"
updated_at = "timestamptz"

[[connectors]]
name = "items"
class = "postgres-projection"
topics = ["{ITEMS}"]
[connectors.config]
table = "items"
key_columns = ["item_id"]
[connectors.config.columns]
item_id = "text"
value = "bigint"
[[connectors.config.on]]
type = "ItemSet"
set = {{ value = "payload.value" }}

[[connectors]]
name = "hooks"
class = "webhook"
topics = ["{ITEMS}"]
[connectors.config]
url = "{receiver.url}"
allow_http = true
timeout_s = 1.0
concurrency = 64
max_attempts = 1000000
max_age_s = 100000
backoff_initial_s = 0.05
backoff_max_s = 1.0

[[topics]]
name = "{ITEMS}"
partitions = {ITEM_PARTITIONS}
""")
    return path


class Daemon:
    """`kafold daemon -c FILE` as a subprocess, killed with -9 and restarted on demand; supervised like systemd's
    `Restart=on-failure` (deploy/): a daemon that exits by itself is started again after RESTART_S."""

    RESTART_S = 1.0

    def __init__(self, config: Path, log: Path, instance: str = INSTANCE_ID, http_port: int | None = None) -> None:
        self.config, self.log = config, log
        self.env = {**os.environ, "KAFOLD_INSTANCE_ID": instance}
        if http_port is not None:  # instances on one config and host need their own ports
            self.env["KAFOLD_DAEMON__HTTP_PORT"] = str(http_port)
        self.proc: subprocess.Popen[bytes] | None = None
        self.exits: list[int] = []  # exit codes of the daemon's own exits (restarted by the supervisor)
        self._lock = threading.Lock()
        self._supervising = threading.Event()

    def start(self) -> None:
        with self._lock:
            self._start()
        if not self._supervising.is_set():
            self._supervising.set()
            threading.Thread(target=self._supervise, daemon=True).start()

    def _start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([KAFOLD, "--log-format", "json", "daemon", "-c", str(self.config)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env)

    def _supervise(self) -> None:
        while self._supervising.is_set():
            time.sleep(0.5)
            with self._lock:
                if self._supervising.is_set() and self.proc is not None and self.proc.poll() is not None:
                    self.exits.append(self.proc.returncode)
                    time.sleep(self.RESTART_S)
                    self._start()

    def restart9(self) -> None:
        """The daemon-kill fault: kill -9, then start again at once."""
        with self._lock:
            self._kill9()
            self._start()

    def _kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM (kill -9 after 30 s); not restarted until `start` is called again."""
        self._supervising.clear()
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self._kill9()


# ---------------------------------------------------------------------------------------------- the workload
@dataclass
class Workload:
    """Commands to the bank aggregate and ItemSet events, each with a known expected outcome."""

    kafka: KafkaConfig
    config: Path
    rng: random.Random
    commands: dict[str, tuple[str, str, int]] = field(default_factory=dict)  # id -> (account, type, amount)
    items: list[tuple[int, bytes, bytes, Any]] = field(default_factory=list)  # (partition, key, value, headers)
    item_versions: dict[str, int] = field(default_factory=dict)
    accounts: list[str] = field(default_factory=list)
    produced: int = 0
    resent: int = 0  # commands sent again after a send timed out

    def __post_init__(self) -> None:
        from kafold.client import CommandClient

        cfg = load_file(self.config).config
        self.client = CommandClient(self.kafka, cfg.aggregates[0])
        self.producer = Producer(kafka_clients.librdkafka(self.kafka, **{"enable.idempotence": True,
                                                                          "linger.ms": 20}))
        self.lock = threading.Lock()

    def publish_items(self, n_items: int) -> None:
        """Publish n_items ItemSet events."""
        batch = []
        for _ in range(n_items):
            item = f"item-{self.rng.randrange(2000)}"
            v = self.item_versions.get(item, 0) + 1
            self.item_versions[item] = v
            key, value, headers = encode(Event.new("ItemSet", "item", item, v, {"value": self.rng.randrange(10**6)}))
            batch.append((hash(item) % ITEM_PARTITIONS, key, value, headers))
        self._publish(batch)
        self.produced += len(batch)

    def send_commands(self, n_commands: int) -> None:
        """Send n_commands commands (opens first, then deposits), acknowledged (sent again on a timeout)."""
        cmds = []
        for _ in range(n_commands):
            if len(self.accounts) < 50 or self.rng.random() < 0.02:
                acc = f"acc-{len(self.accounts)}"
                self.accounts.append(acc)
                cmd = self.client.command(acc, "OpenAccount", {"owner": f"owner-{acc}"})
                self.commands[cmd.command_id] = (acc, "OpenAccount", 0)
            else:
                acc = self.rng.choice(self.accounts)
                amount = self.rng.randrange(1, 1000)
                cmd = self.client.command(acc, "Deposit", {"amount": amount})
                self.commands[cmd.command_id] = (acc, "Deposit", amount)
            cmds.append(cmd)
        if cmds:
            self._send(cmds)
        self.produced += len(cmds)

    def _send(self, cmds: list[Any]) -> None:
        """Send commands; when they are not acknowledged in time (every broker restarting), send them again with
        the same ids, as a client does on a timeout: the aggregate answers a repeat as a duplicate."""
        for attempt in range(1, 11):
            try:
                self.client.send_many(cmds, wait=False)
                return
            except RetriableError:
                self.resent += len(cmds)
                if attempt == 10:
                    raise

    def _publish(self, batch: list[tuple[int, bytes, bytes, Any]], keep: bool = True) -> None:
        with self.lock:
            for p, key, value, headers in batch:
                kafka_clients.produce(self.producer, ITEMS, value, key, headers, partition=p)
            self.producer.poll(0)
            if keep:
                self.items += batch

    def republish(self, old: bool) -> int:
        """Publish again records already published: random ones (duplicates), or, with `old`, an earlier version
        of items that have newer ones (out of order). Returns how many."""
        if not self.items:
            return 0
        if old:
            picks = [r for r in self.rng.sample(self.items, min(200, len(self.items)))][:50]
        else:
            picks = self.rng.sample(self.items[-2000:], min(50, len(self.items)))
        self._publish(picks, keep=False)
        return len(picks)

    def close(self) -> None:
        """Let go of the producers (before the stack stops: they would go on calling the dead brokers)."""
        self.client.close()
        del self.producer

    def flush(self) -> None:
        with self.lock:
            if self.producer.flush(60):
                raise RuntimeError("workload records not acknowledged")
        self.client.producer.flush(60)


# ---------------------------------------------------------------------------------------------- reading back
def read_topic(kafka: KafkaConfig, topic: str) -> list[Any]:
    """Every record of `topic` (read_committed). Read until the consumer goes idle rather than up to the high
    watermark: see `end_offsets` for the broker quirk, and on a transactional topic the last offset is a marker."""
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": f"chaos-read-{uuid.uuid4().hex[:6]}",
                                                            "enable.auto.commit": False,
                                                            "isolation.level": "read_committed"}))
    try:
        meta = consumer.list_topics(topic, timeout=15).topics[topic]
        consumer.assign([KafkaTP(topic, p, 0) for p in meta.partitions])
        out: list[Any] = []
        idle = 0
        while idle < 3:
            msgs = consumer.consume(10000, 1.0)
            idle = 0 if msgs else idle + 1
            out += [m for m in msgs if m.error() is None]
        return out
    finally:
        consumer.close()


def end_offsets(kafka: KafkaConfig, topic: str) -> dict[int, tuple[int, int]]:
    """Per partition, what a consumer that handled everything may store: from the offset after the last data record
    to its position past the commit markers that follow it (kafold's runner steps past them, as Kafka's Java
    consumer does, so that a partition ending in a marker is not one behind for good; daemon/runner.py).

    Broker quirk (tansu, see docs/brokers.md): its high watermark can lag the log by a few records, and
    on a transactional topic the last offset is a commit marker that consumers never see; so the end is found by
    reading the tail of each partition, not from the watermark alone.
    """
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": f"chaos-ends-{uuid.uuid4().hex[:6]}",
                                                            "enable.auto.commit": False,
                                                            "isolation.level": "read_committed"}))
    try:
        meta = consumer.list_topics(topic, timeout=15).topics[topic]
        ends: dict[int, int] = {}
        starts = []
        for p in meta.partitions:
            high = consumer.get_watermark_offsets(KafkaTP(topic, p), timeout=15)[1]
            ends[p] = 0
            starts.append(KafkaTP(topic, p, max(0, high - 2000)))
        consumer.assign(starts)
        idle, deadline = 0, time.monotonic() + 60
        while idle < 2 and time.monotonic() < deadline:  # only after the workload stopped: it then goes idle
            msgs = consumer.consume(5000, 1.0)
            idle = 0 if msgs else idle + 1
            for m in msgs:
                if m.error() is None:
                    ends[m.partition()] = max(ends[m.partition()], m.offset() + 1)
        past = {k.partition: k.offset for k in consumer.position([KafkaTP(topic, p) for p in ends])}
        return {p: (end, max(end, past.get(p, end))) for p, end in ends.items()}
    finally:
        consumer.close()


def stalled_partitions(kafka: KafkaConfig, topic: str, wait_s: float = 5.0) -> list[int]:
    """Partitions where a read_committed reader placed one record before the reported end gets neither a record
    nor end-of-partition within `wait_s` (the stall `kafka_io.bounds` would run into)."""
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": f"chaos-lso-{uuid.uuid4().hex[:6]}",
                                                            "enable.auto.commit": False, "enable.partition.eof": True,
                                                            "isolation.level": "read_committed"}))
    try:
        meta = consumer.list_topics(topic, timeout=15).topics[topic]
        stuck = []
        for p in meta.partitions:
            low, high = consumer.get_watermark_offsets(KafkaTP(topic, p), timeout=15, cached=False)
            if high <= low:
                continue
            consumer.assign([KafkaTP(topic, p, high - 1)])
            deadline, answered = time.monotonic() + wait_s, False
            while not answered and time.monotonic() < deadline:
                answered = bool(consumer.consume(100, 0.2))
            consumer.unassign()
            if not answered:
                stuck.append(p)
        return stuck
    finally:
        consumer.close()


def tail_diagnostics(kafka: KafkaConfig, topic: str, last: int = 30) -> str:
    """What a stalled reader faced: per partition, ListOffsets under both isolation levels and the last records
    read uncommitted (offset, key, headers), for the report's work directory."""
    lines = []
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": f"chaos-diag-{uuid.uuid4().hex[:6]}",
                                                                "enable.auto.commit": False,
                                                                "isolation.level": isolation}))
        try:
            meta = consumer.list_topics(topic, timeout=15).topics[topic]
            for p in meta.partitions:
                low, high = consumer.get_watermark_offsets(KafkaTP(topic, p), timeout=15, cached=False)
                lines.append(f"{topic}[{p}] {isolation}: ListOffsets {low}..{high}")
                if isolation == "read_uncommitted":
                    consumer.assign([KafkaTP(topic, p, max(0, high - last))])
                    idle = 0
                    while idle < 2:
                        msgs = consumer.consume(1000, 1.0)
                        idle = 0 if msgs else idle + 1
                        lines += [f"  {m.offset()} key={m.key()!r} headers={m.headers()} error={m.error()}"
                                  for m in msgs]
                    cached = consumer.get_watermark_offsets(KafkaTP(topic, p), cached=True)
                    lines.append(f"  fetch watermarks {cached}")
        finally:
            consumer.close()
    return "\n".join(lines) + "\n"


def watermarks(kafka: KafkaConfig, topic: str) -> dict[int, int]:
    """High watermarks (cheap; may lag the log a little on tansu — good enough to time a recovery)."""
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": "chaos-watermarks"}))
    try:
        meta = consumer.list_topics(topic, timeout=15).topics[topic]
        return {p: consumer.get_watermark_offsets(KafkaTP(topic, p), timeout=15)[1] for p in meta.partitions}
    finally:
        consumer.close()


def group_offsets(kafka: KafkaConfig, group: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": group}))
    try:
        got = consumer.committed([KafkaTP(topic, p) for p in range(partitions)], timeout=15)
        return {tp.partition: tp.offset for tp in got if tp.offset >= 0}
    finally:
        consumer.close()


def stored_offsets(pg: PostgresConfig, connector: str) -> dict[tuple[str, int], int]:
    try:
        with db.connect(pg) as conn:
            rows = conn.execute("SELECT topic, partition, next_offset FROM kafold.checkpoints WHERE connector = %s",
                                (connector,)).fetchall()
    except Exception:  # PostgreSQL restarting, or not migrated yet
        return {}
    return {(t, p): o for t, p, o in rows}


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class Report:
    seconds: float = 0.0
    events: int = 0
    commands: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    recoveries: list[float] = field(default_factory=list)
    unrecovered: int = 0
    invariants: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # broker quirks met on the way (not violations)

    def text(self) -> str:
        rec = sorted(self.recoveries)
        p50 = statistics.median(rec) if rec else 0.0
        p99 = rec[min(len(rec) - 1, int(len(rec) * 0.99))] if rec else 0.0
        lines = [f"workload: {self.events:,} events ({self.commands:,} commands) in {self.seconds:.0f} s",
                 f"faults injected: {sum(self.faults.values())} of {len(self.faults)} kinds: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
                 f"recovery (fault end -> items projection past the end offsets seen then): p50 {p50:.1f} s, "
                 f"p99 {p99:.1f} s over {len(rec)} faults ({self.unrecovered} not recovered before the next)",
                 f"invariants checked: {len(self.invariants)}"]
        lines += [f"  - {i}" for i in self.invariants]
        lines.append(f"violations: {len(self.violations)}")
        lines += [f"  ! {v}" for v in self.violations]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


class Chaos:
    """One chaos run: stack, receiver, daemon, workload, faults; then `check`."""

    def __init__(self, workdir: Path, *, seed: int = 7, pause_s: tuple[float, float] = (2.0, 4.0),
                 spark: bool = True, broker: str = "tansu", kinds: tuple[str, ...] | None = None,
                 nodes: int | None = None) -> None:
        self.dir = workdir
        self.rng = random.Random(seed)
        self.pause_s = pause_s
        self.spark = spark
        self.kinds = kinds or kinds_for(broker, spark)
        self.report = Report()
        self.stack = Stack.up(workdir / "stack", broker, nodes or (3 if broker == "kafka" else 1))
        self.receiver = Receiver()
        self.receiver.start()
        self.config = write_config(workdir / "kafold.toml", self.stack, self.receiver, free_port())
        env_ok = subprocess.run([KAFOLD, "topics", "ensure", "-c", str(self.config)], capture_output=True,
                                text=True, timeout=120)
        if env_ok.returncode != 0:
            raise RuntimeError(f"topics ensure failed (exit {env_ok.returncode}): "
                               f"{(env_ok.stdout + env_ok.stderr)[-2000:]}")
        self.daemon = Daemon(self.config, workdir / "daemon.log")
        self.daemons = [self.daemon]  # more instances on the same config: `add_daemon`
        self.workload = Workload(self.stack.kafka, self.config, self.rng)
        self._pending: list[threading.Thread] = []

    def add_daemon(self) -> Daemon:
        """One more `kafold daemon` on the same config (own instance id and HTTP port), not started yet."""
        n = len(self.daemons) + 1
        d = Daemon(self.config, self.dir / f"daemon-{n}.log", instance=f"chaos-{n}", http_port=free_port())
        self.daemons.append(d)
        return d

    def close(self) -> None:
        for d in self.daemons:
            d.stop()
        self.workload.close()
        self.receiver.stop()
        self.stack.down()

    # ---- faults ----
    def _fault(self, kind: str) -> None:
        if kind == "daemon-kill":
            self.daemon.restart9()
        elif kind == "broker-pause":
            self.stack.pause_broker(self.rng.uniform(*self.pause_s), self.rng.randint(1, len(self.stack.brokers())))
        elif kind == "broker-kill":
            self.stack.kill_brokers([self.rng.randint(1, 3)], self.rng.uniform(0.5, 5.0))
        elif kind == "leader-kill":  # the leader of a partition the aggregate writes in its transactions
            self.stack.kill_brokers([self.stack.leader_of("account.events", self.rng.randrange(4))],
                                    self.rng.uniform(0.5, 5.0))
        elif kind == "coordinator-kill":  # the broker coordinating the aggregate runtime's transactions
            self.stack.kill_brokers([self.stack.transaction_coordinator(f"chaos.aggregate.account.{INSTANCE_ID}")],
                                    self.rng.uniform(0.5, 5.0))
        elif kind == "controller-pause":
            self.stack.pause_broker(self.rng.uniform(*self.pause_s), self.stack.controller())
        elif kind == "cluster-restart":  # every node killed at once, started again from its log on disk
            self.stack.kill_brokers([1, 2, 3], self.rng.uniform(0.5, 2.0))
        elif kind == "pg-restart":
            self.stack.restart_postgres()
        elif kind in ("webhook-fail", "webhook-hang", "webhook-drop"):
            self.receiver.mode = kind.split("-")[1]
            time.sleep(self.rng.uniform(2.0, 4.0))
            self.receiver.mode = "ok"
        elif kind in ("republish-dup", "republish-old"):
            self.workload.republish(old=kind == "republish-old")
        elif kind == "snapshot-kill":  # alternately a Spark job (in its JVM start or its tasks) and a local run
            spark = self.report.faults[kind] % 2 == 0
            self._snapshot(kill_after=self.rng.uniform(6.0, 12.0) if spark else self.rng.uniform(0.8, 2.5),
                           engine="spark" if spark else "local")
        self.report.faults[kind] += 1
        self._watch_recovery()

    def _snapshot(self, kill_after: float | None, engine: str = "auto") -> int:
        with open(self.dir / "snapshot.log", "ab") as out:
            proc = subprocess.Popen([KAFOLD, "--log-format", "json", "snapshot", "run", "-c", str(self.config),
                                     "--master", "local[1]", "--engine", engine], stdout=out,
                                    stderr=subprocess.STDOUT)
            try:
                return proc.wait(kill_after) if kill_after is not None else proc.wait(600)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                return proc.wait(30)

    def _watch_recovery(self) -> None:
        """Time from now (fault end) until the items projection has stored offsets past the current end."""
        try:
            target = watermarks(self.stack.kafka, ITEMS)
        except Exception:
            return
        started = time.monotonic()

        def watch() -> None:
            deadline = started + 300
            while time.monotonic() < deadline:
                stored = stored_offsets(self.stack.pg, "items")
                if all(stored.get((ITEMS, p), 0) >= off for p, off in target.items()):
                    self.report.recoveries.append(time.monotonic() - started)
                    return
                time.sleep(0.2)
            self.report.unrecovered += 1

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        self._pending.append(t)

    def run(self, seconds: float, fault_every_s: float, items_per_s: int, commands_per_s: int,
            min_faults: int = 0, broker_lane: bool = False) -> None:
        """Workload for `seconds` (longer until `min_faults` were injected), a fault every ~fault_every_s (kinds in
        a shuffled cycle so each appears). `broker_lane`: the broker faults (`broker-pause` too) are injected by a
        second lane of their own, at the same spacing, overlapping the other kinds (a broker fault waits for JVMs to
        restart, so one lane of every kind injects too few faults of any kind in a soak)."""
        self.daemon.start()
        started = time.monotonic()
        # Every fault that stops or pauses a broker goes in that lane, so no two of them meet on one node.
        broker_kinds = [k for k in self.kinds if k in (*BROKER_KINDS, "broker-pause")] if broker_lane else []
        lanes = [[k for k in self.kinds if k not in broker_kinds]] + ([broker_kinds] if broker_kinds else [])
        stop = threading.Event()

        def lane(kinds: list[str], rng: random.Random) -> None:
            cycle: list[str] = []
            while not stop.is_set() and (time.monotonic() - started < seconds
                                         or sum(self.report.faults.values()) < min_faults):
                if not cycle:
                    cycle = list(kinds)
                    rng.shuffle(cycle)
                self._fault(cycle.pop())
                stop.wait(rng.uniform(0.5, 1.5) * fault_every_s)

        with self.loading(items_per_s, commands_per_s):
            time.sleep(min(10.0, seconds / 10))  # let the daemon join its groups first
            second = None
            if len(lanes) > 1:  # its own random stream: the main lane's sequence stays that of its seed
                second = threading.Thread(target=lane, args=(lanes[1], random.Random(self.rng.random())),
                                          daemon=True)
                second.start()
            try:
                lane(lanes[0], self.rng)
            finally:
                if second is not None:
                    second.join()  # the broker fault in progress ends (nodes restarted) before the workload stops
            stop.set()

    @contextlib.contextmanager
    def loading(self, items_per_s: int, commands_per_s: int) -> Iterator[None]:
        """The workload running while the block runs, items and commands each in a thread of its own (a command
        send that waits for a restarting cluster does not hold the items back); flushed and counted in the report
        after it."""
        stop = threading.Event()
        started = time.monotonic()
        tick = 0.2

        def load(step: Callable[[], None]) -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    step()
                except BufferError:
                    pass
                except Exception as e:  # the workload must not stop unnoticed
                    self.report.violations.append(f"workload stopped: {type(e).__name__}: {e}")
                    return
                stop.wait(max(0.0, tick - (time.monotonic() - t0)))

        loaders = [threading.Thread(target=load, args=(step,), daemon=True) for step in (
            lambda: self.workload.publish_items(int(items_per_s * tick)),
            lambda: self.workload.send_commands(max(1, int(commands_per_s * tick))))]
        for loader in loaders:
            loader.start()
        try:
            yield
        finally:
            stop.set()
            for loader in loaders:
                loader.join(30)
        self.workload.flush()
        self.report.seconds = time.monotonic() - started
        self.report.commands = len(self.workload.commands)
        self.report.events = len(self.workload.items)

    # ---- the checker ----
    def settle(self, timeout: float, while_progressing_s: float = 0.0) -> list[str]:
        """Wait until every consumer is at the end offsets; returns what did not get there. Past `timeout`, the wait
        goes on for up to `while_progressing_s` more as long as the consumers' offsets keep moving (a backlog being
        worked off, as after a soak whose effects fell behind under load, is not a stall); it ends on a minute
        without progress."""
        kafka, pg = self.stack.kafka, self.stack.pg
        started = time.monotonic()
        deadline = started + timeout
        missing: list[str] = []
        covered, moved = -1, started
        while time.monotonic() < deadline or (time.monotonic() < started + timeout + while_progressing_s
                                             and time.monotonic() - moved < 60.0):
            missing = []
            items_end, events_end = end_offsets(kafka, ITEMS), end_offsets(kafka, "account.events")
            commands_end = end_offsets(kafka, "account.commands")
            stored_items, stored_acc = stored_offsets(pg, "items"), stored_offsets(pg, "accounts")
            for p, (end, past) in items_end.items():
                if not end <= stored_items.get((ITEMS, p), 0) <= past:
                    missing.append(f"items stored offset {ITEMS}[{p}] {stored_items.get((ITEMS, p))} != end {end}")
            for p, (end, past) in events_end.items():
                if not end <= stored_acc.get(("account.events", p), 0) <= past:
                    missing.append(f"accounts stored offset account.events[{p}] {stored_acc.get(('account.events', p))}"
                                   f" != end {end}")
            hooks = group_offsets(kafka, "chaos.hooks", ITEMS, ITEM_PARTITIONS)
            for p, (end, past) in items_end.items():
                if not end <= hooks.get(p, 0) <= past:
                    missing.append(f"hooks committed {ITEMS}[{p}] {hooks.get(p)} != end {end}")
            cmds = group_offsets(kafka, "chaos.aggregate.account", "account.commands", 4)
            if cmds and any(not end <= cmds.get(p, 0) <= past for p, (end, past) in commands_end.items()):
                missing.append(f"commands committed {cmds} != end {commands_end}")
            if not missing:
                return []
            now_covered = (sum(stored_items.values()) + sum(stored_acc.values()) + sum(hooks.values())
                           + sum(cmds.values()))
            if now_covered > covered:
                covered, moved = now_covered, time.monotonic()
            time.sleep(1.0)
        return missing

    def _resolve_open_transactions(self) -> None:
        """Broker quirk (tansu): it enforces no transaction timeout, and after a run of kill -9s and fencings
        during broker pauses its last stable offset has twice (in 30-minute runs) stayed one record below the end
        of an events partition whose data was all committed and read. A read_committed reader placed at the end
        then gets neither records nor end-of-partition, so the snapshot job's end-of-range probe stalls. Real
        Kafka aborts a transaction left open after `transaction.timeout.ms` (60 s for kafold's runtime) and its
        ListOffsets reports the last stable offset. What a restart does here: stop the daemon (its producer
        aborts an open transaction) and initialise a producer with its transactional id (the broker aborts
        whatever that id still holds). Seen before and after, it is reported as a note, not hidden."""
        stuck = stalled_partitions(self.stack.kafka, "account.events")
        self.daemon.stop()
        producer = Producer(kafka_clients.librdkafka(self.stack.kafka, **{
            "transactional.id": f"chaos.aggregate.account.{INSTANCE_ID}"}))
        producer.init_transactions(30)
        producer.flush(5)
        if stuck:
            after = stalled_partitions(self.stack.kafka, "account.events")
            self.report.notes.append(f"broker quirk: account.events partitions {stuck} had a last stable offset "
                                     f"below their end (a read_committed reader at the end got no end-of-"
                                     f"partition); after stopping the daemon and fencing its transactional id: "
                                     f"{after or 'none'}")

    def run_strict(self, settle_timeout: float = 240.0, **run: Any) -> tuple[Report, list[str]]:
        """`run(**run)`, `check` and, as on Apache Kafka, `strict_violations`; the run's processes stopped after."""
        try:
            self.run(**run)
            report = self.check(settle_timeout=settle_timeout)
            strict = self.strict_violations()
        finally:
            self.close()
        print(report.text())
        return report, strict

    def order_violations(self) -> list[str]:
        """Items whose events the receiver applied (first delivery of each idempotency key) out of version order:
        an effect connector delivers a key's events one after another, across rebalances too."""
        with self.receiver.lock:
            applied = {k: list(v) for k, v in self.receiver.first_applied.items()}
        return [f"effect order of {item}: versions applied as {vs[:20]}" for item, vs in applied.items()
                if vs != sorted(vs)]

    def strict_violations(self) -> list[str]:
        """What real Kafka rules out beyond the invariants (it hides aborted transactions from read_committed
        readers, so nothing of a cut-off batch shows): each command sent once has exactly one result record, and
        no event record is on the events topic twice. (A command sent again after a send timed out gets its outcome
        repeated in a record marked duplicate.)"""
        bodies = [orjson.loads(m.value()) for m in read_topic(self.stack.kafka, "account.results")]
        results = Counter(b["command_id"] for b in bodies if not b.get("duplicate"))
        out = [f"command {cid}: {results[cid]} result records (not repeats)" for cid in self.workload.commands
               if results[cid] != 1]
        events = Counter(decode(m.key(), m.value(), m.headers()).event_id
                         for m in read_topic(self.stack.kafka, "account.events"))
        return out + [f"event {eid}: {n} records" for eid, n in events.items() if n != 1]

    def check(self, settle_timeout: float = 180.0, while_progressing_s: float = 0.0) -> Report:
        r = self.report
        for t in self._pending:
            t.join(0)
        settling = time.monotonic()
        unsettled = self.settle(settle_timeout, while_progressing_s)
        r.notes.append(f"settled in {time.monotonic() - settling:.0f} s" if not unsettled
                       else f"not settled after {time.monotonic() - settling:.0f} s")
        if self.workload.resent:
            r.notes.append(f"{self.workload.resent} command(s) sent again with their ids after a send timed out")
        exits = [e for d in self.daemons for e in d.exits]
        if exits:
            r.notes.append(f"the daemon exited by itself {len(exits)} time(s) (exit codes "
                           f"{sorted(set(exits))}; its log says why) and was restarted by the supervisor")
        r.invariants.append("stored/committed offsets of every projection, effect and aggregate equal the end "
                            "offsets")
        r.violations += unsettled
        kafka, pg = self.stack.kafka, self.stack.pg

        # Items: the projection equals the fold of the unique events (newest version per item wins).
        newest: dict[str, tuple[int, int]] = {}
        unique_items: set[str] = set()
        for m in read_topic(kafka, ITEMS):
            e = decode(m.key(), m.value(), m.headers())
            unique_items.add(e.event_id)
            if e.aggregate_id not in newest or e.version > newest[e.aggregate_id][0]:
                newest[e.aggregate_id] = (e.version, e.payload["value"])
        with db.connect(pg) as conn:
            rows = conn.execute("SELECT item_id, value, _kafold_version FROM public.items").fetchall()
        table = {i: (v, val) for i, val, v in rows}
        r.invariants.append("items table == independent fold of the items topic (0 missing, 0 extra, newest "
                            "version wins)")
        if len(rows) != len(table):
            r.violations.append("items: duplicate rows")
        for item, want in newest.items():
            if table.get(item) != want:
                r.violations.append(f"items: {item} is {table.get(item)}, expected {want}")
        r.violations += [f"items: unexpected row {i}" for i in set(table) - set(newest)]

        # Commands: exactly one result content per command; versions consecutive; balances equal the fold.
        results: dict[str, set[tuple[Any, ...]]] = defaultdict(set)
        for m in read_topic(kafka, "account.results"):
            body = orjson.loads(m.value())
            results[body["command_id"]].add((body["status"], body["version"], tuple(body.get("event_ids") or ())))
        r.invariants.append("every command sent has exactly one result (distinct content)")
        for cid in self.workload.commands:
            got = results.get(cid, set())
            if len(got) != 1:
                r.violations.append(f"command {cid}: {len(got)} distinct results")
        events: dict[str, Event] = {}
        for m in read_topic(kafka, "account.events"):
            e = decode(m.key(), m.value(), m.headers())
            events.setdefault(e.event_id, e)
        by_agg: dict[str, list[Event]] = defaultdict(list)
        for e in events.values():
            by_agg[e.aggregate_id].append(e)
        r.invariants.append("per aggregate: versions 1..n, consecutive, one event per version")
        balances: dict[str, int] = {}
        for agg, evs in by_agg.items():
            versions = sorted(e.version for e in evs)
            if versions != list(range(1, len(versions) + 1)):
                r.violations.append(f"{agg}: versions {versions[:10]}... not consecutive / duplicated")
            balances[agg] = sum(e.payload.get("amount", 0) for e in evs if e.type == "MoneyDeposited")
        expected_balance: dict[str, int] = defaultdict(int)
        for cid, (acc, kind, amount) in self.workload.commands.items():
            status = next(iter(results.get(cid, {("?", 0, ())})))[0]
            if kind == "Deposit" and status == "accepted":
                expected_balance[acc] += amount
        with db.connect(pg) as conn:
            acc_rows = dict(conn.execute("SELECT account_id, balance FROM public.accounts").fetchall())
        r.invariants.append("accounts table == fold of the accepted commands (and of the events topic)")
        for acc in set(expected_balance) | set(acc_rows):
            want = expected_balance.get(acc, 0)
            if acc_rows.get(acc) != want or balances.get(acc, 0) != want:
                r.violations.append(f"{acc}: table {acc_rows.get(acc)}, events {balances.get(acc)}, commands {want}")

        # Effects: delivered >= 1, applied once per idempotency key, nothing parked.
        r.invariants.append("every item event delivered >= 1 time and applied exactly once per idempotency key")
        with self.receiver.lock:
            applied, deliveries = dict(self.receiver.applied), dict(self.receiver.deliveries)
        for eid in unique_items:
            if deliveries.get(eid, 0) < 1 or applied.get(eid) != 1:
                r.violations.append(f"effect {eid}: delivered {deliveries.get(eid, 0)}, applied {applied.get(eid)}")
        r.violations += [f"effect for an unknown event {k}" for k in set(applied) - unique_items]
        with db.connect(pg) as conn:
            parked = conn.execute("SELECT count(*) FROM kafold.effect_parked WHERE connector = 'hooks'").fetchone()
        r.invariants.append("no key left parked (every failure was temporary)")
        if parked and parked[0]:
            r.violations.append(f"{parked[0]} effect(s) parked")

        # Snapshots: a full job after the killed ones, then snapshot + tail == full replay.
        if self.spark:
            self._resolve_open_transactions()
            code = self._snapshot(kill_after=None)
            verify = subprocess.run([KAFOLD, "snapshot", "verify", "-c", str(self.config)], capture_output=True,
                                    text=True, timeout=600)
            r.invariants.append("snapshot + tail == full replay (kafold snapshot verify, after killed jobs)")
            if code != 0 or verify.returncode != 0:
                r.violations.append(f"snapshot job exit {code}; verify exit {verify.returncode}: "
                                    f"{(verify.stdout + verify.stderr).strip()[-300:]}")
                (self.dir / "diagnostics.txt").write_text(tail_diagnostics(kafka, "account.events"))
        return r
