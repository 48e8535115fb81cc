"""The daemon's hot path: a Faust agent with `stream.take()` vs the batched SinkRunner, same topic and events.

`--compare-faust-confluent`: alternated rounds of the SinkRunner and of a Faust agent on Faust's `confluent://`
transport (librdkafka, as the runner) doing the same work per batch (envelope decode, the `log` sink's put), so the
choice of consumer rests on a like-for-like figure (docs/benchmarks.md, "daemon host"). A Faust round that gets no
event within `--faust-idle-s` ends with a rate of 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka.admin import NewTopic

from kafold import kafka_clients, logs
from kafold.config import ConnectorConfig, DaemonConfig
from kafold.connectors.api import sink_record
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner
from kafold.envelope import Event, decode, encode
from kafold.tools.bench import services, short_group

log = logs.get(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=100_000, help="events to produce and consume (default 100k)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the benchmark topic")
    p.add_argument("--take", type=int, default=2000, help="Faust stream.take() batch size")
    p.add_argument("--compare-faust-confluent", action="store_true",
                   help="alternate the runner with a Faust agent on the confluent:// transport doing the same work")
    p.add_argument("--faust-idle-s", type=float, default=120.0,
                   help="end a Faust round that received no event after this long (its rate is then 0)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds with --compare-faust-confluent")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] (default: the dev stack, started if needed)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        kafka = short_group(services(stack, "daemon", args.config, args.broker)[0])
        topic = f"kafold.bench.daemon.{uuid.uuid4().hex[:8]}"
        _produce(kafka, topic, args.events, args.partitions)
        if args.compare_faust_confluent:
            return _compare(kafka, topic, args)
        runner_rate = _runner(kafka, topic, args.events)
        faust_rate, faust_batches = _faust(kafka, topic, args.events, args.take)
    return {"events": args.events, "partitions": args.partitions,
            "runner_events_per_s": round(runner_rate), "faust_take_events_per_s": round(faust_rate),
            "faust_take_batch": args.take, "faust_mean_batch": round(faust_batches, 1),
            "runner_us_per_event": round(1e6 / runner_rate, 2), "faust_us_per_event": round(1e6 / faust_rate, 2),
            "ratio": round(runner_rate / faust_rate, 1)}


def _compare(kafka: Any, topic: str, args: argparse.Namespace) -> dict[str, Any]:
    """Alternated rounds: the runner, then Faust on confluent://, each consuming the topic from the start."""
    runner: list[float] = []
    faust_cf: list[float] = []
    batches: list[float] = []
    for _ in range(args.rounds):
        runner.append(_runner(kafka, topic, args.events))
        rate, mean = _faust(kafka, topic, args.events, args.take, transport="confluent", same_work=True,
                            idle_s=args.faust_idle_s)
        faust_cf.append(rate)
        batches.append(mean)
        log.warning("bench.daemon.round", runner=round(runner[-1]), faust_confluent=round(rate))
    return {"events": args.events, "partitions": args.partitions, "rounds": args.rounds,
            "runner_events_per_s": [round(r) for r in runner],
            "faust_confluent_events_per_s": [round(r) for r in faust_cf],
            "faust_take_batch": args.take, "faust_mean_batch": [round(b, 1) for b in batches],
            "ratio": [round(a / b, 2) if b else None for a, b in zip(runner, faust_cf, strict=True)]}


def _log_task(kafka: Any) -> Any:
    """A started `log` sink task (its lines filtered out), as the runner's, for Faust's agent to put into; its
    context is an idle SinkRunner's (never run)."""
    settings = ConnectorConfig(name=f"bench-{uuid.uuid4().hex[:6]}", connector_class="log", topics=["-"],
                               config={"level": "debug", "sample_types": False})
    connector = instantiate(settings, Path("."))
    idle = SinkRunner(connector, connector.task_configs(1)[0], kafka=kafka,
                      daemon=DaemonConfig(group_prefix="kafold.bench"))
    idle.task.start(idle.task_config, idle.context)
    return idle.task


def _produce(kafka: Any, topic: str, n: int, partitions: int) -> None:
    admin = kafka_clients.admin(kafka)
    for fut in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        fut.result(15)
    producer = kafka_clients.producer(kafka, **{"linger.ms": 20, "enable.idempotence": True})
    for i in range(n):
        event = Event.new("Deposited", "account", f"acc-{i % 1000}", i // 1000 + 1, {"amount": i, "note": "x" * 60})
        key, value, headers = encode(event)
        kafka_clients.produce(producer, topic, value, key, headers)
    assert producer.flush(60) == 0


def _runner(kafka: Any, topic: str, n: int) -> float:
    """SinkRunner + the `log` connector (its lines filtered out): consume, decode, put, commit per batch."""
    logs.configure("warning")
    settings = ConnectorConfig(name=f"bench-{uuid.uuid4().hex[:6]}", connector_class="log", topics=[topic],
                               config={"level": "debug", "sample_types": False})
    connector = instantiate(settings, Path("."))
    runner = SinkRunner(connector, connector.task_configs(1)[0], kafka=kafka,
                        daemon=DaemonConfig(group_prefix="kafold.bench"))
    first: list[float] = []

    def on_batch(stats: Any) -> None:
        if not first:
            first.append(time.perf_counter() - stats.duration_s)
        if runner.counts["records"] >= n:
            runner.stop()

    runner.on_batch = on_batch
    thread = threading.Thread(target=runner.run)
    thread.start()
    thread.join()
    return runner.counts["records"] / (time.perf_counter() - first[0])


def _faust(kafka: Any, topic: str, n: int, take: int, transport: str = "kafka",
           same_work: bool = False, idle_s: float = 120.0) -> tuple[float, float]:
    """A tiny Faust agent: `stream.take(take, within=0.2)`, one orjson.loads per value, nothing else; with
    `same_work`, `stream.take_events` and per batch what the runner does: envelope decode, the `log` sink's put
    (Faust commits on its own interval). `transport`: "kafka" (aiokafka) or "confluent" (librdkafka)."""
    # faust: kafold[daemon] and heavy to import; only this benchmark's baseline uses it
    import faust

    ak = kafka_clients.aiokafka_kwargs(kafka)
    servers = [s.strip() for s in ak["bootstrap_servers"].split(",") if s.strip()]
    task: Any = _log_task(kafka) if same_work else None
    datadir = tempfile.mkdtemp(prefix="kafold-bench-faust-")
    app = faust.App(f"kafold-bench-{uuid.uuid4().hex[:6]}", broker=[f"{transport}://{s}" for s in servers],
                    datadir=datadir, web_enabled=False, topic_disable_leader=True,
                    broker_session_timeout=6.0, broker_rebalance_timeout=6.0, broker_heartbeat_interval=1.0,
                    consumer_auto_offset_reset="earliest", stream_buffer_maxsize=take * 2)
    source = app.topic(topic, value_serializer="raw", key_serializer="raw")
    seen = {"events": 0, "batches": 0, "first": 0.0, "last": 0.0}
    worker: Any = None
    stopping: list[Any] = []

    def stop_at(count: float) -> None:
        if count >= n and not seen["last"]:
            seen["last"] = time.perf_counter()
            stopping.append(asyncio.ensure_future(worker.stop()))

    async def same(stream: Any) -> None:
        async for events in stream.take_events(take, within=0.2):
            if not seen["first"]:
                seen["first"] = time.perf_counter()
            records = []
            for e in events:
                m = e.message
                event = decode(m.key, m.value, m.headers)
                records.append(sink_record(m.topic, m.partition, m.offset, event.aggregate_id, event,
                                           int(m.timestamp * 1000) if m.timestamp else None))
            task.put(records)
            seen["events"] += len(events)
            seen["batches"] += 1
            stop_at(seen["events"])

    async def count(stream: Any) -> None:
        async for values in stream.take(take, within=0.2):
            if not seen["first"]:
                seen["first"] = time.perf_counter()
            for v in values:
                orjson.loads(v)
            seen["events"] += len(values)
            seen["batches"] += 1
            stop_at(seen["events"])

    app.agent(source, name="bench")(same if same_work else count)

    def give_up() -> None:  # a transport that never delivers (Faust's confluent driver here) ends the round
        if not seen["first"]:
            log.warning("bench.daemon.faust_no_events", transport=transport, waited_s=idle_s)
            asyncio.run_coroutine_threadsafe(worker.stop(), worker.loop)

    watchdog = threading.Timer(idle_s, give_up)  # a thread: Faust starts no app task before its assignment
    watchdog.daemon = True
    watchdog.start()

    worker = faust.Worker(app, quiet=True, loglevel="warning", override_logging=False, redirect_stdouts=False)
    worker.spinner = None
    with contextlib.suppress(SystemExit):
        worker.execute_from_commandline()
    watchdog.cancel()
    asyncio.set_event_loop(asyncio.new_event_loop())  # the worker closed its loop
    with contextlib.suppress(OSError):
        os.rmdir(datadir)
    # Timed from the first batch: the group join (seconds on the embedded broker) is not the hot path.
    if not seen["last"]:
        return 0.0, 0.0
    return seen["events"] / (seen["last"] - seen["first"]), seen["events"] / max(1, seen["batches"])
