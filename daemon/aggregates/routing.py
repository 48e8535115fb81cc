"""State reads on any instance: which daemon owns an aggregate's key, and the read sent on to it.

Ownership is the aggregate's consumer group assignment and nothing else: partition p of the commands topic (the
key's partition, kafold.partitioning, as the command client picks it) belongs to the member the group assigned it
to, and that member's runtime serves p's keys once p's gate is LIVE. Each daemon's aggregate consumer carries its
advertised HTTP address in its `client.id` (`<kafka.client_id>@<url, percent-encoded>@k1.<signature>`,
`member_client_id`); DescribeConsumerGroups reports every member's client id with its assignment (classic and
KIP-848 groups alike: checked on Apache Kafka 4.3 with confluent-kafka 2.16). So any instance finds a key's owner
from one group description: no second registry that could disagree with the group, nothing stored. A description
is cached for OWNERS_TTL_S and asked again on a miss or when a forward fails.

While a partition moves nobody answers for it: a classic group describes no assignments while it rebalances, a
KIP-848 group assigns a partition only once its previous owner released it, and a new owner answers 503 itself until
its gate opens. What keeps an answer right is not the description (it can be stale) but the runtime: only an
instance whose gate of the key's partition is LIVE answers with a state; a stale lookup costs a 503. A read sent on
carries FORWARDED_HEADER and is never sent on again: an instance that finds it does not own the key after all
answers 503 with NOT_OWNER_HEADER, and the sender asks the group once more. Likewise a redirect's Location carries
REDIRECTED_PARAM, and an instance that is sent a redirected read for a key it does not own answers 503 instead of
redirecting again: two instances whose stale descriptions name each other would otherwise send a client back and
forth until it gives up.

Trust (trust.py, docs/security.md#trust-between-instances): anyone who may join the group writes a client id, so a
member's address is used only when its signature verifies under the deployment's instance secret; a read is then
sent to a URL built from the parsed address and the fixed state path, signed with the instance secret (never with
the caller's token), and its answer is read up to `[daemon] forward_max_bytes`. Without an instance secret a daemon
sends nothing on and redirects nowhere: it answers 503 for keys it does not own.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgspec
from confluent_kafka import KafkaException

from kafold import kafka_clients, logs
from kafold.config import DaemonConfig, KafkaConfig, StateRouting
from kafold.daemon.aggregates import trust
from kafold.daemon.aggregates.gate import PartitionGate
from kafold.daemon.aggregates.trust import InstanceKey, Peer
from kafold.domain import AggregateDomain
from kafold.partitioning import partition_for

if TYPE_CHECKING:
    from aiohttp import ClientSession
    from aiohttp.web import Request

    from kafold.daemon.tasks import AggregateSlot

log = logs.get(__name__)

Call = Callable[..., Awaitable[Any]]
"""Runs a blocking function off the event loop (the host's executor): `await call(fn, *args)`."""


class ServesState(Protocol):
    """What the router reads of an aggregate runtime (kafold.daemon.aggregates.AggregateRuntime): typed here by
    these names so that routing does not import the runtime, which imports routing."""

    kafka: KafkaConfig
    group_id: str
    topics: dict[str, str]
    gates: dict[int, PartitionGate]
    domain: AggregateDomain

    def get(self, aggregate_id: str) -> tuple[Any, int, str] | None: ...

FORWARDED_HEADER = "Kafold-Forwarded-By"  # set on a read sent on to the owner: it is never sent on again
NOT_OWNER_HEADER = "Kafold-Not-Owner"     # on a 503 from an instance a read was sent on to that no longer owns it
REDIRECTED_PARAM = "kafold_redirected"     # in a redirect's Location: the read is not redirected again
OWNERS_TTL_S = 2.0          # how long a group description answers for owners (refreshed sooner on a miss)
MIN_REFRESH_S = 0.2         # but asked at most this often (reads of a moving partition would ask on each)
DESCRIBE_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1           # the hint on a 503 while a partition moves: a rebalance plus a catch-up, usually
WAIT_DEFAULT_MS = 5_000     # ?min_version=N without timeout_ms
WAIT_MAX_MS = 60_000        # the longest ?timeout_ms a read may wait
FORWARD_SLACK_S = 10.0      # a forward's own time limit beyond the read's wait
FAILURE_LOG_EVERY_S = 10.0  # one `aggregate.forward_failed` line per owner this often (each read would log one)
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


# ---- the advertised address in the group --------------------------------------------------------------------
def advertised_url(daemon: DaemonConfig) -> str | None:
    """`[daemon] advertised_url`, else `http://<http_host>:<http_port>` (the host name for a wildcard bind); None
    when HTTP is off (such an instance owns partitions nobody else can ask it for)."""
    if daemon.advertised_url:
        return daemon.advertised_url.rstrip("/")
    if not daemon.http_port:
        return None
    host = socket.gethostname() if daemon.http_host in WILDCARD_HOSTS else daemon.http_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"http://{host}:{daemon.http_port}"


def member_client_id(client_id: str, url: str | None, group: str = "", key: InstanceKey | None = None) -> str:
    """The aggregate consumer's client.id: `client_id@<url percent-encoded>`, signed for `group` with `key`
    (trust.advertisement)."""
    return trust.advertisement(client_id, url, group, key)


def url_of(client_id: str) -> str | None:
    """The URL a member's client id claims, or None (a member without one: HTTP off, or an older kafold). A
    claim only: `owners` verifies it."""
    return trust.advertised(client_id)[0]


@dataclass(frozen=True)
class Owner:
    """The member holding a partition: its client id, the URL it claims (None: it advertises none) and, only when
    its signature verified under the instance secret, that URL taken apart (`peer`): the one thing a read is sent
    to."""

    client_id: str
    url: str | None
    peer: Peer | None = None


def owners(description: Any, topic: str, group: str = "", key: InstanceKey | None = None) -> dict[int, Owner]:
    """partition -> owner of `topic`'s partitions in a confluent-kafka ConsumerGroupDescription of `group`. A
    partition that no member holds (unassigned, or the group rebalancing) is absent."""
    out: dict[int, Owner] = {}
    for m in description.members:
        assigned = m.assignment.topic_partitions if m.assignment is not None else []
        mine = [tp.partition for tp in assigned if tp.topic == topic]
        if mine:
            owner = _owner(m.client_id, group, key)
            out.update(dict.fromkeys(mine, owner))
    return out


def _owner(client_id: str, group: str, key: InstanceKey | None) -> Owner:
    url, mac = trust.advertised(client_id)
    peer = None
    if url is not None and mac is not None and key is not None and key.verify(mac, "advert", group, url):
        try:
            peer = Peer.parse(url)
        except ValueError:  # signed by an instance of an older kafold that allowed more: still not sent to
            peer = None
    return Owner(client_id, url, peer)


class OwnerDirectory:
    """The owners of one aggregate's commands partitions, from its group's description (cached OWNERS_TTL_S).
    Blocking: call it off the event loop."""

    def __init__(self, kafka: KafkaConfig, group_id: str, topic: str, key: InstanceKey | None = None,
                 ttl_s: float = OWNERS_TTL_S) -> None:
        self.kafka, self.group_id, self.topic, self.key, self.ttl_s = kafka, group_id, topic, key, ttl_s
        self.admin: Any = None
        self.lock = threading.Lock()
        self.table: dict[int, Owner] = {}
        self.at = float("-inf")

    def owner(self, partition: int, fresh: bool = False) -> Owner | None:
        """Who holds `partition`: from the cached description, asked again when older than the TTL, when `fresh`
        (a forward failed) or when the cache names nobody."""
        # While another read refreshes, answer from the description before it: these calls run on the daemon's
        # small shared executor, which must not fill up with threads waiting on one slow broker request.
        if not self.lock.acquire(blocking=self.at == float("-inf")):
            return self.table.get(partition)
        try:
            age = time.monotonic() - self.at
            if age > self.ttl_s or (age > MIN_REFRESH_S and (fresh or partition not in self.table)):
                self._describe()
            return self.table.get(partition)
        finally:
            self.lock.release()

    def _describe(self) -> None:
        if self.admin is None:
            self.admin = kafka_clients.admin(self.kafka)
        try:
            desc = self.admin.describe_consumer_groups([self.group_id], request_timeout=DESCRIBE_TIMEOUT_S)
            self.table = owners(desc[self.group_id].result(), self.topic, self.group_id, self.key)
        except KafkaException as e:  # no group yet, its coordinator moving: nobody known to own anything
            log.info("aggregate.owners_unknown", group=self.group_id, error=str(e))
            self.table = {}
        self.at = time.monotonic()


# ---- the read -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """What the view sends back: status, JSON body, headers."""

    status: int
    body: Any
    headers: dict[str, str]

    @classmethod
    def problem(cls, status: int, message: str, **headers: str) -> Answer:
        return cls(status, {"error_code": status, "message": message}, dict(headers))

    @classmethod
    def moving(cls, message: str, **headers: str) -> Answer:
        return cls.problem(503, message, **{"Retry-After": str(RETRY_AFTER_S), **headers})


@dataclass(frozen=True)
class Wait:
    """`?min_version=N&timeout_ms=T`: answer once the state has reached version N, else 408 after T ms."""

    min_version: int | None = None
    timeout_ms: int = WAIT_DEFAULT_MS

    @classmethod
    def parse(cls, query: Any) -> Wait:
        """From a request's query; ValueError naming the bad parameter."""
        def number(name: str, low: int, high: int | None = None) -> int | None:
            raw = query.get(name)
            if raw is None:
                return None
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
            if value < low or (high is not None and value > high):
                raise ValueError(f"{name}: expected {low}..{high if high is not None else ''}, got {value}")
            return value

        timeout = number("timeout_ms", 0, WAIT_MAX_MS)
        return cls(number("min_version", 1), WAIT_DEFAULT_MS if timeout is None else timeout)


class StateRouter:
    """Answers `GET /aggregates/{name}/{id}` on one daemon: from its own runtime when it owns the key's partition,
    else from the owner (forward) or with the owner's address (redirect), when the owner proved it is an instance
    of this deployment (trust.py)."""

    def __init__(self, d: DaemonConfig, key: InstanceKey | None, call: Call) -> None:
        self.call = call
        self.url = advertised_url(d)
        self.peer = _peer_or_none(self.url)
        self.mode = d.state_routing
        self.key = key
        self.max_bytes = d.forward_max_bytes
        # https peers: certificates verified against the system's trust store, or [daemon] peer_ca_file
        self.tls = ssl.create_default_context(cafile=d.peer_ca_file or None)
        self.directories: dict[str, OwnerDirectory] = {}
        self.failures_logged: dict[str, float] = {}  # owner (or reason) -> when its last failure was logged

    def directory(self, slot: AggregateSlot) -> OwnerDirectory:
        d = self.directories.get(slot.name)
        if d is None:
            rt = _runtime(slot)
            d = self.directories[slot.name] = OwnerDirectory(rt.kafka, rt.group_id, rt.topics["commands"], self.key)
        return d

    async def read(self, slot: AggregateSlot, aggregate_id: str, wait: Wait, request: Request,
                   session: ClientSession) -> Answer:
        partition = partition_for(aggregate_id.encode(), slot.config.partitions)
        if slot.failed or not slot.thread.is_alive():
            return Answer.moving(f"Aggregate {slot.name} is not running on this instance")
        if partition in _runtime(slot).gates:
            return await self.local(slot, aggregate_id, partition, wait)
        # a read that came from another instance (or its redirect) is never sent on again
        if request.headers.get(FORWARDED_HEADER) or request.headers.get(trust.AUTH_HEADER):
            return Answer.moving(f"partition {partition} of {slot.name} is not owned here (it is moving)",
                                 **{NOT_OWNER_HEADER: "1"})
        if REDIRECTED_PARAM in request.query:
            return Answer.moving(f"partition {partition} of {slot.name} is not owned here (it is moving)")
        if self.key is None:  # no Retry-After: it stays so until the instances share a secret
            self._log_once("untrusted", "aggregate.not_sent_on", aggregate=slot.name,
                           reason="no instance secret: state reads are sent on only to instances that prove they "
                                  "belong to the deployment", hint="set [daemon] instance_secret_env on every instance")
            return Answer.problem(503, f"partition {partition} of {slot.name} is owned by another instance, and this "
                                  "one sends state reads on only to instances that prove they belong to the "
                                  "deployment: set [daemon] instance_secret_env (or _file) on every instance, or ask "
                                  "the owner (docs/security.md#trust-between-instances)")
        directory = self.directory(slot)
        owner = await self.call(directory.owner, partition)
        tried: set[Peer] = set()
        query = [] if wait.min_version is None else [("min_version", str(wait.min_version)),
                                                     ("timeout_ms", str(wait.timeout_ms))]
        while True:
            if owner is None:
                return Answer.moving(f"partition {partition} of {slot.name} has no owner now (it is moving)")
            if owner.url is None:
                return Answer.moving(f"partition {partition} of {slot.name} is owned by {owner.client_id[:200]!r}, "
                                     "which advertises no HTTP address ([daemon] advertised_url, http_port)")
            peer = owner.peer
            if peer is None:  # no Retry-After: a member that cannot sign is no instance of this deployment
                self._log_once(f"unverified {owner.client_id}", "aggregate.owner_unverified", aggregate=slot.name,
                               partition=partition, member_client_id=owner.client_id[:200],
                               reason="its advertised address is not signed with this deployment's instance secret",
                               action="answered 503; nothing sent to it")
                return Answer.problem(503, f"partition {partition} of {slot.name} is owned by group member "
                                      f"{owner.client_id[:200]!r}, whose advertised address does not verify (not an "
                                      "instance of this deployment, or its [daemon] instance_secret differs): no "
                                      "read is sent to it")
            if peer == self.peer:  # the group gave it to this instance; its runtime has not taken it yet
                return Answer.moving(f"partition {partition} of {slot.name} is being assigned here")
            if self.mode is StateRouting.REDIRECT:
                path = trust.signed_redirect(self.key, peer.state_path(slot.name, aggregate_id,
                                                                       [*query, (REDIRECTED_PARAM, "1")]))
                target = peer.origin + path
                return Answer(307, {"location": target, "owner": peer.origin + peer.prefix}, {"Location": target})
            if peer in tried:  # the group still names the instance that just failed: it is moving
                return Answer.moving(f"partition {partition} of {slot.name} is moving ({peer.origin} did not answer "
                                     "for it)")
            tried.add(peer)
            got = await self.forward(session, peer, peer.state_path(slot.name, aggregate_id, query), wait)
            if got is not None:
                return got
            owner = await self.call(directory.owner, partition, True)  # gone, or gave it up: ask again

    async def local(self, slot: AggregateSlot, aggregate_id: str, partition: int, wait: Wait) -> Answer:
        """From this runtime: its state once it reaches `wait.min_version` (if any), 404 when it has no events,
        503 while the partition catches up or leaves."""
        runtime = _runtime(slot)
        deadline = time.monotonic() + wait.timeout_ms / 1000
        pause = 0.005
        while True:
            gate = runtime.gates.get(partition)
            if gate is None:
                return Answer.moving(f"partition {partition} of {slot.name} is leaving this instance")
            if gate.stopped:  # no Retry-After: it stays so until the fold is fixed and the daemon restarted
                return Answer.problem(503, f"partition {partition} of {slot.name} stopped at an event its fold "
                                      "cannot apply (see /status); no state is served from it")
            if not gate.live:
                return Answer.moving(f"partition {partition} of {slot.name} is catching up")
            got = await self.call(runtime.get, aggregate_id)
            if runtime.gates.get(partition) is not gate:  # revoked (or reassigned) while it was read: not an answer
                return Answer.moving(f"partition {partition} of {slot.name} moved while it was read")
            if got is not None and (wait.min_version is None or got[1] >= wait.min_version):
                state, version, source = got
                # the state's one JSON form (`state get`, ?version=N, the snapshots): a datetime keeps its zone
                return Answer(200, {"aggregate": slot.name, "id": aggregate_id, "version": version,
                                    "state": runtime.domain.state_to_json(state), "read_from": source,
                                    "partition": partition, "served_by": self.url}, {})
            if wait.min_version is None:
                return Answer.problem(404, f"Aggregate {slot.name}/{aggregate_id} not found")
            left = deadline - time.monotonic()
            if left <= 0:
                have = got[1] if got is not None else 0
                return Answer.problem(408, f"Aggregate {slot.name}/{aggregate_id} is at version {have}, not yet "
                                      f"{wait.min_version}, after {wait.timeout_ms} ms")
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)

    async def forward(self, session: ClientSession, peer: Peer, path: str, wait: Wait) -> Answer | None:
        """The owner's answer, or None when it cannot give one (unreachable, or no longer the owner). The read
        carries this instance's credential, never the caller's token (trust.py)."""
        # Imported here, not at the top: the aggregate worker processes import this module (member_client_id) and
        # never forward a read; aiohttp's import costs a process ~16 MB (docs/benchmarks.md, issue 56). The daemon's
        # process, which forwards, has it loaded already (its HTTP server).
        import aiohttp
        from yarl import URL

        assert self.key is not None
        headers = {FORWARDED_HEADER: self.url or "unknown", trust.AUTH_HEADER: trust.read_credential(self.key, path)}
        limit = aiohttp.ClientTimeout(total=wait.timeout_ms / 1000 + FORWARD_SLACK_S)
        target = URL(peer.origin + path, encoded=True)  # sent as built: the MAC covers these very bytes
        try:
            async with session.get(target, headers=headers, timeout=limit, allow_redirects=False,
                                   ssl=self.tls) as resp:
                if resp.status == 503 and resp.headers.get(NOT_OWNER_HEADER):
                    return None
                raw = await self._capped(resp)
                if raw is None:
                    self._log_once(f"large {peer}", "aggregate.forward_refused", target=str(target),
                                   reason=f"the answer is larger than [daemon] forward_max_bytes ({self.max_bytes})")
                    return Answer.problem(502, f"the owner's answer is larger than [daemon] forward_max_bytes "
                                          f"({self.max_bytes} bytes)")
                if resp.status == 401:  # our credential refused: not the caller's fault, and not a token problem
                    self._log_once(f"refused {peer}", "aggregate.forward_refused", target=str(target),
                                   reason="the owner refused this instance's credential (instance secrets differ, "
                                          f"or the clocks are more than {trust.MAX_SKEW_S} s apart)")
                    return Answer.problem(502, "the owner refused this instance's credential (see this instance's log)")
                body = msgspec.json.decode(raw)  # not orjson: a state's integer beyond 64 bits would become a float
                kept = {k: resp.headers[k] for k in ("Retry-After",) if k in resp.headers}
                return Answer(resp.status, body, kept)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            self._log_once(peer.origin, "aggregate.forward_failed", target=str(target),
                           error=f"{type(e).__name__}: {e}",
                           action="answered 503 (Retry-After) unless the group names another owner")
            return None

    async def _capped(self, resp: Any) -> bytes | None:
        """The body of `resp`, or None once it passes `max_bytes` (read no further)."""
        if resp.content_length is not None and resp.content_length > self.max_bytes:
            return None
        raw = bytearray()
        async for chunk in resp.content.iter_chunked(64 * 1024):
            raw += chunk
            if len(raw) > self.max_bytes:
                return None
        return bytes(raw)

    def _log_once(self, what: str, event: str, **fields: Any) -> None:
        """One `event` line per `what` every FAILURE_LOG_EVERY_S (each read would log one)."""
        now = time.monotonic()
        if now - self.failures_logged.get(what, float("-inf")) >= FAILURE_LOG_EVERY_S:
            if len(self.failures_logged) > 1000:  # members come and go (and may be anyone): keep it bounded
                self.failures_logged.clear()
            self.failures_logged[what] = now
            log.info(event, **fields)


def _peer_or_none(url: str | None) -> Peer | None:
    try:
        return Peer.parse(url) if url is not None else None
    except ValueError:  # a derived host name that is no URL host (this instance then never matches an owner)
        return None


def _runtime(slot: AggregateSlot) -> ServesState:
    """The slot's runtime as built by `build_runtime` (daemon.tasks types it by the little the host needs)."""
    return cast(ServesState, slot.runtime)

