"""Create the topics a configuration implies and report drift between the specs and the broker."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from kafold import kafka_clients, logs
from kafold.config import KafkaConfig, TopicSpec
from kafold.errors import FatalError, KafoldError, RetriableError
from kafold.retry import retrying

log = logs.get(__name__)

TIMEOUT_S = 15.0
ERROR, WARNING = "error", "warning"
# Config keys whose drift changes what the topic keeps: compaction decides whether history or only
# the latest value per key survives, so a wrong cleanup.policy is always an error.
CRITICAL_CONFIGS = frozenset({"cleanup.policy"})


@dataclass(frozen=True)
class Drift:
    """One difference between a topic's spec and the broker."""

    topic: str
    what: str
    expected: str
    actual: str
    severity: str

    def __str__(self) -> str:
        return f"{self.what}: expected {self.expected}, broker has {self.actual}"


@dataclass(frozen=True)
class TopicState:
    """A spec and what the broker holds for it (`partitions` is None when the topic does not exist)."""

    spec: TopicSpec
    partitions: int | None
    action: str  # "created", "exists" or "missing"
    drift: tuple[Drift, ...] = ()


@dataclass(frozen=True)
class TopicReport:
    """The state of every topic checked, and the drift found."""

    topics: tuple[TopicState, ...] = field(default_factory=tuple)

    @property
    def drift(self) -> list[Drift]:
        return [d for t in self.topics for d in t.drift]

    @property
    def errors(self) -> list[Drift]:
        return [d for d in self.drift if d.severity == ERROR]

    @property
    def created(self) -> list[str]:
        return [t.spec.name for t in self.topics if t.action == "created"]

    @property
    def ok(self) -> bool:
        return not self.errors and all(t.action != "missing" for t in self.topics)

    def table(self) -> str:
        """A plain-text table, one row per topic plus one per drift."""
        rows = [("TOPIC", "PURPOSE", "PARTITIONS", "STATE", "DRIFT")]
        for t in self.topics:
            parts = f"{t.partitions if t.partitions is not None else '-'}/{t.spec.partitions}"
            state = t.action
            if t.drift:
                state = "ERROR" if any(d.severity == ERROR for d in t.drift) else "drift"
            drift = [f"{d.severity}: {d}" for d in t.drift] or [""]
            rows.append((t.spec.name, t.spec.purpose, parts, state, drift[0]))
            rows += [("", "", "", "", d) for d in drift[1:]]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, [*widths, 0], strict=True)).rstrip()
                         for r in rows)


def _kafka_error(e: Exception) -> KafkaError | None:
    """The KafkaError a KafkaException carries, if any."""
    return e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None


def _wrap(e: Exception, doing: str) -> KafoldError:
    err = _kafka_error(e)
    # a broker that went away mid-request (its handle destroyed) is a transport failure too: asked again, not fatal
    if err is not None and (err.retriable() or err.code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT,
                                                              KafkaError._DESTROY_BROKER)):
        return RetriableError(f"{doing}: {err.str()}")
    return FatalError(f"{doing}: {err.str() if err is not None else e}")


def _metadata(client: AdminClient, kafka: KafkaConfig) -> dict[str, Any]:
    try:
        return dict(client.list_topics(timeout=TIMEOUT_S).topics)
    except KafkaException as e:
        raise _wrap(e, f"cannot read topic metadata from {kafka.bootstrap_servers}") from e


def _create(client: AdminClient, specs: list[TopicSpec]) -> list[str]:
    """Create `specs`; a topic created concurrently by someone else counts as existing, not as created."""
    if not specs:
        return []
    futures = client.create_topics(
        [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication_factor,
                  config=dict(s.configs)) for s in specs],
        operation_timeout=TIMEOUT_S, request_timeout=TIMEOUT_S)
    created = []
    for name, fut in futures.items():
        try:
            fut.result()
            created.append(name)
            log.info("topics.created", topic=name)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise _wrap(e, f"cannot create topic {name!r}") from e
    return created


def _configs(client: AdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    """The configs of topics the metadata shows. The broker that answers may not know a topic created a moment
    ago (a cluster's brokers learn of it asynchronously, seen on three-node Apache Kafka): asked again, bounded."""
    out: dict[str, dict[str, str]] = {}

    def describe() -> dict[str, dict[str, str]]:
        todo = [n for n in names if n not in out]
        if not todo:
            return out
        futures = client.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in todo],
                                          request_timeout=TIMEOUT_S)
        unknown = []
        for res, fut in futures.items():
            try:
                out[res.name] = {k: v.value for k, v in fut.result().items() if v.value is not None}
            except KafkaException as e:
                err = _kafka_error(e)
                if err is not None and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    unknown.append(res.name)
                    continue
                raise _wrap(e, f"cannot describe the configs of topic {res.name!r}") from e
        if unknown:
            raise RetriableError(f"cannot describe the configs of topic {unknown[0]!r}: "
                                 "the broker does not know it yet")
        return out

    return retrying(describe, within_s=TIMEOUT_S, first_delay=0.1, max_delay=1.0,
                    on_retry=lambda e, delay: log.info("topics.describe_retry", error=str(e), delay_s=delay))


def _same(key: str, expected: str, actual: str | None) -> bool:
    if actual is None:
        return False
    if key == "cleanup.policy":  # a list: "compact,delete" == "delete,compact"
        return sorted(expected.replace(" ", "").split(",")) == sorted(actual.replace(" ", "").split(","))
    return expected.strip().lower() == actual.strip().lower()


def _drift(spec: TopicSpec, meta: Any, configs: dict[str, str], counts: dict[str, int],
           copartitioned: set[str]) -> list[Drift]:
    out: list[Drift] = []
    actual = counts[spec.name]
    if actual != spec.partitions:
        severity = ERROR if spec.name in copartitioned else WARNING
        out.append(Drift(spec.name, "partitions", str(spec.partitions), str(actual), severity))
    partner = spec.copartition_with
    if partner and partner in counts and counts[partner] != actual:
        out.append(Drift(spec.name, f"co-partitioning with {partner}", f"{counts[partner]} partitions",
                         f"{actual}", ERROR))
    replicas = min((len(p.replicas) for p in meta.partitions.values()), default=0)
    if replicas < spec.replication_factor:
        out.append(Drift(spec.name, "replication factor", str(spec.replication_factor), str(replicas),
                         WARNING))
    for key, expected in sorted(spec.configs.items()):
        got = configs.get(key)
        if not _same(key, str(expected), got):
            severity = ERROR if key in CRITICAL_CONFIGS else WARNING
            out.append(Drift(spec.name, key, str(expected), got if got is not None else "(unset)", severity))
    return out


def _report(client: AdminClient, kafka: KafkaConfig, specs: list[TopicSpec], created: set[str],
            meta: dict[str, Any]) -> TopicReport:
    present = [s.name for s in specs if s.name in meta and meta[s.name].error is None]
    configs = _configs(client, present)
    counts = {name: len(m.partitions) for name, m in meta.items() if m.error is None}
    copartitioned = {s.name for s in specs if s.copartition_with} | {s.copartition_with for s in specs
                                                                   if s.copartition_with}
    states = []
    for s in specs:
        if s.name not in present:
            states.append(TopicState(s, None, "missing"))
            continue
        drift = _drift(s, meta[s.name], configs.get(s.name, {}), counts, copartitioned)
        action = "created" if s.name in created else "exists"
        states.append(TopicState(s, counts[s.name], action, tuple(drift)))
    report = TopicReport(tuple(states))
    for d in report.drift:
        log.warning("topics.drift", topic=d.topic, what=d.what, expected=d.expected, actual=d.actual,
                    severity=d.severity)
    return report


def check(kafka: KafkaConfig, specs: Iterable[TopicSpec]) -> TopicReport:
    """Describe `specs` on the broker without changing anything."""
    client = kafka_clients.admin(kafka)
    return _report(client, kafka, list(specs), set(), _metadata(client, kafka))


def ensure(kafka: KafkaConfig, specs: Iterable[TopicSpec]) -> TopicReport:
    """Create the missing topics (idempotent), then describe every topic and report drift.

    Existing topics are never altered: partitions can only grow (which moves keys between partitions)
    and a changed cleanup.policy changes what the topic keeps, so both are reported for a human to decide.
    """
    specs = list(specs)
    client = kafka_clients.admin(kafka)
    meta = _metadata(client, kafka)
    missing = [s for s in specs if s.name not in meta or meta[s.name].error is not None]
    created = set(_create(client, missing))
    if missing:  # also those someone else created meanwhile (TOPIC_ALREADY_EXISTS): not in this metadata either
        meta = _metadata_listing(client, kafka, {s.name for s in specs})
    return _report(client, kafka, specs, created, meta)


def _metadata_listing(client: AdminClient, kafka: KafkaConfig, names: set[str]) -> dict[str, Any]:
    """The metadata, read again (bounded) until it lists every one of `names`: the brokers of a cluster learn of
    new topics asynchronously, so one broker can list a topic just created and the next not yet (seen on
    three-node Apache Kafka). The report is made from the metadata that listed them; at the bound, from the last
    one read, where a topic still absent is reported missing."""
    last: dict[str, Any] | None = None

    def read() -> dict[str, Any]:
        nonlocal last
        meta = last = _metadata(client, kafka)
        absent = sorted(n for n in names if n not in meta or meta[n].error is not None or not meta[n].partitions)
        if absent:
            raise RetriableError(f"topic {absent[0]!r} is not in the metadata yet")
        return meta

    try:
        return retrying(read, within_s=TIMEOUT_S, first_delay=0.1, max_delay=1.0,
                        on_retry=lambda e, delay: log.info("topics.metadata_retry", error=str(e), delay_s=delay))
    except RetriableError:
        if last is None:
            raise
        return last
