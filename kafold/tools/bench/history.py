"""History reads (`GET /aggregates/{name}/{id}/events`, `state get --version`) of one aggregate in a long partition.

One events partition of `--events` bank events (default 1M) over `--aggregates` accounts, written as the aggregate
runtime writes them: a Kafka transaction per batch of `--txn-events` events. Measured: the index backfill of the
partition (`kafold events index`), a page of one aggregate's events through the index (the read path of the HTTP
route, `kafold.history.History.events`, its readers kept as the daemon keeps them), the state at a version, a read
after new events arrived (the catch-up it includes), and, for comparison, the scan the index replaces (reading the
partition to pick one aggregate's events, which is what `state get` without the index pays).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
import uuid
from pathlib import Path
from typing import Any

from kafold import db, kafka_clients, logs, topics
from kafold.config import AggregateConfig, TopicSpec
from kafold.envelope import Event, encode
from kafold.history import History
from kafold.snapshot import Domain, kafka_io
from kafold.tools.bench import services

BANK = Path(__file__).resolve().parents[3] / "examples" / "bank"
AT = "2024-05-01T12:00:00.000000Z"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=1_000_000, help="events in the partition (default 1M)")
    p.add_argument("--aggregates", type=int, default=20_000, help="accounts the events are spread over")
    p.add_argument("--txn-events", type=int, default=200, help="events per Kafka transaction (a runtime batch)")
    p.add_argument("--reads", type=int, default=300, help="history reads timed (random accounts)")
    p.add_argument("--limit", type=int, default=100, help="events per page read")
    p.add_argument("--variants", default="4:5,1:5",
                   help="point readers:fetch wait ms of the History objects compared on the same partition (reads "
                        "alternated between them); the first one's figures are the page_* and state_at_* keys")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack)")


def _produce(kafka: Any, agg: AggregateConfig, events: int, aggregates: int, per_txn: int, rng: random.Random,
             versions: dict[str, int]) -> None:
    """`events` deposits (an opening first) spread at random over the accounts, `per_txn` per transaction."""
    topic, ids = agg.topic("events"), list(versions)
    producer = kafka_clients.producer(kafka, **{"transactional.id": f"bench-history-{uuid.uuid4().hex[:8]}",
                                                "linger.ms": 5})
    producer.init_transactions(30)
    for start in range(0, events, per_txn):
        producer.begin_transaction()
        for i in range(start, min(events, start + per_txn)):
            aid = ids[i] if i < len(ids) and versions[ids[i]] == 0 else rng.choice(ids)
            v = versions[aid] = versions[aid] + 1
            kind, payload = ("AccountOpened", {"owner": f"owner {aid}", "currency": "EUR"}) if v == 1 else \
                ("MoneyDeposited", {"amount": rng.randint(1, 500) * 100})
            key, value, headers = encode(Event(f"{aid}/{v}", kind, agg.name, aid, v, AT, f"c-{aid}/{v}", payload,
                                               1, f"c-{aid}/{v}"))
            producer.produce(topic, value, key, headers=headers)
        producer.commit_transaction(60)


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs.configure("warning")
    rng = random.Random(11)
    with contextlib.ExitStack() as stack:
        kafka, pgc = services(stack, "history", args.config, args.broker)
        db.upgrade(pgc)
        name = f"hist{uuid.uuid4().hex[:8]}"
        agg = AggregateConfig(name=name, initial="bank_domain:initial", evolve="bank_domain:evolve",
                              decide="bank_domain:decide", partitions=1, fingerprint="bench-v1")
        topics.ensure(kafka, [TopicSpec(agg.topic("events"), 1, 1, {})])
        versions = {f"acc-{i:07d}": 0 for i in range(args.aggregates)}
        began = time.monotonic()
        _produce(kafka, agg, args.events, args.aggregates, args.txn_events, rng, versions)
        produce_s = time.monotonic() - began
        domain = Domain.load(agg, [str(BANK)])
        variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
        made = {v: History(kafka, pgc, agg, domain, readers=v[0], fetch_wait_ms=v[1]) for v in variants}
        for h in made.values():
            stack.callback(h.close)
        history = made[variants[0]]

        began = time.monotonic()
        backfill = history.catch_up(0)
        backfill_s = time.monotonic() - began

        ids = list(versions)
        for h in made.values():
            for aid in ids[:16]:  # connections made, as a daemon's long-lived readers have them
                h.events(aid, 1, args.limit)
        pages: dict[Any, list[float]] = {v: [] for v in variants}
        states: dict[Any, list[float]] = {v: [] for v in variants}
        counts = []
        for _ in range(args.reads):
            aid = rng.choice(ids)
            for v, h in made.items():  # the same aggregate through each variant, one after the other
                t = time.perf_counter()
                page = h.events(aid, 1, args.limit)
                pages[v].append(time.perf_counter() - t)
            counts.append(len(page.events))
        for _ in range(max(1, args.reads // 3)):
            aid = rng.choice(ids)
            for v, h in made.items():
                t = time.perf_counter()
                h.state_at(aid, versions[aid])
                states[v].append(time.perf_counter() - t)

        _produce(kafka, agg, 1000, args.aggregates, args.txn_events, rng, versions)  # new events since the index
        t = time.perf_counter()
        history.events(rng.choice(ids), 1, args.limit)
        after_new = time.perf_counter() - t

        scans = []
        reader = kafka_io.reader(kafka)
        stack.callback(reader.close)
        for _ in range(2):
            wanted = rng.choice(ids).encode()
            t = time.perf_counter()
            found = 0
            for _offsets, keys, _values in kafka_io.read_range(reader, agg.topic("events"), 0, 0, None):
                found += sum(1 for k in keys if k == wanted)
            scans.append(time.perf_counter() - t)
        return {
            "events": args.events, "aggregates": args.aggregates, "events_per_transaction": args.txn_events,
            "produce_s": round(produce_s, 1),
            "backfill_s": round(backfill_s, 1), "backfill_events_per_s": round(backfill.indexed / backfill_s),
            "page_limit": args.limit, "page_events_mean": round(sum(counts) / len(counts), 1),
            "page_p50_ms": _pct(pages[variants[0]], 0.5), "page_p99_ms": _pct(pages[variants[0]], 0.99),
            "page_max_ms": _pct(pages[variants[0]], 1.0),
            "state_at_p50_ms": _pct(states[variants[0]], 0.5), "state_at_p99_ms": _pct(states[variants[0]], 0.99),
            "variants_page_p50_p99_ms": {f"{r}:{w}": [_pct(pages[(r, w)], 0.5), _pct(pages[(r, w)], 0.99)]
                                         for r, w in variants},
            "variants_state_at_p50_p99_ms": {f"{r}:{w}": [_pct(states[(r, w)], 0.5), _pct(states[(r, w)], 0.99)]
                                             for r, w in variants},
            "page_after_1000_new_events_ms": round(after_new * 1000, 1),
            "partition_scan_ms": round(min(scans) * 1000),
        }
