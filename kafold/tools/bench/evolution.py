"""Evolving events and foreign records: a projection over events that all need one upcast step, over plain JSON
records (`converter = "json"`), over the same records in Avro through a Schema Registry (`converter = "avro"`) and over
Debezium change events (`converter = "debezium"`), each against the same events in kafold's envelope, alternated in
one run."""

from __future__ import annotations

import argparse
import contextlib
import tomllib
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka.serialization import MessageField, SerializationContext

from kafold import devstack, logs
from kafold.envelope import Event
from kafold.tools.bench.daemons import daemon_stack
from kafold.tools.bench.figures import median_ratio, rounded
from kafold.tools.bench.projection import COLUMNS, produce_events, produce_records, run_projection
from kafold.tools.dev import registry_server

log = logs.get(__name__)

# Yesterday's shape of a deposit: another type name and field, turned into today's MoneyDeposited by one step.
UPCASTERS = [{"type": "FundsAdded", "from_version": 1, "rename_type": "MoneyDeposited",
              "rename_fields": {"amt": "amount"}}]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=300_000, help="events per topic (default 300k)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of each kind (default 2)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"what to measure against the envelope, comma-separated (default {','.join(KINDS)})")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the benchmark topics")
    p.add_argument("--batch", type=int, default=2500, help="daemon.batch_max_records")
    p.add_argument("--tasks", type=int, default=2, help="tasks_max of the connector (default 2: one per core)")
    p.add_argument("--task-processes", action=argparse.BooleanOptionalAction, default=True,
                   help="daemon.task_processes (default: each task in its own process)")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] and [postgres] (default: the dev stack)")


KINDS = ("upcast", "json", "avro", "debezium")
# Plain JSON records carrying the envelope's facts in their own fields (the record key is the account).
JSON_CONVERT = {"converter": "json", "convert": {"id": "id", "type": "type", "version": "version"}}
# The same records in Avro, framed for the registry (one schema registered once): the same convert sources.
AVRO_CONVERT = {**JSON_CONVERT, "converter": "avro"}
DEPOSIT_AVRO = orjson.dumps({"type": "record", "name": "Deposit", "namespace": "kafold.bench", "fields": [
    {"name": "id", "type": "string"}, {"name": "version", "type": "long"}, {"name": "type", "type": "string"},
    {"name": "owner", "type": ["null", "string"], "default": None},
    {"name": "amount", "type": ["null", "long"], "default": None}]}).decode()
# Debezium's JDBC-sink shape: the source row after each change, upserted whole; deletes remove it.
DEBEZIUM_RULES = [
    {"type": ["create", "update", "read"], "set": {c: f"payload.{c}" for c in COLUMNS if c != "account_id"}},
    {"type": "delete", "action": "delete"},
]


def old_deposit(account: str, version: int, amount: int) -> Event:
    return Event.new("FundsAdded", "account", account, version, {"amt": amount})


def json_record(i: int, acc: str, version: int) -> tuple[bytes, bytes, None]:
    body: dict[str, Any] = {"id": str(uuid.uuid4()), "version": version}
    if version == 1:
        body.update(type="AccountOpened", owner=f"owner-{i}")
    else:
        body.update(type="MoneyDeposited", amount=i % 97 + 1)
    return acc.encode(), orjson.dumps(body), None


def avro_records(registry_url: str, topic: str) -> Any:
    """`json_record`'s bodies as Avro records framed for the registry at `registry_url` (the schema registered
    under `<topic>-value` on the first record)."""
    # the registry's serdes: kafold[registry], only for a registry converter
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    serialize = AvroSerializer(SchemaRegistryClient({"url": registry_url}), DEPOSIT_AVRO)
    ctx = SerializationContext(topic, MessageField.VALUE)

    def record(i: int, acc: str, version: int) -> tuple[bytes, bytes, None]:
        key, value, _ = json_record(i, acc, version)
        return key, serialize(orjson.loads(value), ctx), None
    return record


def registry_url(stack: contextlib.ExitStack, config: str | None, workdir: Path) -> str:
    """The Schema Registry the avro kind uses: the `-c` file's [registry] url, else the dev stack's registry if it
    runs (`kafold dev up --registry`), else one started for this run in `workdir` (stopped with `stack`)."""
    if config and (url := tomllib.loads(Path(config).read_text()).get("registry", {}).get("url")):
        return str(url)
    if url := registry_server.dev_url(devstack.default_state_dir()):
        return url
    reg = registry_server.start(workdir / "registry")
    stack.callback(reg.stop)
    return reg.url


# The records below come without the schema wrapper: the converter is told so, with the settings that allow it.
DEBEZIUM_SCHEMALESS = {"schemas": False, "decimal_handling_mode": "string", "time_precision_mode": "isostring"}


def debezium_records(accounts: int) -> Any:
    """A Debezium PostgreSQL connector's change events (JSON, no schema wrapper) of an `accounts` source table: each
    account inserted, then updated by each deposit; the log position grows with every change."""
    balances: dict[str, int] = {}

    def record(i: int, acc: str, version: int) -> tuple[bytes, bytes, None]:
        amount = i % 97 + 1
        before = None if version == 1 else {"account_id": acc, "owner": f"owner-{acc}", "status": "open",
                                             "balance": balances[acc], "last_amount": None}
        balances[acc] = 0 if version == 1 else balances[acc] + amount
        after = {"account_id": acc, "owner": f"owner-{acc}", "status": "open", "balance": balances[acc],
                 "last_amount": None if version == 1 else amount}
        source = {"version": "2.7.3.Final", "connector": "postgresql", "name": "bench", "ts_ms": 1764300000000 + i,
                  "snapshot": "false", "db": "app", "schema": "public", "table": "accounts", "txId": 1000 + i,
                  "lsn": 0x1000000 + i * 64}
        value = {"before": before, "after": after, "source": source, "op": "c" if version == 1 else "u",
                 "ts_ms": 1764300000000 + i}
        return orjson.dumps({"account_id": acc}), orjson.dumps(value), None
    return record


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs.configure("warning")
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    with contextlib.ExitStack() as stack:
        daemons = daemon_stack(stack, "evolution", args.config, args.broker)
        kafka, base = daemons.kafka, daemons.name
        accounts = max(1, args.events // 10)
        topics = {kind: f"{base}.{kind}" for kind in ("native", *kinds)}
        sizes = {"native": produce_events(kafka, topics["native"], args.events, args.partitions, accounts)}
        if "upcast" in kinds:
            sizes["upcast"] = produce_events(kafka, topics["upcast"], args.events, args.partitions, accounts,
                                             old_deposit)
        if "json" in kinds:
            sizes["json"] = produce_records(kafka, topics["json"], args.events, args.partitions, accounts,
                                            json_record)
        extra: dict[str, Any] | None = None
        if "avro" in kinds:
            url = registry_url(stack, args.config, daemons.workdir)
            extra = {"registry": {"url": url}}  # given to every run: only the avro connector reads it
            sizes["avro"] = produce_records(kafka, topics["avro"], args.events, args.partitions, accounts,
                                            avro_records(url, topics["avro"]))
        if "debezium" in kinds:
            sizes["debezium"] = produce_records(kafka, topics["debezium"], args.events, args.partitions, accounts,
                                                debezium_records(accounts))
        rates: dict[str, list[float | None]] = {kind: [] for kind in ("native", *kinds)}  # None: too small to time
        for r in range(args.rounds):
            for kind in kinds:
                for side in (("native", kind) if r % 2 == 0 else (kind, "native")):
                    table = f"bench_{uuid.uuid4().hex[:8]}"
                    got = run_projection(daemons, f"{base}.{side}.{kind}.{r}", topics[side], table, args,
                                   _extra(side, table), extra)
                    rates[side].append(got["events_per_s"])
                    log.warning("bench.evolution_round", round=r, kind=side, events_per_s=rounded(rates[side][-1]))
    figures: dict[str, Any] = {"events": args.events, "rounds": args.rounds, "partitions": args.partitions,
                               "tasks": args.tasks, "value_bytes": sizes,
                               "native_events_per_s": [rounded(x) for x in rates["native"]]}
    ratio_key = {"upcast": "upcast_throughput_ratio", "json": "json_converter_throughput_ratio",
                 "avro": "avro_converter_throughput_ratio",
                 "debezium": "debezium_converter_throughput_ratio"}
    for kind in kinds:
        figures[f"{kind}_events_per_s"] = [rounded(x) for x in rates[kind]]
        figures[ratio_key[kind]] = median_ratio(rates[kind], rates["native"])
    return figures


def _extra(kind: str, table: str) -> dict[str, Any] | None:
    """The connector keys that make `kind` differ from the envelope's projection."""
    if kind == "upcast":
        return {"upcasters": UPCASTERS}
    if kind == "json":
        return JSON_CONVERT
    if kind == "avro":
        return AVRO_CONVERT
    if kind == "debezium":
        return {"converter": "debezium", "convert": DEBEZIUM_SCHEMALESS,
                "config": {"table": table, "key_columns": ["account_id"], "columns": COLUMNS, "on": DEBEZIUM_RULES}}
    return None
