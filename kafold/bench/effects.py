"""Webhook effects to a local receiver: effects/s with per-key order, commit lag at an offered rate, RSS."""

from __future__ import annotations

import argparse
import contextlib
import resource
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kafold import logs
from kafold.bench import embedded_stack, short_group

log = logs.get("kafold.bench.effects")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=50_000, help="events for the throughput phase (default 50k)")
    p.add_argument("--keys", type=int, default=2000, help="distinct keys (aggregates)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the benchmark topics")
    p.add_argument("--concurrency", type=int, default=128, help="effects in flight at once")
    p.add_argument("--rate", type=float, default=1000.0, help="offered events/s in the commit-lag phase")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the commit-lag phase")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kafold import db
    from kafold.config import KafkaConfig, PostgresConfig, load_file

    with contextlib.ExitStack() as stack:
        if args.config:
            cfg = load_file(args.config).config
            kafka, pg = cfg.kafka, cfg.postgres
        else:
            bootstrap, pg_url = stack.enter_context(embedded_stack("effects"))
            kafka, pg = KafkaConfig(bootstrap_servers=bootstrap), PostgresConfig(url=pg_url)
        kafka = short_group(kafka)
        pg = PostgresConfig(**{**pg.__dict__, "schema": "kafold_bench_effects"})
        db.upgrade(pg)
        url = stack.enter_context(_receiver())
        figures = _throughput(kafka, pg, url, args)
        figures.update(_commit_lag(kafka, pg, url, args))
    figures["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return figures


@contextlib.contextmanager
def _receiver() -> Iterator[str]:
    """The receiver runs in its own process (its CPU is not the daemon's): POST /hook, GET /stats."""
    proc = subprocess.Popen([sys.executable, "-c", "from kafold.bench.effects import serve; serve()"],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int((proc.stdout.readline() if proc.stdout else "").strip())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def serve() -> None:
    """A minimal webhook receiver: checks per-key order (versions increase per aggregate id) and counts."""
    import asyncio

    import orjson
    from aiohttp import web

    state: dict[str, Any] = {"count": 0, "out_of_order": 0, "first": None, "last": None, "ids": set()}
    last: dict[str, int] = {}

    async def hook(request: web.Request) -> web.Response:
        doc = orjson.loads(await request.read())
        key, version = doc["aggregate_id"], doc["version"]
        if last.get(key, 0) >= version and request.headers["webhook-id"] not in state["ids"]:
            state["out_of_order"] += 1
        last[key] = max(version, last.get(key, 0))
        state["ids"].add(request.headers["webhook-id"])
        state["count"] += 1
        state["first"] = state["first"] or time.time()
        state["last"] = time.time()
        return web.Response(status=204)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({k: v for k, v in state.items() if k != "ids"} | {"unique": len(state["ids"])})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/hook", hook)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        print(site._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(main())


def _stats(url: str) -> dict[str, Any]:
    import urllib.request

    import orjson

    with urllib.request.urlopen(f"{url}/stats", timeout=10) as resp:
        return dict(orjson.loads(resp.read()))


def _topic(kafka: Any, name: str, partitions: int) -> None:
    from confluent_kafka.admin import NewTopic

    from kafold import kafka_clients

    admin = kafka_clients.admin(kafka)  # kept referenced until the futures resolve
    for fut in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        fut.result(15)


def _start(kafka: Any, pg: Any, name: str, topic: str, url: str, concurrency: int) -> tuple[Any, threading.Thread]:
    from kafold.config import ConnectorConfig, DaemonConfig
    from kafold.connectors.effects.task import with_services
    from kafold.connectors.registry import instantiate
    from kafold.daemon.runner import SinkRunner

    settings = ConnectorConfig(name=name, connector_class="webhook", topics=[topic], config={
        "url": f"{url}/hook", "allow_http": True, "concurrency": concurrency})
    connector = instantiate(settings, Path("."))
    daemon = DaemonConfig(group_prefix="kafold-bench", batch_max_records=5000, batch_max_wait_ms=100)
    runner = SinkRunner(connector, with_services(connector.task_configs(1)[0], kafka, pg), kafka=kafka,
                        daemon=daemon)
    thread = threading.Thread(target=runner.run, name="bench-effects", daemon=True)
    thread.start()
    return runner, thread


def _committed(consumer: Any, topic: str, partitions: int) -> dict[int, int]:
    from confluent_kafka import TopicPartition as KafkaTP

    got = consumer.committed([KafkaTP(topic, p) for p in range(partitions)], timeout=10)
    return {tp.partition: tp.offset for tp in got}


def _consumer(kafka: Any, group: str) -> Any:
    from confluent_kafka import Consumer

    from kafold import kafka_clients

    return Consumer(kafka_clients.librdkafka(kafka, **{"group.id": group}))


def _producer(kafka: Any) -> Any:
    from kafold import kafka_clients

    return kafka_clients.producer(kafka, **{"enable.idempotence": True, "linger.ms": 5})


def _event(key: int, version: int) -> tuple[bytes, bytes, Any]:
    from kafold.envelope import Event, encode

    return encode(Event.new("Notified", "bench", f"agg-{key}", version, {"n": version, "note": "x" * 120}))


def _throughput(kafka: Any, pg: Any, url: str, args: argparse.Namespace) -> dict[str, Any]:
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
    before = _stats(url)["count"]
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
    stats = _stats(url)
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
