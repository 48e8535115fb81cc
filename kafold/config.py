"""The kafold.toml schema, its loader (env overrides, secrets, cross-checks) and the topics it implies."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
import sys
import tomllib
import typing
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kafold.errors import ConfigError
from kafold.refs import import_ref
from kafold.schema import Problems, Secret, is_missing, keys_of, load, setting
from kafold.sqlnames import check_identifier
from kafold.upcast import UpcasterConfig, build

ENV_PREFIX = "KAFOLD_"
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
IMPORT_REF_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# libpq parameters that carry a secret: never accepted inside postgres.url.
URL_SECRETS = frozenset({"password", "sslpassword"})
# The idempotency window's default bound in memory (AggregateConfig.window_max_ids). With a local store the ids
# dropped early are on disk and an evicted aggregate's ids leave memory with it: what memory holds beyond a few ids per
# cached aggregate is mostly expiry-queue references to ids already gone (~190 B an id, docs/benchmarks.md). Every new
# command id is looked up on disk anyway (read_back), so an id held in memory only spares a retry that read: 2 per
# cached aggregate (10 until 2026-12-06 held 100,000 ids, ~18 MB, in each worker of issue 56's 1M-account bench).
MAX_IDS, IDS_PER_CACHED = 1_000_000, 2


class GroupProtocol(enum.StrEnum):
    """The consumer group protocol of kafold's group members (docs/operations.md#consumer-group-protocol)."""

    CLASSIC = "classic"    # JoinGroup/SyncGroup, assigned by a member, every member stops at each rebalance
    CONSUMER = "consumer"  # KIP-848 (Apache Kafka 4.0+): assigned by the broker, rebalances move only what moves


@dataclass(frozen=True)
class KafkaConfig:
    bootstrap_servers: str = setting("", doc="Comma-separated host:port list; empty = the running `kafold dev` stack.")
    client_id: str = setting("kafold", doc="Client id sent to the brokers.")
    security_protocol: str = setting(
        "PLAINTEXT", doc="How clients talk to the brokers.",
        choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"))
    sasl_mechanism: str | None = setting(
        None, doc="SASL mechanism.", choices=("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"))
    sasl_username: str | None = setting(None, doc="SASL user name.")
    sasl_password: Secret | None = setting(doc="SASL password.", secret=True)
    ssl_ca_location: str | None = setting(None, doc="CA bundle (PEM) that signs the brokers' certificates.")
    ssl_certificate_location: str | None = setting(None, doc="Client certificate (PEM) for mutual TLS.")
    ssl_key_location: str | None = setting(None, doc="Client private key (PEM) for mutual TLS.")
    ssl_key_password: Secret | None = setting(doc="Password of the client private key.", secret=True)
    ssl_check_hostname: bool = setting(True, doc="Verify the broker's host name against its certificate.")
    replication_factor: int = setting(1, doc="Replication of the topics kafold creates.", minimum=1)
    session_timeout_ms: int = setting(45000, doc="Consumer group session timeout.", minimum=1000)
    rebalance_timeout_ms: int = setting(300000, doc="Consumer group rebalance (max poll interval) timeout.",
                                        minimum=1000)
    heartbeat_interval_ms: int = setting(3000, doc="Consumer group heartbeat interval.", minimum=100)
    group_protocol: GroupProtocol = setting(
        GroupProtocol.CLASSIC, doc="Consumer group protocol of the sink tasks and aggregate runtimes: `classic`, or "
        "`consumer` (KIP-848, Apache Kafka 4.0+: incremental rebalances; the session timeout and heartbeat interval "
        "are then the broker's `group.consumer.*` settings and the two above are not sent). Faust's own consumer "
        "stays classic (docs/operations.md#consumer-group-protocol).")
    group_remote_assignor: str | None = setting(
        None, doc="With group_protocol = `consumer`: the broker-side assignor (`uniform` or `range`); unset = the "
        "broker's default (`group.consumer.assignors`).", choices=("uniform", "range"))


@dataclass(frozen=True)
class PostgresConfig:
    url: str = setting("", doc="postgresql://user@host:port/db without password; empty = the `kafold dev` stack.")
    password: Secret | None = setting(doc="Password for the URL's user.", secret=True)
    schema: str = setting("kafold", doc="Schema holding kafold's own tables (checkpoints, dead letters, ...).")
    sslmode: str | None = setting(
        None, doc="libpq sslmode.", choices=("disable", "allow", "prefer", "require", "verify-ca", "verify-full"))
    sslrootcert: str | None = setting(None, doc="CA certificate file for verify-ca / verify-full.")
    sslcert: str | None = setting(None, doc="Client certificate file (PEM) for certificate authentication.")
    sslkey: str | None = setting(None, doc="Client private key file (PEM) for certificate authentication.")
    migrate_on_start: bool = setting(True, doc="Apply kafold's migrations when the daemon starts (once, before any "
                                     "task, whenever a connector uses PostgreSQL).")


class StateRouting(enum.StrEnum):
    """What a daemon does with a state read (`GET /aggregates/{name}/{id}`) for a key another instance owns."""

    FORWARD = "forward"    # asks the owner itself and answers with its reply (one hop; the client sees one answer)
    REDIRECT = "redirect"  # answers 307 with the owner's URL (the client follows it)


@dataclass(frozen=True)
class DaemonConfig:
    group_prefix: str = setting("kafold", doc="Consumer groups are `<group_prefix>.<connector name>`.")
    http_host: str = setting("127.0.0.1", doc="Address of the health / metrics / REST endpoint.")
    http_port: int = setting(8083, doc="Port of the health / metrics / REST endpoint (0 = disabled).", minimum=0)
    api_token: Secret | None = setting(doc="Bearer token required by the REST API when set.", secret=True)
    batch_max_records: int = setting(5000, doc="Largest batch handed to a sink task (or decided in one aggregate "
                                     "transaction).", minimum=1)
    batch_max_wait_ms: int = setting(200, doc="Longest an idle poll waits for a first record before the loop goes "
                                     "round (pause and commit requests, progress). A batch never waits to fill: "
                                     "what the fetch brought is handed over at once, so batches grow with the "
                                     "load up to batch_max_records (natural batching).", minimum=1)
    offset_flush_interval_ms: int = setting(5000, doc="How often a sink task that stores its own offsets (a "
                                            "projection: in PostgreSQL, with its rows) has them committed to the "
                                            "Kafka consumer group too, as Kafka Connect's offset.flush.interval.ms "
                                            "(also on revoke and stop, and as soon as the task has caught up: an "
                                            "idle poll). That commit only follows the task's store, "
                                            "which decides where a restart resumes. 0 = after every batch.",
                                            minimum=0)
    shutdown_grace_s: float = setting(10.0, doc="Time SIGTERM gives in-flight batches to finish.", minimum=0)
    task_processes: bool = setting(False, doc="Run each sink task in its own child process (one interpreter "
                                   "each), so a connector with tasks_max > 1 uses several cores and connectors do "
                                   "not wait for each other's work (fresher read models: docs/operations.md); a "
                                   "connector's own `task_processes` overrides it.")
    aggregate_processes: int = setting(1, doc="Worker processes deciding each aggregate's commands (one "
                                       "interpreter each, in the aggregate's one consumer group: its partitions "
                                       "split between them as between daemons), so one daemon decides on several "
                                       "cores; 1 = in the daemon's own process (docs/operations.md#aggregate-"
                                       "worker-processes).", minimum=1)
    log_level: str = setting("info", doc="Log level.", choices=("debug", "info", "warning", "error"))
    python_path: list[str] = setting(
        factory=list, doc="Folders (relative to the config file) added to sys.path for user modules.")
    faust_modules: list[str] = setting(
        factory=list, doc="Python modules whose `setup(app)` adds Faust agents, tables, timers and web pages to the "
        "daemon's worker (docs/extending.md); Faust's Kafka consumer runs only when they add agents or tables.")
    advertised_url: str = setting(
        "", doc="This daemon's HTTP address as the other instances of its group reach it (state reads sent on, "
        "redirects), e.g. `http://orders-2.orders:8083` in a container; empty: `http://<http_host>:<http_port>`, "
        "the host name when http_host binds every address.")
    max_waits: int = setting(2000, doc="Most `GET /connectors/{name}/wait` long polls in progress at once, over "
                             "all connectors; one more is answered 503 with `Retry-After` (each holds a connection).",
                             minimum=1)
    state_routing: StateRouting = setting(
        StateRouting.FORWARD, doc="A state read for a key another instance owns: `forward` asks the owner and "
        "answers its reply; `redirect` answers 307 with the owner's URL (docs/aggregates.md#state-queries-on-any-"
        "instance).")
    instance_secret: Secret | None = setting(
        doc="The deployment's instance secret (at least 32 characters, e.g. `openssl rand -base64 32`), the same on "
        "every instance: each signs the address it advertises to its aggregate groups and the state reads it sends "
        "on with it, and sends reads (or redirects) only to group members whose address verifies. Unset: a state "
        "read for a key another instance owns answers 503 (docs/security.md#trust-between-instances).", secret=True)
    instance_secret_previous: Secret | None = setting(
        doc="A second instance secret also accepted (never signed with) while the secret is rotated "
        "(docs/security.md#trust-between-instances).", secret=True)
    peer_ca_file: str | None = setting(None, doc="CA bundle (PEM) that signs the other instances' certificates when "
                                       "they advertise https:// addresses; unset: the system's trust store.")
    state_dir: str = setting("", doc="Directory of the aggregates' local state stores (LMDB, one folder per "
                             "aggregate and partition): states, versions and idempotency window outcomes written "
                             "after each committed transaction, so an aggregate evicted from the cache "
                             "(`cache_max_aggregates`) is read back from disk, a restart replays only the events "
                             "since, and the window is kept for `idempotency_window_s` on disk. Empty: no local "
                             "store (evicted aggregates are rebuilt from their events partition). Relative: to the "
                             "working directory (docs/operations.md#local-state-stores).")
    forward_max_bytes: int = setting(8 * 1024 * 1024, doc="Largest answer a state read sent on to the owning "
                                     "instance may bring back; a larger one is refused (502).", minimum=1024)


@dataclass(frozen=True)
class TopicConfig:
    name: str = setting(doc="Topic name.")
    partitions: int = setting(1, doc="Partition count.", minimum=1)
    replication_factor: int | None = setting(None, doc="Replication; default [kafka].replication_factor.", minimum=1)
    configs: dict[str, str] = setting(factory=dict, doc="Topic configs, e.g. {\"retention.ms\" = \"-1\"}.")


class FoldErrorPolicy(enum.StrEnum):
    """What a fold does with a stored event it cannot apply (kafold.fold)."""

    STOP = "stop"                # the partition stops there: not ready, the event named in the log and /status
    DEAD_LETTER = "dead-letter"  # the event is dead-lettered, left out of every state, and the fold goes on


@dataclass(frozen=True)
class ProtectConfig:
    type: str = setting(doc="Event type whose payload holds personal data.")
    fields: list[str] = setting(doc="Payload paths of the personal data, e.g. [\"email\", \"address.street\"]: "
                                "written encrypted under the subject's key (docs/security.md#personal-data-crypto-"
                                "shredding).")
    subject: str = setting("aggregate_id", doc="Whose data it is: `aggregate_id`, or `payload.<path>` (e.g. "
                           "`payload.customer_id`); `kafold subjects forget SUBJECT` makes it unreadable.")


@dataclass(frozen=True)
class PrivacyConfig:
    master_key: Secret | None = setting(doc="The master key (32 bytes, base64 or hex) wrapping the subjects' data "
                                        "keys; required when any aggregate has `protect` rules.", secret=True)
    placeholder: str | None = setting(None, doc="What a protected field of a forgotten subject reads as; unset: "
                                      "null.")
    key_cache_max: int = setting(100000, doc="Subjects' data keys kept in memory per process, each with its cipher "
                                 "(~2.5 KB: 100,000 is ~250 MB); past it the oldest tenth is dropped and read again "
                                 "from PostgreSQL when needed. Lower it when many task processes read protected "
                                 "events.", minimum=10)
    previous_master_key: Secret | None = setting(doc="The master key being rotated away from (`kafold keys "
                                                 "rotate`): data keys still wrapped under it are read with it until "
                                                 "the rotation is done, and a restored backup older than the rotation "
                                                 "needs it.", secret=True)
    key_store: str = setting("postgres", doc="Where the subjects' wrapped data keys live: a `kafold.key_stores` "
                             "entry point (`postgres`: `<schema>.subject_keys`; `directory`: one fsync'd file per "
                             "subject under `key_store_dir`, outside the database and its backups).")
    key_store_dir: str = setting("", doc="The directory of the `directory` key store (a path on a local file "
                                 "system; relative: to the working directory); required with it.")
    erasure_topic: str = setting("kafold.erasures", doc="Compacted topic recording each deleted data key (its key "
                                 "id and the subject's keyed hash, never the subject), written before the key is "
                                 "deleted; re-applied on daemon start and `kafold db upgrade`, so a forget survives a "
                                 "database restore (docs/operations.md#backup-and-restore).")
    key_purge_interval_s: float = setting(300.0, doc="How often a daemon removes deleted keys' bytes from the key "
                                          "store's files after erasures (`VACUUM FULL` of the keys table); also "
                                          "`kafold keys purge`.", minimum=10.0)


@dataclass(frozen=True)
class AggregateConfig:
    name: str = setting(doc="Aggregate type name, e.g. `account`.")
    initial: str = setting(doc="`module:function` returning the initial state.")
    evolve: str = setting(doc="`module:function(state, event) -> state`, pure.")
    decide: str = setting(doc="`module:function(command, state) -> list[event]`, pure; raises to reject.")
    partitions: int = setting(4, doc="Partitions of the events, commands, results and snapshot topics.", minimum=1)
    events_topic: str = setting("", doc="Events topic; default `<name>.events`.")
    commands_topic: str = setting("", doc="Commands topic; default `<name>.commands`.")
    results_topic: str = setting("", doc="Results topic; default `<name>.results`.")
    snapshot_topic: str = setting("", doc="Compacted snapshot topic; default `<name>.snapshots`.")
    fingerprint: str = setting("", doc="Identifies the fold; snapshots of another fingerprint are refused. Empty: "
                               "derived from the evolve module's code, the event classes, the upcasters and the state "
                               "shape (docs/aggregates.md#the-fold-fingerprint); set it only to declare a change "
                               "compatible.")
    upcasters: list[UpcasterConfig] = setting(
        factory=list, doc="Steps turning older event shapes into today's (docs/aggregates.md#upcasting); applied "
        "on every read path; `decide` writes each type at its newest version.")
    on_fold_error: FoldErrorPolicy = setting(
        FoldErrorPolicy.STOP, doc="A stored event the fold cannot apply: `stop` keeps its partition not ready, "
        "naming it; `dead-letter` parks it (aggregate dead-letter topic), leaves it out of the state and goes on.")
    state_schema_version: int = setting(1, doc="Version of the state's shape stored in snapshots.", minimum=1)
    cache_max_aggregates: int = setting(100000, doc="Aggregates kept in memory per process (LRU): with "
                                        "`daemon.state_dir`, the hot cache in front of the local state store; "
                                        "without, an evicted aggregate is rebuilt from its events partition.",
                                        minimum=1)
    idempotency_window_s: float = setting(86400.0, doc="A command id retried within this many seconds (by command "
                                          "time) gets its first outcome back, nothing written.", minimum=0)
    idempotency_max_ids: int | None = setting(None, doc="Most command ids the window holds in memory per process; "
                                              "beyond it the oldest are forgotten early. Without `daemon.state_dir` "
                                              "the window then holds fewer ids than its time (a warning); with it, "
                                              "the ids stay on disk for `idempotency_window_s` and are read back "
                                              "when retried. Unset: 1,000,000, or with `daemon.state_dir` 2 per "
                                              "cached aggregate (`cache_max_aggregates`), at most 1,000,000.",
                                              minimum=1)
    protect: list[ProtectConfig] = setting(
        factory=list, doc="Personal data in this aggregate's events: per event type, the payload paths to encrypt "
        "and their subject (docs/security.md#personal-data-crypto-shredding).")

    def window_max_ids(self, on_disk: bool) -> int:
        """The idempotency window's bound in memory (`idempotency_max_ids`, or its default): with a local store the
        ids dropped early are on disk, so memory holds about as many as the hot cache's aggregates use."""
        if self.idempotency_max_ids is not None:
            return self.idempotency_max_ids
        return min(MAX_IDS, IDS_PER_CACHED * self.cache_max_aggregates) if on_disk else MAX_IDS

    def topic(self, kind: str) -> str:
        return getattr(self, f"{kind}_topic") or f"{self.name}.{kind if kind != 'snapshot' else 'snapshots'}"

    @property
    def dlq_topic(self) -> str:
        """Where the runtime dead-letters bad commands (one partition; see docs/aggregates.md)."""
        return f"kafold.dlq.aggregate.{self.name}"

    def topic_configs(self, kind: str) -> dict[str, str]:
        """The topic configs kafold creates its `kind` topic with (`commands`, `events`, `results`, `snapshot`,
        `dlq`)."""
        if kind == "snapshot":
            return dict(SNAPSHOT_TOPIC_CONFIGS)
        if self.protect and kind in ("commands", "dlq"):
            return dict(PROTECTED_COMMANDS_TOPIC_CONFIGS if kind == "commands" else PROTECTED_DLQ_TOPIC_CONFIGS)
        return {}


class ConverterKind(enum.StrEnum):
    """How a connector reads its records (docs/connectors.md#converters)."""

    KAFOLD = "kafold"          # kafold's own envelope (the fast path)
    JSON = "json"              # plain JSON; event fields from [connectors.convert] sources
    DEBEZIUM = "debezium"      # Debezium change events (before/after/op/source)
    AVRO = "avro"              # Schema Registry formats, then mapped as `json`
    JSONSCHEMA = "jsonschema"
    PROTOBUF = "protobuf"


class TruncatePolicy(enum.StrEnum):
    """What a Debezium truncate event (op `t`) does to a projection (docs/connectors.md#debezium-change-events)."""

    DELETE = "delete"            # remove every row of the projection (it reads that one source table)
    DEAD_LETTER = "dead-letter"  # a dead letter naming the table; the rows stay


class SnapshotSweep(enum.StrEnum):
    """What the end of a Debezium snapshot does to rows it did not read (docs/connectors.md#re-snapshots)."""

    AUTO = "auto"    # SWEEP when the connector reads one topic (one source table), else KEEP
    SWEEP = "sweep"  # delete the projection's rows older than the completed snapshot: rows deleted meanwhile
    KEEP = "keep"    # leave them (a projection of several tables, or a topic routed from several)


class DecimalHandling(enum.StrEnum):
    """Debezium's `decimal.handling.mode`, as the source connector is set."""

    PRECISE = "precise"  # bytes and a scale in the record's schema (Debezium's default)
    STRING = "string"
    DOUBLE = "double"    # a float: digits beyond a double's are already lost at the source


class TimePrecision(enum.StrEnum):
    """Debezium's `time.precision.mode`, as the source connector is set."""

    ADAPTIVE = "adaptive"  # Debezium's default: day counts and epoch ms/us/ns, told apart by the record's schema
    ADAPTIVE_TIME_MICROSECONDS = "adaptive_time_microseconds"
    CONNECT = "connect"
    ISOSTRING = "isostring"  # ISO-8601 strings: readable without a schema


class BinaryHandling(enum.StrEnum):
    """Debezium's `binary.handling.mode`, as the source connector is set."""

    BYTES = "bytes"  # base64 in JSON, typed `bytes` in the record's schema (Debezium's default)
    BASE64 = "base64"
    BASE64_URL_SAFE = "base64-url-safe"
    HEX = "hex"


UNAVAILABLE_PLACEHOLDER = "__debezium_unavailable_value"  # Debezium's default `unavailable.value.placeholder`


_CONVERT_SOURCE = re.compile(r"^(\$|(\$\.)?[^.\s@'][^.\s]*(\.[^.\s]+)*|header:.+"
                             r"|@(key|topic|partition|offset|timestamp)|'[^']*')$")


@dataclass(frozen=True)
class ConvertConfig:
    format: str = setting("json", doc="debezium: the value format of its change events.",
                          choices=("json", "avro", "jsonschema", "protobuf"))
    id: str = setting("", doc="Source of the event id: a JSON path (`meta.id`, `$` the whole value), "
                      "`header:<name>`, or `@key`/`@topic`/`@partition`/`@offset`/`@timestamp`; empty: a uuid5 of "
                      "topic/partition/offset (a redelivered record dedups).")
    type: str = setting("", doc="Source of the event type (as `id`, or a constant `'Name'`); empty: the topic.")
    key: str = setting("", doc="Source of the aggregate id (as `id`); empty: the record key (utf-8).")
    version: str = setting("", doc="Source of the version (an integer >= 1); empty: offset + 1 (json), the "
                           "source's log position (debezium).")
    time: str = setting("", doc="Source of the event time (epoch ms or ISO-8601); empty: the record timestamp.")
    aggregate_type: str = setting("", doc="json: the events' aggregate type; empty: the topic.")
    message_type: str = setting("", doc="protobuf: the generated message class `module:Class`.")
    schemas: bool = setting(True, doc="debezium, json format: the records carry their Connect schema "
                            "(`{\"schema\": …, \"payload\": …}`, JsonConverter's `schemas.enable`, Debezium's "
                            "default); values are decoded by it. false: schema-less records, readable only with the "
                            "Debezium settings declared below (docs/connectors.md#debezium-change-events).")
    decimal_handling_mode: DecimalHandling = setting(DecimalHandling.PRECISE, doc="debezium: the source "
                                                     "connector's `decimal.handling.mode`; with `schemas = false` "
                                                     "it must be `string` (or `double`).")
    time_precision_mode: TimePrecision = setting(TimePrecision.ADAPTIVE, doc="debezium: the source connector's "
                                                 "`time.precision.mode`; with `schemas = false` it must be "
                                                 "`isostring`.")
    binary_handling_mode: BinaryHandling = setting(BinaryHandling.BYTES, doc="debezium: the source connector's "
                                                   "`binary.handling.mode`; with `schemas = false` binary values "
                                                   "arrive as text in this encoding (a bytea column needs schemas).")
    unavailable_value_placeholder: str = setting(UNAVAILABLE_PLACEHOLDER, doc="debezium: the source connector's "
                                                 "`unavailable.value.placeholder` (an unchanged TOASTed value): "
                                                 "such a column keeps its stored value.")
    truncate: TruncatePolicy = setting(TruncatePolicy.DEAD_LETTER, doc="debezium: what a truncate event (op `t`) "
                                       "does: `delete` removes every row of the projection (one source table a "
                                       "connector), `dead-letter` records it naming the table.")
    snapshot_sweep: SnapshotSweep = setting(SnapshotSweep.AUTO, doc="debezium: at the end of a completed snapshot "
                                            "(`source.snapshot` = `last`), `sweep` deletes the projection's rows "
                                            "the snapshot did not read (rows deleted while the connector had lost "
                                            "its offsets); needs one source table a connector. `auto`: sweep when "
                                            "the connector reads one topic; `keep`: never.")

    def __post_init__(self) -> None:
        bad = [f"{n}: {getattr(self, n)!r} is not a JSON path, header:<name>, @coordinate or 'constant'"
               for n in ("id", "type", "key", "version", "time") if getattr(self, n)
               and not _CONVERT_SOURCE.match(getattr(self, n))]
        if bad:
            raise ValueError("; ".join(bad))


@dataclass(frozen=True)
class ConnectorConfig:
    name: str = setting(doc="Unique connector name (also its consumer group suffix).")
    connector_class: str = setting(doc="Entry point name in group `kafold.connectors` (e.g. `log`) or `module:Class`.")
    topics: list[str] = setting(doc="Source topics.")
    tasks_max: int = setting(1, doc="Largest number of tasks the connector may split into.", minimum=1)
    task_processes: bool | None = setting(None, doc="This connector's tasks as child processes (true) or as threads "
                                          "of the daemon (false); unset: `daemon.task_processes`. A process keeps a "
                                          "latency-sensitive connector (a projection its service reads back) from "
                                          "waiting behind the others' work (docs/operations.md).")
    dead_letter_topic: str = setting("", doc="Topic for records that cannot be processed; default `kafold.dlq.<name>`.")
    on_unknown_type: str = setting("skip", doc="What an unknown event type does.",
                                   choices=("skip", "dead-letter", "fail"))
    upcasters: list[UpcasterConfig] = setting(
        factory=list, doc="Steps turning older event shapes into today's, applied before the connector sees an event "
        "(docs/aggregates.md#upcasting); a step that fails dead-letters its event (`upcast-failed`). Left empty, a "
        "connector reading an aggregate's events topic takes that aggregate's upcasters.")
    raw: bool = setting(False, doc="See events as they were written: no upcaster applies (neither `upcasters` nor "
                        "the aggregate's), e.g. a webhook whose receivers want the bytes of the day.")
    config: dict[str, Any] = setting(factory=dict, doc="The connector's own settings (see its reference).")
    converter: ConverterKind = setting(ConverterKind.KAFOLD, doc="How records are read: `kafold` envelopes, plain "
                                       "`json`, `debezium` change events, or Schema Registry `avro` / `jsonschema` / "
                                       "`protobuf` (docs/connectors.md#converters).")
    convert: ConvertConfig = setting(factory=ConvertConfig, doc="The converter's options.")

    @property
    def dlq_topic(self) -> str:
        return self.dead_letter_topic or f"kafold.dlq.{self.name}"


@dataclass(frozen=True)
class SnapshotConfig:
    enabled: bool = setting(False, doc="Let the daemon schedule snapshot jobs.")
    interval_s: float = setting(3600.0, doc="Run a snapshot job at least this often (seconds).", minimum=1)
    every_n_events: int = setting(0, doc="Also run once this many new events arrived (0 = off).", minimum=0)
    spark_master: str = setting("local[*]", doc="Spark master URL for snapshot jobs.")
    spark_conf: dict[str, str] = setting(factory=dict, doc="Extra Spark settings.")
    engine: str = setting("auto", doc="Where runs fold: spark, local (in the kafold process), or auto (local when "
                          "a run has at most local_max_events unfolded events, else Spark).",
                          choices=("auto", "spark", "local"))
    local_max_events: int = setting(200_000, doc="With engine auto: the most unfolded events (summed over the "
                                    "partitions) a run folds in-process instead of starting a Spark job.", minimum=0)


@dataclass(frozen=True)
class RegistryConfig:
    url: str = setting("", doc="Confluent-compatible Schema Registry URL (e.g. Apicurio's "
                       "`http://host:8080/apis/ccompat/v7`), without credentials; needed by the avro, jsonschema "
                       "and protobuf converters.")
    username: str | None = setting(None, doc="HTTP basic-auth user name.")
    password: Secret | None = setting(doc="HTTP basic-auth password.", secret=True)
    ssl_ca_location: str | None = setting(None, doc="CA bundle (PEM) that signs the registry's certificate.")
    timeout_s: float = setting(10.0, doc="Timeout of one request to the registry (seconds).", minimum=0.1)
    cache_capacity: int = setting(1000, doc="Schemas kept per process (each schema id is fetched once).",
                                  minimum=1)
    retry_within_s: float = setting(5.0, doc="How long one decode waits in place for a registry that is down "
                                    "(connection refused, 5xx) before the error goes up: the daemon's runner then "
                                    "backs off with the partitions paused and decodes the record again until the "
                                    "registry answers (a stop is served meanwhile); a rebuild or a replay fails.",
                                    minimum=0)
    max_decoded_items: int = setting(100_000, doc="Most array elements plus map entries (object members) one record "
                                     "may decode to; a record past it is dead-lettered (`too-large`) naming the "
                                     "field (docs/security.md#bounds-on-hostile-input).", minimum=1)
    unknown_id_ttl_s: float = setting(60.0, doc="How long a schema id the registry does not know is remembered as "
                                      "unknown: its records are dead-lettered without asking the registry again.",
                                      minimum=0)
    unknown_id_max: int = setting(1000, doc="Unknown schema ids remembered per process (the oldest forgotten first).",
                                  minimum=1)


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = setting(False, doc="Make OpenTelemetry spans (command, aggregate, projection batch, effect, "
                            "snapshot run) and carry W3C `traceparent` in Kafka headers; sampler and OTLP export "
                            "from the standard OTEL_* environment variables.")
    service_name: str = setting("kafold", doc="The `service.name` of the spans (unless OTEL_SERVICE_NAME is set).")


@dataclass(frozen=True)
class KafoldConfig:
    kafka: KafkaConfig = setting(factory=KafkaConfig, doc="Kafka brokers and client security.")
    postgres: PostgresConfig = setting(factory=PostgresConfig, doc="PostgreSQL holding projections and kafold state.")
    daemon: DaemonConfig = setting(factory=DaemonConfig, doc="The sidecar daemon.")
    topics: list[TopicConfig] = setting(factory=list, doc="Extra topics to create (besides those aggregates imply).")
    aggregates: list[AggregateConfig] = setting(factory=list, doc="Event-sourced aggregates.")
    connectors: list[ConnectorConfig] = setting(factory=list, doc="Connectors run by the daemon.")
    snapshots: SnapshotConfig = setting(factory=SnapshotConfig, doc="Snapshot jobs.")
    registry: RegistryConfig = setting(factory=RegistryConfig, doc="Schema Registry for the avro / jsonschema / "
                                       "protobuf converters.")
    privacy: PrivacyConfig = setting(factory=PrivacyConfig, doc="Crypto-shredding of protected event fields.")
    tracing: TracingConfig = setting(factory=TracingConfig, doc="OpenTelemetry traces (off unless enabled).")


@dataclass(frozen=True)
class Loaded:
    """A validated configuration and where it came from."""

    config: KafoldConfig
    path: Path

    @property
    def base(self) -> Path:
        return self.path.parent


@dataclass(frozen=True)
class TopicSpec:
    """A topic the configuration implies; `copartition_with` names a topic whose partition count must match."""

    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str]
    copartition_with: str | None = None
    purpose: str = "topic"


def env_sections() -> dict[str, type]:
    """The tables `KAFOLD_<SECTION>__<KEY>` can reach: every section of KafoldConfig that is a table (the arrays of
    tables, `aggregates`, `connectors` and `topics`, are not), derived from the schema so a new section is reached."""
    hints = typing.get_type_hints(KafoldConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(KafoldConfig) if dataclasses.is_dataclass(hints[f.name])}


def _apply_env(raw: dict[str, Any], environ: dict[str, str], problems: Problems) -> None:
    """`KAFOLD_<SECTION>__<KEY>=value` overrides `[section] key`; a variable naming no section or no key is a problem
    like an unknown key in the file (a misspelt override silently ignored would leave the file's value in force)."""
    sections = env_sections()
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        if section not in sections:
            hint = difflib.get_close_matches(section, list(sections), n=1, cutoff=0.6)
            more = f"did you mean {ENV_PREFIX}{hint[0].upper()}__…?" if hint else \
                f"sections: {', '.join(s.upper() for s in sections)}"
            problems.add(f"environment {name}", f"no section {section!r}; {more}")
            continue
        cls = sections[section]
        allowed = keys_of(cls)
        if any(f.name == key and f.metadata.get("secret") for f in dataclasses.fields(cls)):
            # the variable holds the secret itself: read it from there, as `<key>_env` would, never copied
            key, value = f"{key}_env", name
        if key not in allowed:
            hint = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            more = f"did you mean {ENV_PREFIX}{section.upper()}__{hint[0].upper()}?" if hint else \
                f"[{section}] keys: {', '.join(sorted(allowed))}"
            problems.add(f"environment {name}", f"no key {key!r} in [{section}]; {more}")
            continue
        table = raw.setdefault(section, {})
        if isinstance(table, dict):
            table[key] = value


def _check_refs(cfg: KafoldConfig, problems: Problems) -> None:
    """Cross-section checks that a single table cannot see."""
    seen: dict[str, str] = {}
    for i, agg in enumerate(cfg.aggregates):
        where = f"aggregates[{i}]"
        if agg.name in seen:
            problems.add(f"{where}.name", f"duplicate aggregate name {agg.name!r}")
        seen[agg.name] = where
        for key in ("initial", "evolve", "decide"):
            if not IMPORT_REF_RE.match(getattr(agg, key)):
                problems.add(f"{where}.{key}", f"expected `module:function`, got {getattr(agg, key)!r}")
    names: set[str] = set()
    for i, con in enumerate(cfg.connectors):
        where = f"connectors[{i}]"
        if con.name in names:
            problems.add(f"{where}.name", f"duplicate connector name {con.name!r}")
        names.add(con.name)
        if not NAME_RE.match(con.name):
            problems.add(f"{where}.name", f"{con.name!r}: use letters, digits, '.', '_' or '-'")
        if not con.topics:
            problems.add(f"{where}.topics", "at least one source topic is required")
    _check_protect(cfg, problems)
    _check_converters(cfg, problems)
    _check_postgres(cfg.postgres, problems)
    _check_kafka_security(cfg.kafka, problems)
    _check_group_protocol(cfg.kafka, problems)
    _check_advertised_url(cfg.daemon.advertised_url, problems)
    _check_instance_trust(cfg.daemon, problems)
    _check_state_dir(cfg.daemon.state_dir, problems)
    for name, spec in topic_map(cfg).items():
        if not NAME_RE.match(name):
            problems.add("topics", f"invalid topic name {name!r}")
        if spec.purpose == "snapshots" and spec.configs.get("cleanup.policy") != "compact":
            problems.add("topics", f"snapshot topic {name!r} must have cleanup.policy=compact")
        if spec.copartition_with:
            other = topic_map(cfg).get(spec.copartition_with)
            if other is not None and other.partitions != spec.partitions:
                problems.add("topics", f"{spec.purpose} topic {name!r} has {spec.partitions} partitions but must be "
                             f"co-partitioned with {other.name!r} ({other.partitions})")


def _check_converters(cfg: KafoldConfig, problems: Problems) -> None:
    """A debezium converter can decode what its declared Debezium settings make (docs/connectors.md)."""
    for i, con in enumerate(cfg.connectors):
        opts, where = con.convert, f"connectors[{i}].convert"
        if con.converter is not ConverterKind.DEBEZIUM:
            continue
        if not opts.unavailable_value_placeholder:
            problems.add(f"{where}.unavailable_value_placeholder", "expected Debezium's placeholder text, not empty")
        if opts.truncate is TruncatePolicy.DELETE and len(con.topics) > 1:
            problems.add(f"{where}.truncate", "\"delete\" empties the projection, so its connector must read one "
                         f"source table (one topic), not {len(con.topics)}: give each table its own connector, or "
                         "\"dead-letter\"")
        if opts.snapshot_sweep is SnapshotSweep.SWEEP and len(con.topics) > 1:
            problems.add(f"{where}.snapshot_sweep", "\"sweep\" deletes the projection's rows a snapshot did not "
                         f"read, so its connector must read one source table (one topic), not {len(con.topics)}: "
                         "give each table its own connector, or \"keep\"")
        if opts.schemas or opts.format != "json":
            continue  # the record's own schema says how each value is written
        if opts.decimal_handling_mode is DecimalHandling.PRECISE:
            problems.add(f"{where}.decimal_handling_mode", "\"precise\" writes a numeric as bytes whose scale "
                         "only the record's schema holds: with schemas = false set Debezium's "
                         "decimal.handling.mode=string and decimal_handling_mode = \"string\" here")
        if opts.time_precision_mode is not TimePrecision.ISOSTRING:
            problems.add(f"{where}.time_precision_mode", f"\"{opts.time_precision_mode}\" writes dates and times "
                         "as bare numbers that only the record's schema tells apart: with schemas = false set "
                         "Debezium's time.precision.mode=isostring and time_precision_mode = \"isostring\" here")


PATH_RE = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*$")


def _check_protect(cfg: KafoldConfig, problems: Problems) -> None:
    """Protect rules name paths, one rule per event type, a subject that is not itself encrypted, and a master key
    reference (its value is read at start-up: kafold.protect.master_key)."""
    for i, agg in enumerate(cfg.aggregates):
        types: set[str] = set()
        for j, rule in enumerate(agg.protect):
            where = f"aggregates[{i}].protect[{j}]"
            if rule.type in types:
                problems.add(f"{where}.type", f"a second rule for event type {rule.type!r}")
            types.add(rule.type)
            if not rule.fields:
                problems.add(f"{where}.fields", "name at least one payload path")
            for path in rule.fields:
                if not PATH_RE.match(path):
                    problems.add(f"{where}.fields", f"expected a dotted payload path, got {path!r}")
            if rule.subject != "aggregate_id":
                path = rule.subject.removeprefix("payload.")
                if not rule.subject.startswith("payload.") or not PATH_RE.match(path):
                    problems.add(f"{where}.subject", f"expected `aggregate_id` or `payload.<path>`, got "
                                 f"{rule.subject!r}")
                elif any(path == f or path.startswith(f + ".") for f in rule.fields):
                    problems.add(f"{where}.subject", f"the subject {rule.subject!r} is one of the encrypted fields")
        # a snapshot's state is sealed whole under the aggregate id's key (kafold.protect): one subject per state
        # (in process and in Spark alike: Spark tasks open their own key rings)
        if cfg.snapshots.enabled and any(rule.subject != "aggregate_id" for rule in agg.protect):
            problems.add(f"aggregates[{i}].protect", "snapshots of aggregates with protected fields are supported "
                         "only when every rule's subject is `aggregate_id` (a state would mix several subjects' "
                         "data): set [snapshots] enabled = false")
        if agg.protect and cfg.privacy.master_key is None and not problems.mentions("privacy.master_key"):
            problems.add("privacy.master_key", "protected fields need a master key: privacy.master_key_env or "
                         "privacy.master_key_file")
    if any(agg.protect for agg in cfg.aggregates):
        _check_key_store(cfg.privacy, problems)


def _check_key_store(privacy: PrivacyConfig, problems: Problems) -> None:
    """The key store names an installed `kafold.key_stores` entry point, with the settings it needs."""
    names = sorted(ep.name for ep in entry_points(group="kafold.key_stores"))
    if privacy.key_store not in names:
        problems.add("privacy.key_store", f"unknown key store {privacy.key_store!r} (installed: {', '.join(names)})")
    if privacy.key_store == "directory" and not privacy.key_store_dir:
        problems.add("privacy.key_store_dir", "the `directory` key store needs a directory")


def _check_postgres(pg: PostgresConfig, problems: Problems) -> None:
    """The URL names no secret (neither `user:password@` nor `?password=`); certificate files exist."""
    if pg.url:
        parts = urlsplit(pg.url)
        if parts.scheme not in ("postgresql", "postgres", "postgresql+psycopg"):
            problems.add("postgres.url", f"expected a postgresql:// URL, got scheme {parts.scheme!r}")
        if parts.password:
            problems.add("postgres.url", "the URL carries a literal password; use postgres.password_env or "
                         "postgres.password_file")
        for name in sorted({k.lower() for k, _ in parse_qsl(parts.query, keep_blank_values=True)} & URL_SECRETS):
            problems.add("postgres.url", f"the URL carries a literal {name}=; use postgres.password_env or "
                         "postgres.password_file")
    if (msg := check_identifier(pg.schema)) is not None:
        problems.add("postgres.schema", msg)
    for key in ("sslrootcert", "sslcert", "sslkey"):
        if getattr(pg, key):
            _check_file(getattr(pg, key), f"postgres.{key}", problems)
    if (pg.sslcert is None) != (pg.sslkey is None):
        problems.add("postgres.sslkey", "give both sslcert and sslkey (certificate authentication) or neither")


def _check_registry(reg: RegistryConfig, problems: Problems) -> None:
    """An http(s) URL without credentials in it; a password only with a user name; the CA file exists."""
    if reg.url:
        parts = urlsplit(reg.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.add("registry.url", f"expected an http(s):// URL naming a host, got {reg.url!r}")
        if parts.username or parts.password:
            problems.add("registry.url", "the URL carries credentials; use registry.username and "
                         "registry.password_env or registry.password_file")
    if reg.password is not None and not reg.username:
        problems.add("registry.username", "a registry password is set without a user name")
    if reg.ssl_ca_location:
        _check_file(reg.ssl_ca_location, "registry.ssl_ca_location", problems)


# What an instance may advertise: scheme, host, port and a plain path prefix, nothing else (no userinfo, query,
# fragment, percent-escape or white space); the other instances check each advertised address against it again.
ADVERTISED_URL_RE = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?(/[A-Za-z0-9._~-]+)*/?")


def advertised_url_problem(url: str) -> str | None:
    """What is wrong with `url` as an instance's advertised address, or None: http(s)://host[:port][/prefix]."""
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # out of range
        port_ok = False
    if not ADVERTISED_URL_RE.fullmatch(url) or not parts.hostname or not port_ok \
            or any(s in (".", "..") for s in parts.path.split("/")):
        return f"expected http(s)://host[:port][/prefix], got {url!r}"
    return None


def _check_advertised_url(url: str, problems: Problems) -> None:
    """The other instances build the state path after it (kafold.daemon.aggregates.trust.Peer)."""
    if url and (problem := advertised_url_problem(url)) is not None:
        problems.add("daemon.advertised_url", problem)


def _check_state_dir(state_dir: str, problems: Problems) -> None:
    """The local state stores' directory is a directory (created at start when missing), not a file."""
    if state_dir and Path(state_dir).exists() and not Path(state_dir).is_dir():
        problems.add("daemon.state_dir", f"{state_dir!r} exists and is not a directory")


def _check_instance_trust(daemon: DaemonConfig, problems: Problems) -> None:
    """A previous secret only beside a current one; the CA file exists (the secret's length is checked when it is
    read, at start: kafold.daemon.aggregates.trust.InstanceKey)."""
    if daemon.instance_secret_previous is not None and daemon.instance_secret is None \
            and not problems.mentions("daemon.instance_secret"):
        problems.add("daemon.instance_secret", "instance_secret_previous is set without instance_secret (the one "
                     "this instance signs with)")
    if daemon.peer_ca_file:
        _check_file(daemon.peer_ca_file, "daemon.peer_ca_file", problems)


def _check_group_protocol(kafka: KafkaConfig, problems: Problems) -> None:
    """A remote assignor is the consumer protocol's: with classic it would be silently ignored."""
    if kafka.group_remote_assignor is not None and kafka.group_protocol is not GroupProtocol.CONSUMER:
        problems.add("kafka.group_remote_assignor", "applies to group_protocol = \"consumer\" only (classic groups "
                     "are assigned by a member, not by the broker)")


def _check_kafka_security(kafka: KafkaConfig, problems: Problems) -> None:
    """SASL and TLS settings agree with security_protocol: none is silently ignored, none is missing."""
    sasl = kafka.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL")
    tls = kafka.security_protocol in ("SSL", "SASL_SSL")
    given_sasl = [k for k in ("sasl_mechanism", "sasl_username", "sasl_password") if getattr(kafka, k) is not None]
    if given_sasl and not sasl:
        problems.add("kafka.security_protocol", f"{kafka.security_protocol!r} ignores {', '.join(given_sasl)}; "
                     "use SASL_SSL (or SASL_PLAINTEXT)")
    if sasl and kafka.sasl_mechanism is None:
        problems.add("kafka.sasl_mechanism", f"required with security_protocol = {kafka.security_protocol!r}")
    if sasl and kafka.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        if kafka.sasl_username is None:
            problems.add("kafka.sasl_username", f"required with sasl_mechanism = {kafka.sasl_mechanism!r}")
        if kafka.sasl_password is None and not problems.mentions("kafka.sasl_password"):
            problems.add("kafka.sasl_password", f"required with sasl_mechanism = {kafka.sasl_mechanism!r} "
                         "(sasl_password_env or sasl_password_file)")
    given_tls = [k for k in ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password")
                 if getattr(kafka, k) is not None]
    if given_tls and not tls:
        problems.add("kafka.security_protocol", f"{kafka.security_protocol!r} ignores {', '.join(given_tls)}; "
                     "use SSL or SASL_SSL")
    if (kafka.ssl_certificate_location is None) != (kafka.ssl_key_location is None):
        problems.add("kafka.ssl_key_location", "give both ssl_certificate_location and ssl_key_location (mutual "
                     "TLS) or neither")
    for key in ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location"):
        if getattr(kafka, key):
            _check_file(getattr(kafka, key), f"kafka.{key}", problems)


def _check_file(path: str, where: str, problems: Problems) -> None:
    """The clients open certificate paths as given (relative to the working directory): so does this check."""
    if not Path(path).is_file():
        problems.add(where, f"file {path!r} does not exist")


# The snapshot topic keeps the latest snapshot per aggregate (compaction). Kafka compacts closed segments only,
# so segments roll hourly and the cleaner starts at 10% dirty: readers (each snapshot run, each restore) read the
# whole partition, and without these it would hold every run's snapshots until the default week-long segment
# closes.
SNAPSHOT_TOPIC_CONFIGS = {"cleanup.policy": "compact", "segment.ms": "3600000", "min.cleanable.dirty.ratio": "0.1"}

# The erasure topic keeps one record per deleted data key for ever (compaction never deletes a keyed record that
# has no tombstone): it is the list a restored database is checked against (kafold.erasure_log).
ERASURE_TOPIC_CONFIGS = {"cleanup.policy": "compact", "retention.ms": "-1"}

# The commands of an aggregate with `protect` rules carry what clients send, in clear (decide reads them as sent;
# only decide's events are sealed). A command is read within seconds of its writing, and a retry is answered from
# the idempotency window, not from the topic: so the topic keeps a command a day, no longer. Kafka deletes closed
# segments only, whose newest record timestamp is past retention.ms (the active one is rolled to be deleted once
# all of it has expired): hourly segments keep a value at most about 25 hours, plus the broker's retention check
# interval (5 minutes by default). docs/security.md#where-personal-data-may-stay.
PROTECTED_COMMANDS_TOPIC_CONFIGS = {"retention.ms": "86400000", "segment.ms": "3600000"}
# Its dead-letter topic keeps a rejected command (in clear) and parked fold errors (sealed): seven days, daily
# segments, set explicitly rather than left to the broker's default.
PROTECTED_DLQ_TOPIC_CONFIGS = {"retention.ms": "604800000", "segment.ms": "86400000"}

def topic_map(cfg: KafoldConfig) -> dict[str, TopicSpec]:
    """Every topic the configuration implies, by name; explicit [[topics]] entries override implied settings."""
    rf = cfg.kafka.replication_factor
    out: dict[str, TopicSpec] = {}
    for agg in cfg.aggregates:
        events = agg.topic("events")
        out[events] = TopicSpec(events, agg.partitions, rf, {}, purpose="events")
        for kind in ("commands", "results"):
            out[agg.topic(kind)] = TopicSpec(agg.topic(kind), agg.partitions, rf, agg.topic_configs(kind), events,
                                             kind)
        snap = agg.topic("snapshot")
        out[snap] = TopicSpec(snap, agg.partitions, rf, agg.topic_configs("snapshot"), events, "snapshots")
        out[agg.dlq_topic] = TopicSpec(agg.dlq_topic, 1, rf, agg.topic_configs("dlq"), purpose="dead-letter")
    if any(agg.protect for agg in cfg.aggregates):
        name = cfg.privacy.erasure_topic
        out[name] = TopicSpec(name, 1, rf, dict(ERASURE_TOPIC_CONFIGS), purpose="erasures")
    for con in cfg.connectors:
        out.setdefault(con.dlq_topic, TopicSpec(con.dlq_topic, 1, rf, {}, purpose="dead-letter"))
    for t in cfg.topics:
        prior = out.get(t.name)
        configs = {**(prior.configs if prior else {}), **t.configs}
        out[t.name] = TopicSpec(t.name, t.partitions, t.replication_factor or rf, configs,
                                prior.copartition_with if prior else None, prior.purpose if prior else "topic")
    return out


def parse(text: str, path: Path, environ: dict[str, str] | None = None) -> Loaded:
    """Validate TOML text; raise ConfigError listing every problem (each naming the file and key)."""
    env = dict(os.environ if environ is None else environ)
    problems = Problems(str(path), env)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{path}: not valid TOML: {e}"]) from e
    _apply_env(raw, env, problems)
    # `class` reads better in TOML; the field is connector_class because `class` is a keyword.
    for con in raw.get("connectors", []) if isinstance(raw.get("connectors"), list) else []:
        if isinstance(con, dict) and "class" in con:
            con.setdefault("connector_class", con.pop("class"))
    cfg = load(KafoldConfig, raw, "", problems, path.parent)
    if not is_missing(cfg):
        _check_refs(cfg, problems)
        _check_connectors(cfg, problems, path.parent)
        _check_faust_modules(cfg, problems, path.parent)
        _check_registry(cfg.registry, problems)
        cfg = _inherit_upcasters(cfg, problems)
        _check_upcasters(cfg, problems, path.parent)
    if problems.items:
        raise ConfigError(problems.items)
    return Loaded(cfg, path)


def _inherit_upcasters(cfg: KafoldConfig, problems: Problems) -> KafoldConfig:
    """A connector with no `upcasters` of its own reads an aggregate's events in today's shape: it takes the chains
    of the aggregates whose events topics it reads (one chain per topic, so a projection and the aggregate never
    disagree on what an old event says); `raw = true` takes none."""
    chains = {a.topic("events"): a.upcasters for a in cfg.aggregates if a.upcasters}
    connectors = []
    for i, con in enumerate(cfg.connectors):
        if con.raw and con.upcasters:
            problems.add(f"connectors[{i}].raw", "a raw connector sees events as written: drop its `upcasters`")
        elif not con.raw and not con.upcasters and any(t in chains for t in con.topics):
            con = dataclasses.replace(con, upcasters=[step for t in con.topics for step in chains.get(t, ())])
        connectors.append(con)
    return dataclasses.replace(cfg, connectors=connectors)


def _check_connectors(cfg: KafoldConfig, problems: Problems, base: Path) -> None:
    """Resolve every connector class and validate its own settings, reporting all problems."""
    from kafold.connectors.registry import available, resolve  # a layer up, only to validate a file (pyproject)

    with python_path(cfg, base):
        for i, con in enumerate(cfg.connectors):
            where = f"connectors[{i}]"
            try:
                cls = resolve(con.connector_class)
            except LookupError as e:
                names = available()
                hint = difflib.get_close_matches(con.connector_class, names, n=1)
                more = f"; did you mean {hint[0]!r}?" if hint else f"; installed: {', '.join(names) or 'none'}"
                problems.add(f"{where}.class", f"{e}{more}")
                continue
            load(cls.config_class, con.config, f"{where}.config", problems, base)


def _check_upcasters(cfg: KafoldConfig, problems: Problems, base: Path) -> None:
    """Every upcaster chain builds: its functions import, no step twice, no gap (kafold.upcast.build)."""
    with python_path(cfg, base):
        for where, chain in [*((f"aggregates[{i}]", a.upcasters) for i, a in enumerate(cfg.aggregates)),
                             *((f"connectors[{i}]", c.upcasters) for i, c in enumerate(cfg.connectors))]:
            try:
                build(chain, where)
            except ConfigError as e:
                for problem in e.problems:
                    key, _, message = problem.partition(": ")
                    problems.add(key, message)


def _check_faust_modules(cfg: KafoldConfig, problems: Problems, base: Path) -> None:
    """Each `daemon.faust_modules` entry imports and has `setup(app)`: found at load, not when the worker starts
    (the daemon's loader, daemon.extensions, does the same)."""
    with python_path(cfg, base):
        for i, name in enumerate(cfg.daemon.faust_modules):
            where = f"daemon.faust_modules[{i}]"
            if not MODULE_RE.match(name):
                problems.add(where, f"expected a dotted module name, got {name!r}")
                continue
            try:
                import_ref(f"{name}:setup", callable_=True)
            except LookupError as e:
                problems.add(where, str(e))


def load_file(path: str | Path, environ: dict[str, str] | None = None) -> Loaded:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"{p}: cannot read the configuration: {e.strerror}"]) from e
    return parse(text, p, environ)


class python_path:
    """Context manager that puts the config's `daemon.python_path` folders on sys.path."""

    def __init__(self, cfg: KafoldConfig, base: Path) -> None:
        self.paths = [str((base / p).resolve()) for p in cfg.daemon.python_path]

    def __enter__(self) -> None:
        for p in reversed(self.paths):
            if p not in sys.path:
                sys.path.insert(0, p)

    def __exit__(self, *exc: object) -> None:
        return None


def with_overrides(cfg: KafoldConfig, **sections: dict[str, Any]) -> KafoldConfig:
    """A copy of `cfg` with some keys of some sections replaced (e.g. the dev stack's addresses)."""
    changes = {name: dataclasses.replace(getattr(cfg, name), **vals) for name, vals in sections.items()}
    return dataclasses.replace(cfg, **changes)
