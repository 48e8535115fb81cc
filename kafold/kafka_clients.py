"""Kafka client settings derived from [kafka]: librdkafka dicts (confluent-kafka) and aiokafka kwargs."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from kafold import logs
from kafold.config import GroupProtocol, KafkaConfig
from kafold.errors import ConfigError
from kafold.retry import backoff

log = logs.get(__name__)
SSL_PROTOCOLS = ("SSL", "SASL_SSL")
SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")


# librdkafka spaces its "connect to any broker" attempts by half the first reconnect backoff (default 100 ms). A new
# client connects to the bootstrap address, learns the broker ids from the first metadata response, then drops the
# bootstrap connection and connects to the broker by id: that second connection waited out the 50 ms spacing
# (measured: 52 ms on about half the first requests of a new client, 12 ms with this; 11 ms is librdkafka's floor).
# The backoff after a failed connection still doubles up to reconnect.backoff.max.ms (10 s).
RECONNECT_BACKOFF_MS = 20
# A consumer whose group join found no usable broker for its metadata request (a broker of three killed while it
# started) waits for librdkafka's next periodic refresh before it asks again (confluentinc/librdkafka#2318): with
# the default (300 s) an effect task sat in join state wait-metadata, nothing assigned, for 5 minutes in the
# broker-fault chaos test. Every 10 s costs one small Metadata request per client.
METADATA_REFRESH_MS = 10_000


# librdkafka's own log lines (a broker unreachable, a request timed out) go through this logger, so they come out as
# kafold's structured lines (logs.configure routes stdlib logging through structlog) instead of raw `%3|…|FAIL|`
# lines on stderr. confluent-kafka hands them over while the client is polled (poll, consume, flush).
LIBRDKAFKA_LOG = logging.getLogger("kafold.librdkafka")


def coordinator_changing(err: Any) -> bool:
    """A group-coordinator request's KafkaError that asking again can cure: the coordinator moving or still loading
    (NOT_COORDINATOR on a fresh broker, after a broker restart), or the call's own timeout. librdkafka does not always
    flag these retriable when the call's timeout ends first."""
    return bool(err.retriable()) or err.code() in {
        KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError._TIMED_OUT, KafkaError._TRANSPORT}


# The consumer group protocol (KIP-848) moves a member's epoch at every step of a reconciliation (partitions
# revoked, then assigned, one heartbeat at a time); a commit sent with the epoch of a step before answers
# STALE_MEMBER_EPOCH, and one sent while the member rejoins after a fence UNKNOWN_MEMBER_ID. The member still owns
# the partitions it commits (a revoked partition is released only after its on_revoke returns): the next
# heartbeat brings the new epoch, and the same commit sent again succeeds. These codes are retried by `commit`
# only (the sink runner's commits; the aggregate runtime's offsets go through its transaction, which is aborted
# and decided again on them, daemon/aggregates/txn.py), never counted as "the coordinator is moving" for other
# requests.
MEMBER_EPOCH_MOVING = frozenset({"STALE_MEMBER_EPOCH", "UNKNOWN_MEMBER_ID"})
COMMIT_RETRY_S = 10.0  # a reconciliation step takes a heartbeat (the broker's interval, 5 s by default) or two
COMMIT_FIRST_DELAY_S = 0.05


def commit_retriable(err: Any) -> bool:
    """An offset commit's KafkaError that `commit` sends again at once: with the consumer group protocol, the
    member's epoch moving under it (MEMBER_EPOCH_MOVING). Not the classic protocol's fencing by a newer generation
    (ILLEGAL_GENERATION: the partitions belong to someone else by then), nor a coordinator moving
    (`coordinator_changing`): the sink runner commits again with its next batch anyway, and a revoke's commit
    retried behind an unreachable coordinator would hold up the rebalance for every member."""
    return err.code() in {getattr(KafkaError, name) for name in MEMBER_EPOCH_MOVING}


def refusal(answered: list[Any] | None) -> Any:
    """The first per-partition error (a KafkaError) in a commit's answer; None when every partition was taken."""
    return next((p.error for p in answered or () if p.error is not None), None)


def commit(consumer: Consumer, offsets: list[Any], within_s: float = COMMIT_RETRY_S) -> None:
    """`consumer.commit(offsets, asynchronous=False)`, sent again on a `commit_retriable` error (with backoff, for
    up to `within_s`); any other error, or the last retriable one, is raised (KafkaException).

    Offsets: the same offsets are committed on every try (a commit is idempotent); the caller records them as
    committed only once this returns. A partition the broker refused (the answer holds an error per partition)
    fails the call like a refused request."""
    deadline, attempt = time.monotonic() + within_s, 0
    while True:
        try:
            refused = refusal(consumer.commit(offsets=offsets, asynchronous=False))
            if refused is not None:
                raise KafkaException(refused)
            return
        except KafkaException as e:
            attempt += 1
            delay = backoff(attempt, COMMIT_FIRST_DELAY_S, 1.0)
            if not commit_retriable(e.args[0]) or time.monotonic() + delay > deadline:
                raise
            log.info("kafka.commit_retrying", error=str(e.args[0]), attempt=attempt, retry_in_s=delay)
            time.sleep(delay)  # librdkafka's own thread heartbeats meanwhile: the epoch moves on without a poll


def rebalance_assign(kafka: KafkaConfig, consumer: Consumer, partitions: list[Any]) -> None:
    """Take `partitions` (an on_assign callback's, offsets as set by the caller) into the assignment. The consumer
    protocol's rebalances are incremental: the callback gets only what is added, and librdkafka refuses `assign`
    there (_STATE: "must be made using incremental_assign() ... when rebalance protocol type is COOPERATIVE"); the
    classic protocol's (eager, librdkafka's default assignors) get the whole assignment and refuse
    `incremental_assign`. An on_revoke or on_lost callback calls neither: confluent-kafka then unassigns what it
    lists, the way the protocol asks."""
    if kafka.group_protocol is GroupProtocol.CONSUMER:
        consumer.incremental_assign(partitions)
    else:
        consumer.assign(partitions)


def librdkafka(kafka: KafkaConfig, **extra: Any) -> dict[str, Any]:
    """A confluent-kafka config dict; `extra` keys are librdkafka's own: `**{"enable.idempotence": True}`.

    The result holds revealed secrets: hand it to a client, never log it. An empty `bootstrap_servers` is a
    ConfigError here: librdkafka would take it and fail every request with "Broker transport failure".
    """
    if not kafka.bootstrap_servers.strip():
        raise ConfigError([
            "[kafka] bootstrap_servers is empty: set it (or KAFOLD_KAFKA__BOOTSTRAP_SERVERS). kafold's commands take "
            "a running `kafold dev` stack's address by themselves; in your own code, "
            "kafold.devstack.effective(cfg) does the same"])
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "security.protocol": kafka.security_protocol,
        "reconnect.backoff.ms": RECONNECT_BACKOFF_MS,
        "topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS,
        "logger": LIBRDKAFKA_LOG,
    }
    if kafka.security_protocol in SASL_PROTOCOLS:
        if kafka.sasl_mechanism:
            conf["sasl.mechanism"] = kafka.sasl_mechanism
        if kafka.sasl_username is not None:
            conf["sasl.username"] = kafka.sasl_username
        if kafka.sasl_password is not None:
            conf["sasl.password"] = kafka.sasl_password.reveal()
    if kafka.security_protocol in SSL_PROTOCOLS:
        optional = {
            "ssl.ca.location": kafka.ssl_ca_location,
            "ssl.certificate.location": kafka.ssl_certificate_location,
            "ssl.key.location": kafka.ssl_key_location,
            "ssl.key.password": kafka.ssl_key_password.reveal() if kafka.ssl_key_password else None,
        }
        conf.update({k: v for k, v in optional.items() if v is not None})
        conf["ssl.endpoint.identification.algorithm"] = "https" if kafka.ssl_check_hostname else "none"
    conf.update(extra)
    return conf


def aiokafka_kwargs(kafka: KafkaConfig) -> dict[str, Any]:
    """Connection keyword arguments shared by aiokafka's producer, consumer and admin client (and faust)."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap_servers,
        "client_id": kafka.client_id,
        "security_protocol": kafka.security_protocol,
    }
    if kafka.security_protocol in SASL_PROTOCOLS:
        kwargs["sasl_mechanism"] = kafka.sasl_mechanism or "PLAIN"
        if kafka.sasl_username is not None:
            kwargs["sasl_plain_username"] = kafka.sasl_username
        if kafka.sasl_password is not None:
            kwargs["sasl_plain_password"] = kafka.sasl_password.reveal()
    if kafka.security_protocol in SSL_PROTOCOLS:
        # aiokafka (faust's): kafold[daemon], only for aiokafka clients over TLS
        from aiokafka.helpers import create_ssl_context

        ctx = create_ssl_context(
            cafile=kafka.ssl_ca_location,
            certfile=kafka.ssl_certificate_location,
            keyfile=kafka.ssl_key_location,
            password=kafka.ssl_key_password.reveal() if kafka.ssl_key_password else None,
        )
        ctx.check_hostname = kafka.ssl_check_hostname
        kwargs["ssl_context"] = ctx
    return kwargs


# Refused by librdkafka when group.protocol=consumer ("... is not supported for `group.protocol=consumer`"): the
# session timeout and heartbeat interval are the broker's (group.consumer.session.timeout.ms,
# group.consumer.heartbeat.interval.ms), the assignment is the broker's (group.remote.assignor names which one).
CLASSIC_ONLY = frozenset({"session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy",
                          "group.protocol.type"})


def group_settings(kafka: KafkaConfig) -> dict[str, Any]:
    """Consumer-group settings per [kafka] group_protocol; librdkafka sends max.poll.interval.ms as the rebalance
    timeout (JoinGroup's, or the consumer protocol's heartbeat), in both protocols."""
    if kafka.group_protocol is GroupProtocol.CONSUMER:
        conf: dict[str, Any] = {"group.protocol": "consumer", "max.poll.interval.ms": kafka.rebalance_timeout_ms}
        if kafka.group_remote_assignor:
            conf["group.remote.assignor"] = kafka.group_remote_assignor
        return conf
    return {
        "session.timeout.ms": kafka.session_timeout_ms,
        "heartbeat.interval.ms": kafka.heartbeat_interval_ms,
        "max.poll.interval.ms": kafka.rebalance_timeout_ms,
    }


def admin(kafka: KafkaConfig, **extra: Any) -> AdminClient:
    return AdminClient(librdkafka(kafka, **extra))


def producer(kafka: KafkaConfig, **extra: Any) -> Producer:
    """A producer; an idempotent one is connected right away (see `_connect`)."""
    made = Producer(librdkafka(kafka, **extra))
    if extra.get("enable.idempotence") and "transactional.id" not in extra:
        threading.Thread(target=_connect, args=(made,), name="kafold-producer-connect", daemon=True).start()
    return made


def produce(made: Producer, topic: str, value: bytes | None, key: bytes | None = None, headers: Any = None,
            **kwargs: Any) -> None:
    """`made.produce(...)`, waiting while the producer's local queue is full (BufferError): delivery reports are
    served meanwhile, which makes room. `kwargs`: partition, on_delivery, timestamp."""
    while True:
        try:
            made.produce(topic, value=value, key=key, headers=headers, **kwargs)
            return
        except BufferError:
            made.poll(0.1)


def close_producer(made: Producer, timeout: float) -> int:
    """Flush for up to `timeout` s, purge what is still queued, then close: the producer's threads and connections
    end now, not whenever the garbage collector meets it (a producer left open retries a stopped broker and prints
    its connection errors past the owner's stop). `close()` alone would flush without a limit. Returns how many
    records were purged unacknowledged (their on_delivery callbacks have run with a purge error)."""
    left = made.flush(timeout)
    if left:
        made.purge()
        made.poll(0)
    made.close()
    return int(left)


def _connect(made: Producer) -> None:
    """librdkafka asks for an idempotent producer's id at creation, finds no broker connected yet (connections are
    made on demand) and retries on a 500 ms timer, which connects nothing either: its first write waited ~1 s.
    Metadata requests connect now and re-run the request on their responses: first write ~14 ms (measured,
    docs/benchmarks.md). Transactional producers need not: `init_transactions` connects and waits."""
    try:
        made.list_topics(timeout=10)
        # Each metadata response re-runs librdkafka's producer-id state machine; the first one can arrive over the
        # bootstrap connection just as librdkafka swaps it for the broker's own, find no broker up and leave the
        # retry to the timer (seen: 1 first write in 4 took 0.5 s). The second goes over the broker's connection.
        made.list_topics(timeout=10)
    except KafkaException:
        pass  # only a warm-up: the writes themselves report an unreachable broker
    except RuntimeError:
        pass  # the owner closed the producer meanwhile ("Handle has been closed"): nothing left to warm up


def consumer(kafka: KafkaConfig, group_id: str, **extra: Any) -> Consumer:
    """A consumer that never auto-commits (kafold commits once the work is durable), from the earliest, speaking
    [kafka] group_protocol when it subscribes (an assign-only reader never joins; its commits, if any, are a
    non-member's in either protocol)."""
    defaults = {"group.id": group_id, "enable.auto.commit": False, "auto.offset.reset": "earliest",
                **group_settings(kafka)}
    return Consumer(librdkafka(kafka, **{**defaults, **extra}))


# How long a fetch may wait at the broker for data. Short, so that partition EOF (the end of a range) shows up
# soon, but not a few milliseconds: a broker may take longer than that to gather a response, and one that answers
# with whatever it had by the deadline then returns empty fetches again and again while data sits there. Seen
# with tansu once a partition held thousands of transactions: a reader with 2 ms read 60 of 12,194 records in
# 8 s; with 10 ms it read them all in 0.8 s, with 25 ms in 0.23 s, with 500 ms in 0.64 s (docs/reliability.md).
# Kafka semantics: fetch.wait.max.ms only bounds how long a broker holds a fetch that has less than fetch.min.bytes
# (1 byte here); Apache Kafka answers as soon as any record is there, so on it this value only sets how soon an
# empty fetch at the end of a range comes back with partition EOF.
RANGE_FETCH_WAIT_MS = 25


def range_reader(kafka: KafkaConfig, group_id: str) -> Consumer:
    """A group-less reader of offset ranges (assign only, never commits), read_committed, reporting partition EOF,
    with large fetches (replays read whole partitions)."""
    return consumer(kafka, group_id, **{
        "enable.partition.eof": True, "isolation.level": "read_committed",
        "fetch.max.bytes": 64 * 1024 * 1024, "max.partition.fetch.bytes": 16 * 1024 * 1024,
        "queued.min.messages": 200000, "fetch.wait.max.ms": RANGE_FETCH_WAIT_MS})
