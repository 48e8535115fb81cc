"""Aggregate runtime: exactly-once commands/s, recovery replay events/s, and how fast the gate opens at the end."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import queue
import random
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import psutil

from kafold import kafka_clients, logs, topics
from kafold.client import CommandClient
from kafold.config import AggregateConfig, DaemonConfig, TopicSpec
from kafold.daemon.aggregates import AggregateRuntime
from kafold.daemon.aggregates.store import Entry
from kafold.daemon.aggregates.window import Window, accepted, event_ids
from kafold.daemon.aggregates.workers import AggregateWorkers
from kafold.domain import AggregateDomain
from kafold.envelope import Event, encode
from kafold.tools.bench import services, short_group
from kafold.tools.bench.progress import STALL_S, gates_progress, wait_progress

log = logs.get("kafold.bench.aggregates")
BANK = Path(__file__).resolve().parents[3] / "examples" / "bank"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--commands", type=int, default=100_000, help="commands for the throughput phase (default 100k)")
    p.add_argument("--accounts", type=int, default=10_000, help="aggregates the commands go to (default 10k)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the throughput phase's topics")
    p.add_argument("--batch", type=int, default=2000, help="commands per transaction (default 2000)")
    p.add_argument("--instances", type=int, default=1,
                   help="runtimes deciding the commands, each in its own process and in one consumer group, as "
                        "that many daemons on this machine would (default 1: in the bench's process)")
    p.add_argument("--processes", type=int, default=0,
                   help="decide in this many worker processes of one daemon (its `aggregate_processes`, "
                        "daemon/aggregates/workers.py) rather than in the bench's process (default 0: in process)")
    p.add_argument("--events", type=int, default=500_000, help="events in the replay phase's backlog (default 500k)")
    p.add_argument("--cache", type=int, default=None,
                   help="cache_max_aggregates of the throughput phase (default: the configuration's default)")
    p.add_argument("--state-dir", default="",
                   help="the throughput phase's runtime keeps a local state store here (default: none, evicted "
                        "aggregates are rebuilt from their events partition)")
    p.add_argument("--random-access", action="store_true",
                   help="commands go to accounts drawn at random (seeded) rather than in turn")
    p.add_argument("--cold-reads", type=int, default=0,
                   help="after the throughput phase, time this many state reads of aggregates not cached")
    p.add_argument("--restart", action="store_true",
                   help="with --state-dir: after the throughput phase, start the aggregate again on the same store "
                        "(a restart on the same host) and time it until every partition is live")
    p.add_argument("--no-replay", action="store_true", help="skip the replay phase")
    p.add_argument("--no-window-baseline", action="store_true",
                   help="skip the same-run baseline with the idempotency window off")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] (default: the dev stack, started if needed)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        kafka = short_group(services(stack, "aggregates", args.config, args.broker)[0])
        figures = _throughput(kafka, args)
        if not args.no_window_baseline:  # the same phase with the window off (ids forgotten at once)
            off = _throughput(kafka, args, window_s=0.0)
            figures["commands_per_s_window_off"] = off["commands_per_s"]
            figures["window_on_over_off"] = round(figures["commands_per_s"] / off["commands_per_s"], 3)
        if not args.no_replay:
            figures.update(_replay(kafka, args))
        figures.update(window_memory())
    return figures


def window_memory(ids: int = 200_000, aggregates: int = 10_000) -> dict[str, Any]:
    """Bytes per command id held in the idempotency window (tracemalloc over `ids` outcomes with uuid command
    ids, one event each, spread over `aggregates`), and what that means at 30,000 commands/s."""
    entries = {f"acc-{i:06d}": Entry(None, 0, 0) for i in range(aggregates)}
    names = list(entries)
    cids = [str(uuid.uuid4()) for _ in range(ids)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    window = Window(86_400_000, ids + 1)
    t0 = int(time.time() * 1000)
    for i, cid in enumerate(cids):
        aid = names[i % aggregates]
        entry = entries[aid]
        entry.version += 1
        window.remember(entry, aid, cid, accepted(t0 + i // 30, entry.version, 1), event_ids(cid, entry.version - 1, 1))
    per_id = (tracemalloc.get_traced_memory()[0] - before) / ids
    tracemalloc.stop()
    rate = 30_000
    return {"window_bytes_per_id": round(per_id),
            "window_mb_per_minute_at_30k_per_s": round(per_id * rate * 60 / 2**20),
            "window_mb_at_24h_at_30k_per_s": round(per_id * rate * 86_400 / 2**20),
            "window_mb_at_max_ids_default": round(per_id * 1_000_000 / 2**20),
            "window_s_held_at_30k_per_s_by_max_ids_default": round(1_000_000 / rate)}


def _setup(kafka: Any, name: str, partitions: int, batch: int, window_s: float = 86_400.0,
           instance: str = "bench", protector: Any = None, cache: int | None = None,
           state_dir: str = "") -> tuple[Any, Any]:
    agg = AggregateConfig(name=name, initial="bank_domain:initial", evolve="bank_domain:evolve",
                          decide="bank_domain:decide", partitions=partitions, idempotency_window_s=window_s)
    if cache is not None:
        agg = dataclasses.replace(agg, cache_max_aggregates=cache)
    domain = AggregateDomain.load(agg, [str(BANK)]).protected(protector)  # as the daemon's build_runtime
    daemon = DaemonConfig(group_prefix="kafold-bench", batch_max_records=batch, batch_max_wait_ms=50,
                          state_dir=state_dir)
    return agg, AggregateRuntime(kafka, daemon, agg, domain, instance_id=instance)


def _in_thread(rt: Any) -> threading.Thread:
    t = threading.Thread(target=rt.run, daemon=True, name="bench-aggregate")
    t.start()
    return t


def aggregate_throughput(kafka: Any, args: argparse.Namespace, window_s: float = 86_400.0, protector: Any = None,
                name: str | None = None, prefix: str = "acc-") -> dict[str, Any]:
    """Commands queued first (opens, then deposits: each accepted, one event + one result), then the runtime is
    started and timed from its first decided command to its last committed transaction. `protector`
    (kafold.protect, in process only): the runtime seals and opens protected fields as the daemon's does; its
    rules are keyed by aggregate type: `name`, a new one each run (default a fresh `bench.cmd.<hex>`); the aggregate
    ids are `prefix` and a number."""
    agg, rt = _setup(kafka, name or f"bench.cmd.{uuid.uuid4().hex[:6]}", args.partitions, args.batch, window_s,
                     protector=protector, cache=getattr(args, "cache", None),
                     state_dir=getattr(args, "state_dir", ""))
    topics.ensure(kafka, [TopicSpec(agg.topic(k), args.partitions, 1, {}) for k in ("events", "commands", "results")])
    ids = [f"{prefix}{i:06d}" for i in range(args.accounts)]
    queued = _queue(kafka, agg, ids, args)
    if args.instances > 1:
        return _throughput_instances(kafka, args, agg.name, window_s, queued)
    if getattr(args, "processes", 0) > 0:
        return _throughput_processes(kafka, args, agg, queued, ids, window_s)
    thread = _in_thread(rt)  # the commands wait in the topic: the runtime's own speed is measured
    try:
        wait_progress(lambda: rt.counts["commands"] >= queued, lambda: gates_progress(rt.counts, rt.gates),
                      f"every command ({queued}) to be processed")
        finished = time.monotonic()
        started = min(g.first_decided_at for g in rt.gates.values() if g.first_decided_at)
        counts = dict(rt.counts)
        held = rt.idempotency()["ids_held"]
        cold = _cold_reads(rt, ids, getattr(args, "cold_reads", 0))
        rss = psutil.Process().memory_info().rss
    finally:
        rt.stop()
        thread.join(30)
    elapsed = finished - started
    if getattr(args, "restart", False) and getattr(args, "state_dir", ""):
        cold.update(_restart(kafka, args, agg.name, window_s, counts["events"]))
    return {"commands": counts["commands"], "commands_per_s": round(counts["commands"] / elapsed),
            "window_ids_held": held,
            "commands_accepted": counts["accepted"], "events_written": counts["events"],
            "transactions": counts["batches"], "commands_phase_s": round(elapsed, 2),
            "partition_scans_aggregates": counts["reloads"], "rss_mb": round(rss / 2**20), **cold}


def _queue(kafka: Any, agg: Any, ids: list[str], args: argparse.Namespace) -> int:
    """Queue the phase's commands (one OpenAccount per account, then deposits); how many. Sent in slices and not
    kept: the bench's own memory then does not grow with the commands it queued."""
    rng = random.Random(56)
    pick = (lambda i: rng.choice(ids)) if getattr(args, "random_access", False) else (lambda i: ids[i % len(ids)])
    deposits = max(0, args.commands - len(ids))
    with CommandClient(kafka, agg) as client:
        for i in range(0, len(ids), 20000):
            client.send_many([client.command(a, "OpenAccount", {"owner": a}) for a in ids[i:i + 20000]], wait=False)
        for i in range(0, deposits, 20000):
            client.send_many([client.command(pick(j), "Deposit", {"amount": 1 + j % 97})
                              for j in range(i, min(deposits, i + 20000))], wait=False)
    return len(ids) + deposits


def process_memory(pids: list[int | None]) -> dict[str, Any]:
    """RSS of the processes `pids` (MiB, each and summed), and how much of it is file pages mapped (`rss_file`: the
    local stores' LMDB maps and the shared libraries, page cache the kernel reclaims) rather than the processes'
    own memory (`rss_anon`); from /proc/PID/status (Linux), else psutil's RSS alone."""
    each: list[dict[str, int]] = []
    for pid in pids:
        if pid is None:
            continue
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            kb = {k: int(v.split()[0]) for k, v in (x.split(":", 1) for x in lines) if k in ("VmRSS", "RssAnon",
                                                                                               "RssFile")}
            each.append({"rss": kb["VmRSS"] // 1024, "anon": kb.get("RssAnon", 0) // 1024,
                         "file": kb.get("RssFile", 0) // 1024})
        except (OSError, KeyError, ValueError):
            with contextlib.suppress(psutil.Error):
                each.append({"rss": psutil.Process(pid).memory_info().rss // 2**20, "anon": 0, "file": 0})
    return {"rss_mb": sum(e["rss"] for e in each), "rss_anon_mb": sum(e["anon"] for e in each),
            "rss_file_mb": sum(e["file"] for e in each), "rss_mb_each": [e["rss"] for e in each]}


# The peer harness (../shared/peers/kstreams_aggregate/run_kafold.py) wraps `_setup`, `_in_thread`, `_throughput`
# and `_throughput_instances` with its CPU probes: `run` calls the phase through this module name so its wrapper runs.
_throughput = aggregate_throughput


def _restart(kafka: Any, args: argparse.Namespace, name: str, window_s: float, history: int) -> dict[str, Any]:
    """The same aggregate started again on the same local store (as a daemon restarted on its host): seconds from
    the runtime's start (its producer, the group's join, each partition's open check, events tail and results tail)
    to every partition's commands resumed (in the bench's process: its RSS is the throughput phase's, not measured
    again). `restart_results_read`: the results the gates read (a trusted store's: only those past its offset)."""
    _, rt = _setup(kafka, name, args.partitions, args.batch, window_s, cache=args.cache, state_dir=args.state_dir)
    began = time.monotonic()
    thread = _in_thread(rt)
    try:
        # a gate is LIVE once its commands resumed (after its results read and the store's seal): `ready`
        wait_progress(lambda: rt.ready and len(rt.gates) == args.partitions,
                      lambda: gates_progress(rt.counts, rt.gates), "the restarted runtime to be live")
        live_s = time.monotonic() - began
        trusted = sum(1 for g in rt.gates.values() if g.start > 0)  # partitions whose store was trusted
        results_read = rt.counts["recovery_results_read"]
    finally:
        rt.stop()
        thread.join(30)
    return {"restart_live_s": round(live_s, 2), "restart_history_events": history,
            "restart_partitions_trusted": trusted, "restart_results_read": results_read}


def _cold_reads(rt: Any, ids: list[str], n: int) -> dict[str, Any]:
    """`n` state reads (AggregateRuntime.get, as GET /aggregates serves them) of aggregates not cached: p50, p99."""
    cold = [a for a in ids if a not in rt.store.entries][:n]
    took = []
    for aid in cold:
        t = time.perf_counter()
        rt.get(aid)
        took.append(time.perf_counter() - t)
    if not took:
        return {}
    took.sort()
    return {"cold_reads": len(took), "cold_read_p50_ms": round(took[len(took) // 2] * 1000, 2),
            "cold_read_p99_ms": round(took[min(len(took) - 1, int(len(took) * 0.99))] * 1000, 2)}


def _throughput_processes(kafka: Any, args: argparse.Namespace, agg: Any, commands: int, ids: list[str],
                          window_s: float) -> dict[str, Any]:
    """The commands phase decided by one daemon's `--processes` worker processes (AggregateWorkers, as the daemon
    runs `aggregate_processes`): timed from the first command any worker decided (its gates' reports; one monotonic
    clock for the machine) to the report that completes the count (sent after every batch). Partitions the workers
    hand over while they join count against it, as with --instances. Then, the workers still running: their memory
    (`runtime_rss_mb`: the worker processes, which hold the runtimes, apart from the bench's own process) and
    `--cold-reads` (asked of the worker holding the key, over its pipe, as the daemon's HTTP reads are)."""
    daemon = DaemonConfig(group_prefix="kafold-bench", batch_max_records=args.batch, batch_max_wait_ms=50,
                          state_dir=getattr(args, "state_dir", ""), aggregate_processes=args.processes,
                          python_path=[str(BANK)])
    workers = AggregateWorkers(kafka, daemon, agg, BANK, instance_id="bench")
    thread = threading.Thread(target=workers.run, daemon=True, name="bench-aggregate-workers")
    thread.start()
    first: float | None = None
    try:
        def done() -> bool:
            nonlocal first
            if workers.error is not None or not thread.is_alive():
                raise RuntimeError(f"bench: the worker processes failed: {workers.error}")
            decided = [g.first_decided_at for g in list(workers.gates.values()) if g.first_decided_at]
            first = min([*decided, first] if first else decided, default=None)
            return workers.counts.get("commands", 0) >= commands

        wait_progress(done, lambda: gates_progress(workers.counts, workers.gates),
                      f"every command ({commands}) to be processed by the worker processes")
        finished = time.monotonic()
        counts = workers.counts
        memory = process_memory(workers.pids())
        cold = _cold_reads_workers(workers, ids, getattr(args, "cold_reads", 0))
    finally:
        workers.stop()
        thread.join(60)
    assert first is not None
    out = {"commands": counts["commands"], "commands_per_s": round(counts["commands"] / (finished - first)),
           "processes": args.processes, "commands_phase_s": round(finished - first, 2),
           "workers_restarted": counts.get("workers_restarted", 0),
           "partition_scans_aggregates": counts.get("reloads", 0), "transactions": counts.get("batches", 0),
           **{f"runtime_{k}": v for k, v in memory.items()},
           "bench_rss_mb": round(psutil.Process().memory_info().rss / 2**20), **cold}
    if getattr(args, "restart", False) and getattr(args, "state_dir", ""):
        out.update(_restart(kafka, args, agg.name, window_s, counts.get("events", 0)))
    return out


def _cold_reads_workers(workers: AggregateWorkers, ids: list[str], n: int) -> dict[str, Any]:
    """`n` state reads of aggregates the workers answer from their local stores (not cached), each asked of the
    worker holding its partition (AggregateWorkers.get, the daemon's read path): p50, p99, pipe round trip included.
    Keys drawn at random (seeded); one answered from memory is not counted."""
    rng = random.Random(5656)
    took: list[float] = []
    for _ in range(n * 4):
        if len(took) >= n:
            break
        t = time.perf_counter()
        got = workers.get(rng.choice(ids))
        elapsed = time.perf_counter() - t
        if got is not None and got[2] == "store":
            took.append(elapsed)
    if not took:
        return {}
    took.sort()
    return {"cold_reads": len(took), "cold_read_p50_ms": round(took[len(took) // 2] * 1000, 2),
            "cold_read_p99_ms": round(took[min(len(took) - 1, int(len(took) * 0.99))] * 1000, 2)}


def _instance(kafka: Any, name: str, partitions: int, batch: int, window_s: float, instance: str, go: Any,
              stop: Any, out: Any) -> None:
    """One runtime of `--instances` in a child process: built, then started on `go`; reports (instance, commands
    committed, first command decided, when the count last grew: time.monotonic, one clock for the machine)."""
    _, rt = _setup(kafka, name, partitions, batch, window_s, instance=instance)
    go.wait()
    thread = _in_thread(rt)
    first, last, seen = None, None, 0
    try:
        while not stop.is_set() and thread.is_alive():
            decided = [g.first_decided_at for g in list(rt.gates.values()) if g.first_decided_at]
            first = min([*decided, first] if first else decided, default=None)
            if rt.counts["commands"] != seen:
                seen, last = rt.counts["commands"], time.monotonic()
            out.put((instance, seen, first, last))
            time.sleep(0.02)
    finally:
        rt.stop()
        thread.join(30)
        out.put((instance, rt.counts["commands"], first, last))


def _throughput_instances(kafka: Any, args: argparse.Namespace, name: str, window_s: float,
                          commands: int) -> dict[str, Any]:
    """The commands phase with `--instances` runtimes in child processes sharing the group: timed from the first
    command any of them decided to the last transaction any of them committed (the rebalances while they join
    count against it)."""
    ctx = multiprocessing.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_instance, name=f"bench-aggregate-{i}", daemon=True,
                         args=(kafka, name, args.partitions, args.batch, window_s, f"bench-{i}", go, stop, out))
             for i in range(args.instances)]
    for proc in procs:
        proc.start()
    latest: dict[str, tuple[int, float | None, float | None]] = {}
    go.set()
    moved, seen = time.monotonic(), -1
    try:
        while (total := sum(c for c, _, _ in latest.values())) < commands:
            if total != seen:  # as wait_progress: fails when the count stalls, not at a deadline
                moved, seen = time.monotonic(), total
            if time.monotonic() - moved > STALL_S or not all(proc.is_alive() for proc in procs):
                raise TimeoutError(f"bench: the instances did not process every command (one died, or no command "
                                   f"in {STALL_S:g} s): {sorted(latest.items())} of {commands}")
            with contextlib.suppress(queue.Empty):
                instance, count, first, last = out.get(timeout=1)
                latest[instance] = (count, first, last)
    finally:
        stop.set()
        deadline = time.monotonic() + 60
        while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):  # a child exits only once what it queued was taken
                out.get(timeout=0.1)
        for proc in procs:
            proc.join(1)
    started = min(f for _, f, _ in latest.values() if f is not None)
    finished = max(t for _, _, t in latest.values() if t is not None)
    total = sum(c for c, _, _ in latest.values())
    return {"commands": total, "commands_per_s": round(total / (finished - started)), "instances": args.instances,
            "commands_per_instance": sorted(c for c, _, _ in latest.values()),
            "commands_phase_s": round(finished - started, 2)}


def _replay(kafka: Any, args: argparse.Namespace) -> dict[str, Any]:
    """A backlog of events in one partition, with commands already queued: the replay rate, and the delay from
    reaching the captured end offset to the gate opening and to the first command decided."""
    agg, rt = _setup(kafka, f"bench.replay.{uuid.uuid4().hex[:6]}", 1, args.batch)
    topics.ensure(kafka, [TopicSpec(agg.topic(k), 1, 1, {}) for k in ("events", "commands", "results")])
    producer = kafka_clients.producer(kafka, **{"enable.idempotence": True, "linger.ms": 50,
                                                "batch.num.messages": 10000})
    accounts = max(1, args.events // 50)
    at, topic = "2024-05-01T12:00:00.000000Z", agg.topic("events")
    for i in range(args.events):
        aid, v = f"acc-{i % accounts:06d}", i // accounts + 1
        kind, payload = ("AccountOpened", {"owner": aid}) if v == 1 else ("MoneyDeposited", {"amount": 1})
        # each event caused by its own command id, as the runtime writes them: the replay rebuilds the window too
        key, value, headers = encode(Event(f"{aid}/{v}", kind, agg.name, aid, v, at, f"{aid}/{v}", payload,
                                           causation_id=f"cmd-{aid}/{v}"))
        kafka_clients.produce(producer, topic, value, key, headers, partition=0)
    producer.flush(120)
    with CommandClient(kafka, agg) as client:
        client.send_many([client.command("acc-000000", "Deposit", {"amount": 1}) for _ in range(100)], wait=False)
    thread = _in_thread(rt)
    try:
        wait_progress(lambda: 0 in rt.gates and rt.gates[0].first_decided_at is not None,
                      lambda: gates_progress(rt.counts, rt.gates), "recovery and a command")
        gate = rt.gates[0]
    finally:
        rt.stop()
        thread.join(30)
    assert gate.reached_at is not None and gate.opened_at is not None and gate.first_decided_at is not None
    replay_s = gate.reached_at - gate.began
    return {"replay_events": gate.events_replayed, "replay_events_per_s": round(gate.events_replayed / replay_s),
            "replay_s": round(replay_s, 2), "captured_end": gate.captured_end, "replayed_to": gate.position,
            "gate_open_delay_s": round(gate.opened_at - gate.reached_at, 4),
            "first_command_after_end_s": round(gate.first_decided_at - gate.reached_at, 4)}
