"""Webhook effects to a local receiver: effects/s with per-key order, commit lag at an offered rate, RSS; with
`--outage-s` also an outage of the receiver (connections refused) under the offered rate: how long after its return
everything is delivered, how many keys were parked, and the process's RSS while it waited."""

from __future__ import annotations

import argparse
import contextlib
import resource
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaException
from confluent_kafka import TopicPartition as KafkaTP
from confluent_kafka.admin import NewTopic

from kafold import db, kafka_clients, logs
from kafold.config import ConnectorConfig, DaemonConfig, PostgresConfig
from kafold.connectors.effects import ops
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner
from kafold.envelope import Event, encode
from kafold.tools.bench import services, short_group

log = logs.get("kafold.bench.effects")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=50_000, help="events for the throughput phase (default 50k)")
    p.add_argument("--keys", type=int, default=2000, help="distinct keys (aggregates)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the benchmark topics")
    p.add_argument("--concurrency", type=int, default=128, help="effects in flight at once")
    p.add_argument("--rate", type=float, default=1000.0, help="offered events/s in the commit-lag phase")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the commit-lag phase")
    p.add_argument("--outage-s", type=float, default=0.0,
                   help="add an outage phase: the receiver refuses connections this long while events arrive at "
                        "--rate (0 = no outage phase)")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        kafka, pg = services(stack, "effects", args.config, args.broker)
        kafka = short_group(kafka)
        pg = PostgresConfig(**{**pg.__dict__, "schema": "kafold_bench_effects"})
        db.upgrade(pg)
        url, control = stack.enter_context(effect_receiver())
        figures = _throughput(kafka, pg, url, control, args)
        figures.update(_commit_lag(kafka, pg, url, args))
        if args.outage_s > 0:
            figures.update(_outage(kafka, pg, url, control, args))
    figures["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return figures


@contextlib.contextmanager
def effect_receiver() -> Iterator[tuple[str, str]]:
    """The receiver runs in its own process (its CPU is not the daemon's): POST /hook on one port; GET /stats and
    POST /down, /up (stop and restart listening on the hook port: connections refused meanwhile) on another."""
    proc = subprocess.Popen([sys.executable, "-c", "from kafold.tools.bench.receiver import serve; serve()"],
                            stdout=subprocess.PIPE, text=True)
    try:
        hook, control = (int(p) for p in (proc.stdout.readline() if proc.stdout else "").split())
        yield f"http://127.0.0.1:{hook}", f"http://127.0.0.1:{control}"
    finally:
        proc.terminate()
        proc.wait(10)


def _stats(control: str) -> dict[str, Any]:


    with urllib.request.urlopen(f"{control}/stats", timeout=10) as resp:
        return dict(orjson.loads(resp.read()))


def _switch(control: str, what: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{control}/{what}", data=b"", method="POST"), timeout=10).read()


def _topic(kafka: Any, name: str, partitions: int) -> None:
    admin = kafka_clients.admin(kafka)  # kept referenced until the futures resolve
    for fut in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        fut.result(15)


def _start(kafka: Any, pg: Any, name: str, topic: str, url: str, concurrency: int) -> tuple[Any, threading.Thread]:
    settings = ConnectorConfig(name=name, connector_class="webhook", topics=[topic], config={
        "url": f"{url}/hook", "allow_http": True, "concurrency": concurrency})
    connector = instantiate(settings, Path("."))
    daemon = DaemonConfig(group_prefix="kafold-bench", batch_max_records=5000, batch_max_wait_ms=100)
    runner = SinkRunner(connector, connector.task_configs(1)[0].with_services(kafka, pg), kafka=kafka,
                        daemon=daemon)
    thread = threading.Thread(target=runner.run, name="bench-effects", daemon=True)
    thread.start()
    return runner, thread


def _committed(consumer: Any, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offsets; {} (nothing seen this time, the callers poll again) while the group
    coordinator answers with a retriable error (e.g. not coordinator, or loading, as it moves or starts)."""
    try:
        got = consumer.committed([KafkaTP(topic, p) for p in range(partitions)], timeout=10)
    except KafkaException as e:
        if not kafka_clients.coordinator_changing(e.args[0]):
            raise
        log.info("bench.committed_offsets_unavailable", error=str(e))
        return {}
    return {tp.partition: tp.offset for tp in got}


def _consumer(kafka: Any, group: str) -> Any:
    return Consumer(kafka_clients.librdkafka(kafka, **{"group.id": group}))


def _producer(kafka: Any) -> Any:
    return kafka_clients.producer(kafka, **{"enable.idempotence": True, "linger.ms": 5})


def _event(key: int, version: int, prefix: str = "agg") -> tuple[bytes, bytes, Any]:
    return encode(Event.new("Notified", "bench", f"{prefix}-{key}", version, {"n": version, "note": "x" * 120}))


def _throughput(kafka: Any, pg: Any, url: str, control: str, args: argparse.Namespace) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    topic, name = f"kafold.bench.effects.{run_id}", f"bench-effects-{run_id}"
    _topic(kafka, topic, args.partitions)
    producer, ends = _producer(kafka), {p: 0 for p in range(args.partitions)}
    versions = -(-args.events // args.keys)
    n = 0
    for v in range(1, versions + 1):
        for k in range(args.keys):
            if n == args.events:
                break
            key, value, headers = _event(k, v)
            producer.produce(topic, value=value, key=key, headers=headers, partition=k % args.partitions)
            ends[k % args.partitions] += 1
            n += 1
            producer.poll(0)
    producer.flush(60)
    before = _stats(control)["count"]
    runner, thread = _start(kafka, pg, name, topic, url, args.concurrency)
    consumer = _consumer(kafka, runner.group_id)
    try:
        while _committed(consumer, topic, args.partitions) != ends:
            time.sleep(0.1)
        done = time.time()
    finally:
        runner.stop()
        thread.join(60)
        consumer.close()
    stats = _stats(control)
    seconds = done - stats["first"]
    return {"effects": n, "effects_per_s": round(n / seconds), "effects_seconds": round(seconds, 2),
            "requests": stats["count"] - before, "out_of_order": stats["out_of_order"], "keys": args.keys,
            "concurrency": args.concurrency}


def _commit_lag(kafka: Any, pg: Any, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Produce at `rate`; a poller reads the committed offsets every 20 ms: lag = first seen committed - produced."""
    run_id = uuid.uuid4().hex[:8]
    topic, name = f"kafold.bench.effects-lag.{run_id}", f"bench-effects-lag-{run_id}"
    _topic(kafka, topic, args.partitions)
    runner, thread = _start(kafka, pg, name, topic, url, args.concurrency)
    consumer, producer = _consumer(kafka, runner.group_id), _producer(kafka)
    produced: dict[int, list[tuple[int, float]]] = {p: [] for p in range(args.partitions)}  # (offset, at)
    lock, lags, done = threading.Lock(), [], threading.Event()
    total = int(args.rate * args.seconds)

    def poll() -> None:
        next_index = {p: 0 for p in produced}
        while not done.is_set():
            offsets, seen = _committed(consumer, topic, args.partitions), time.time()
            with lock:
                for p, items in produced.items():
                    i = next_index[p]
                    while i < len(items) and items[i][0] < offsets.get(p, -1):
                        lags.append(seen - items[i][1])
                        i += 1
                    next_index[p] = i
            if len(lags) >= total:
                return
            time.sleep(0.02)

    def on_delivery(at: float) -> Any:
        def cb(err: Any, msg: Any) -> None:
            if err is None:
                with lock:
                    produced[msg.partition()].append((msg.offset(), at))
        return cb

    poller = threading.Thread(target=poll, daemon=True)
    try:
        while not runner.assigned:  # the group formed: measure steady state, not the first join
            time.sleep(0.1)
        poller.start()
        start = time.time()
        for i in range(total):
            key, value, headers = _event(i % args.keys, i // args.keys + 1)
            producer.produce(topic, value=value, key=key, headers=headers, partition=(i % args.keys) % args.partitions,
                             on_delivery=on_delivery(time.time()))
            producer.poll(0)
            ahead = (i + 1) / args.rate - (time.time() - start)
            if ahead > 0:
                time.sleep(ahead)
        producer.flush(30)
        poller.join(60)
    finally:
        done.set()
        runner.stop()
        thread.join(60)
        consumer.close()
    lags.sort()
    if not lags:
        return {"offered_per_s": args.rate, "p99_commit_lag_s": None}
    return {"offered_per_s": args.rate, "lag_events": len(lags), "p50_commit_lag_s": round(lags[len(lags) // 2], 3),
            "p99_commit_lag_s": round(lags[max(0, int(len(lags) * 0.99) - 1)], 3)}


def _rss_mb() -> float:
    """This process's resident set now (the connector runs in it), from /proc."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _outage(kafka: Any, pg: Any, url: str, control: str, args: argparse.Namespace) -> dict[str, Any]:
    """Events at `rate` over `keys`: 5 s with the receiver up, then `outage_s` with it refusing connections; it
    comes back and production stops. Recovery = from its return until every event's offset is committed."""
    run_id = uuid.uuid4().hex[:8]
    topic, name = f"kafold.bench.effects-outage.{run_id}", f"bench-effects-outage-{run_id}"
    _topic(kafka, topic, args.partitions)
    runner, thread = _start(kafka, pg, name, topic, url, args.concurrency)
    consumer, producer = _consumer(kafka, runner.group_id), _producer(kafka)
    ends, rss, before = {p: 0 for p in range(args.partitions)}, [], _stats(control)
    warm = 5.0
    total = int(args.rate * (warm + args.outage_s))
    try:
        while not runner.assigned:
            time.sleep(0.1)
        start, is_down, next_rss = time.time(), False, 0.0
        for i in range(total):
            k = i % args.keys
            key, value, headers = _event(k, i // args.keys + 1, f"outage-{run_id}")  # keys of its own: order checked
            producer.produce(topic, value=value, key=key, headers=headers, partition=k % args.partitions)
            ends[k % args.partitions] += 1
            producer.poll(0)
            elapsed = time.time() - start
            if not is_down and elapsed >= warm:
                _switch(control, "down")
                is_down = True
                log.info("bench.receiver_down", seconds=args.outage_s)
            if is_down and elapsed >= next_rss:
                rss.append(_rss_mb())
                next_rss = elapsed + 0.5
            ahead = (i + 1) / args.rate - elapsed
            if ahead > 0:
                time.sleep(ahead)
        producer.flush(30)
        _switch(control, "up")
        back = time.time()
        log.info("bench.receiver_back")
        while _committed(consumer, topic, args.partitions) != ends:
            time.sleep(0.1)
        recovered = time.time() - back
        parked = len(ops.parked(pg, name))
    finally:
        runner.stop()
        thread.join(60)
        consumer.close()
    stats = _stats(control)
    return {"outage_s": args.outage_s, "outage_events": total, "outage_recovery_s": round(recovered, 2),
            "parked_after_outage": parked, "outage_delivered": stats["unique"] - before["unique"],
            "outage_out_of_order": stats["out_of_order"] - before["out_of_order"],
            "outage_rss_peak_mb": max(rss, default=0.0)}
