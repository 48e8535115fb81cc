"""State reads on any instance (daemon/aggregates/routing.py): the owner lookup from a group description, and three
`kafold daemon` processes on one config on Apache Kafka, each answering `GET /aggregates/account/{id}` for every key
— sent on to the owner, or redirected there — the same as the aggregate's results say, also while one restarts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConsumerGroupDescription, MemberAssignment, MemberDescription

from kafold import config, kafka_clients, topics
from kafold.client import CommandClient
from kafold.config import DaemonConfig, KafkaConfig, StateRouting
from kafold.daemon.aggregates import routing
from kafold.errors import ConfigError
from kafold.testing import free_port
from kafold.tools import cli
from tests.aggregates.agg_support import bank_daemon_toml
from tests.daemon.daemon_support import state_path
from tests.support import child_env, wait_for

KAFOLD = str(Path(sys.executable).parent / "kafold")
TOKEN = "s3cret-token-for-state-reads"
SECRET_VAR, INSTANCE_SECRET = "KAFOLD_TEST_INSTANCE_SECRET", "the-instance-secret-of-this-test-deployment"
KEYS = [f"acc-{i}" for i in range(24)]


# ---- pure parts ---------------------------------------------------------------------------------------------
def _member(client_id: str, *parts: tuple[str, int]) -> MemberDescription:
    return MemberDescription(f"{client_id}-m", client_id, "/127.0.0.1",
                             MemberAssignment([TopicPartition(t, p) for t, p in parts]))


def _group(*members: MemberDescription) -> ConsumerGroupDescription:
    return ConsumerGroupDescription("g", False, list(members), "range", "STABLE", None)


def test_a_client_id_carries_the_advertised_url_and_gives_it_back() -> None:
    for url in ("http://127.0.0.1:8083", "https://orders-2.orders.svc:8443/kafold", "http://[::1]:9000"):
        cid = routing.member_client_id("kafold", url)
        assert "/" not in cid and ":" not in cid  # nothing a broker's client-id metrics would mangle
        assert routing.url_of(cid) == url
    assert routing.url_of(routing.member_client_id("me@corp", "http://h:1")) == "http://h:1"  # '@' in client_id
    assert routing.member_client_id("kafold", None) == "kafold"
    assert routing.url_of("kafold") is None  # a member of an older kafold, or with HTTP off
    assert routing.url_of("rdkafka@not-a-url") is None


def test_the_owner_of_a_partition_is_the_member_the_group_assigned_it_to() -> None:
    a = routing.member_client_id("kafold", "http://a:1")
    b = routing.member_client_id("kafold", "http://b:2")
    desc = _group(_member(a, ("x.commands", 0), ("x.commands", 2), ("other", 1)),
                  _member(b, ("x.commands", 1)), _member("kafold", ("x.commands", 3)),
                  MemberDescription("idle", "kafold@http%3A%2F%2Fc%3A3", "/h", MemberAssignment([])))
    found = routing.owners(desc, "x.commands")
    assert {p: o.url for p, o in found.items()} == {0: "http://a:1", 2: "http://a:1", 1: "http://b:2", 3: None}
    assert found[3].client_id == "kafold"
    # a rebalancing classic group is described without assignments: nobody owns anything, nobody answers
    assert routing.owners(_group(MemberDescription("m", a, "/h", MemberAssignment([]))), "x.commands") == {}


def test_the_advertised_url_is_configured_or_derived_from_the_bound_address() -> None:
    assert routing.advertised_url(DaemonConfig(http_host="10.0.0.5", http_port=8090)) == "http://10.0.0.5:8090"
    import socket

    assert routing.advertised_url(DaemonConfig(http_host="0.0.0.0", http_port=8083)) == \
        f"http://{socket.gethostname()}:8083"
    assert routing.advertised_url(DaemonConfig(http_host="::1", http_port=8083)) == "http://[::1]:8083"
    assert routing.advertised_url(DaemonConfig(advertised_url="http://orders-2:8083/")) == "http://orders-2:8083"
    assert routing.advertised_url(DaemonConfig(http_port=0)) is None


def test_the_routing_settings_are_checked_at_load(tmp_path: Path) -> None:
    path = tmp_path / "kafold.toml"
    loaded = config.parse('[daemon]\nstate_routing = "redirect"\nadvertised_url = "https://a.b:1/p"\n', path)
    assert loaded.config.daemon.state_routing is StateRouting.REDIRECT
    for text, named in (('state_routing = "proxy"', "daemon.state_routing: 'proxy' is not one of"),
                        ('advertised_url = "a.b:1"', "daemon.advertised_url: expected http(s)://"),
                        ('advertised_url = "http://a.b:1/?q=1"', "daemon.advertised_url: expected http(s)://")):
        with pytest.raises(ConfigError) as bad:
            config.parse(f"[daemon]\n{text}\n", path)
        assert named in "\n".join(bad.value.problems)


def test_a_wait_is_read_from_the_query_and_bad_values_are_named() -> None:
    assert routing.Wait.parse({}) == routing.Wait(None, routing.WAIT_DEFAULT_MS)
    assert routing.Wait.parse({"min_version": "3", "timeout_ms": "250"}) == routing.Wait(3, 250)
    for query, named in (({"min_version": "x"}, "min_version"), ({"min_version": "0"}, "min_version"),
                         ({"timeout_ms": "-1"}, "timeout_ms"), ({"timeout_ms": "9999999"}, "timeout_ms")):
        with pytest.raises(ValueError, match=named):
            routing.Wait.parse(query)


# ---- three daemons on Apache Kafka --------------------------------------------------------------------------
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_RAW = urllib.request.build_opener(_NoRedirect)


def call(url: str, token: str | None = TOKEN, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """(status, JSON body, headers) of one GET, redirects not followed."""
    req = urllib.request.Request(url, headers=headers or {})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with _RAW.open(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), e.headers


class Group:
    """Three `kafold daemon` processes on one config file (each its own port: KAFOLD_DAEMON__HTTP_PORT)."""

    def __init__(self, conf: Path, kafka: KafkaConfig, group_id: str, logs: Path) -> None:
        self.conf, self.kafka, self.group_id, self.logs = conf, kafka, group_id, logs
        self.ports = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None, None, None]

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def start(self, i: int) -> None:
        env = child_env({"KAFOLD_DAEMON__HTTP_PORT": str(self.ports[i])})
        with open(self.logs / f"daemon-{i}.log", "ab") as out:
            self.procs[i] = subprocess.Popen([KAFOLD, "--log-format", "json", "daemon", "-c", str(self.conf)],
                                             stdout=out, stderr=subprocess.STDOUT, env=env)

    def stop(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (self.logs / f"daemon-{i}.log").read_text()[-3000:]
        self.procs[i] = None

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.kill()
        proc.wait()
        self.procs[i] = None

    def close(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    def shared(self) -> bool:
        """Every instance ready and the aggregate's partitions spread over all three (the group is stable)."""
        try:
            if any(call(self.url(i) + "/ready")[0] != 200 for i in range(3)):
                return False
        except OSError:  # not listening yet
            return False
        admin = AdminClient(kafka_clients.librdkafka(self.kafka))
        try:
            desc = admin.describe_consumer_groups([self.group_id], request_timeout=10)[self.group_id].result()
        except KafkaException:
            return False
        return sum(1 for m in desc.members if m.assignment and m.assignment.topic_partitions) == 3


def read(url: str, *, follow: bool, tries_503: int = 0) -> tuple[int, Any, Any, list[str]]:
    """GET a state as a client would: redirects followed (with the token) when `follow`, a 503 asked again after its
    Retry-After up to `tries_503` times. (status, body, headers, the URLs visited); status 0 when a redirect's
    target did not answer at all."""
    visited = [url]
    while True:
        try:
            status, body, headers = call(visited[-1])
        except OSError:  # refused, or reset by an instance that is stopping (URLError is an OSError)
            if len(visited) == 1:
                raise
            return 0, None, None, visited
        if status == 307 and follow and len(visited) < 5:
            visited.append(headers["Location"])
            continue
        if status == 503 and tries_503 > 0:
            assert headers.get("Retry-After"), (status, body)
            tries_503 -= 1
            time.sleep(float(headers["Retry-After"]))
            visited = visited[:1]
            continue
        return status, body, headers, visited


def send_commands(kafka: KafkaConfig, agg: config.AggregateConfig) -> dict[str, tuple[int, int]]:
    """Open every key and deposit into it; key -> (balance, version) as the results say."""
    expected: dict[str, tuple[int, int]] = {}
    with CommandClient(kafka, agg) as client:
        opened = client.send_many([client.command(k, "OpenAccount", {"owner": k}) for k in KEYS], timeout=120)
        assert {r.status for r in opened.values()} == {"accepted"}
        deposits = [client.command(k, "Deposit", {"amount": 100 + i}) for i, k in enumerate(KEYS) for _ in (1, 2)]
        results = client.send_many(deposits, timeout=120)
        assert {r.status for r in results.values()} == {"accepted"}
    for i, k in enumerate(KEYS):
        expected[k] = (2 * (100 + i), 3)
    return expected


def check(body: Any, key: str, expected: dict[str, tuple[int, int]]) -> None:
    assert (body["id"], body["state"]["balance"], body["version"]) == (key, *expected[key]), body


@pytest.mark.integration
@pytest.mark.apache_kafka
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("mode", "protocol"), [("forward", "classic"), ("redirect", "classic"),
                                                ("forward", "consumer")])
def test_every_instance_answers_every_key_the_same_also_while_one_restarts(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, broker_kind: str, mode: str, protocol: str,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if broker_kind != "kafka":
        pytest.skip("tansu stalls a consumer group's rebalance once it has two members (docs/brokers.md): "
                    "several instances in one group run on Apache Kafka only")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    conf = tmp_path / "kafold.toml"
    # the instances prove to each other that they belong to the deployment (docs/security.md#trust-between-instances)
    monkeypatch.setenv(SECRET_VAR, INSTANCE_SECRET)
    toml = bank_daemon_toml(kafka_config, unique, 0, partitions=6, daemon_extra=(
        f'api_token_file = "{token_file}"\nstate_routing = "{mode}"\nshutdown_grace_s = 5.0\n'
        f'instance_secret_env = "{SECRET_VAR}"'))
    # the group's description names the owners under either group protocol (KIP-848's "consumer" included)
    conf.write_text(toml.replace("[kafka]\n", f'[kafka]\ngroup_protocol = "{protocol}"\n', 1))
    loaded = config.load_file(conf)
    agg = loaded.config.aggregates[0]
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    group = Group(conf, kafka_config, f"{unique}.aggregate.account", tmp_path)
    follow = mode == "redirect"
    try:
        for i in range(3):
            group.start(i)
        wait_for(group.shared, "three daemons sharing the aggregate's partitions", 180)
        expected = send_commands(kafka_config, agg)

        # Every instance answers every key with the state the results describe; each asks the others for some.
        owner: dict[str, str] = {}
        for i in range(3):
            others = 0
            for key in KEYS:
                status, body, _, visited = read(group.url(i) + state_path("account", key, expected[key][1]),
                                                  follow=follow, tries_503=30)
                assert status == 200, (group.url(i), key, status, body)
                check(body, key, expected)
                owner.setdefault(key, body["served_by"])
                assert body["served_by"] == owner[key], (key, body, owner[key])
                others += body["served_by"] != group.url(i)
                assert len(visited) == (2 if follow and body["served_by"] != group.url(i) else 1), visited
            assert 0 < others < len(KEYS), (group.url(i), others)
        assert set(owner.values()) == {group.url(i) for i in range(3)}

        key = KEYS[0]
        home = next(i for i in range(3) if group.url(i) == owner[key])
        away = (home + 1) % 3
        path = f"/aggregates/account/{key}"
        if mode == "redirect":
            status, body, headers = call(group.url(away) + path)
            assert status == 307 and headers["Location"].startswith(
                owner[key] + path + "?kafold_redirected=1&kafold_t="), (status, body)
            # it carries a credential for that read: followed without the token (as the CLI does across hosts)
            assert call(headers["Location"], token=None)[0] == 200
            # a redirected read that reaches an instance which does not own the key is not redirected again (two
            # stale views of the group would send the client back and forth): 503, ask again
            status, body, headers = call(group.url(away) + path + "?kafold_redirected=1")
            assert status == 503 and headers.get("Retry-After") and "moving" in body["message"], (status, body)
        else:
            # the forwarded read carried the instance credential, not the token: the owner refuses a read without
            # either, and answered this one
            assert call(owner[key] + path, token=None)[0] == 401
            assert call(group.url(away) + path, token=None)[0] == 401  # refused before anything is sent on
            status, body, _ = call(group.url(away) + path)
            assert status == 200 and body["served_by"] == owner[key]
            # a read already sent on is never sent on again: the non-owner answers 503, not a forward
            status, body, headers = call(group.url(away) + path, headers={routing.FORWARDED_HEADER: "x"})
            assert status == 503 and headers["Retry-After"] and headers[routing.NOT_OWNER_HEADER], body
        for i in range(3):
            assert read(f"{group.url(i)}/aggregates/account/nobody", follow=follow)[0] == 404

        # Read your writes: a read at a non-owner waits for the version a command's result named.
        balance, version = expected[key]
        wait = f"{group.url(away)}{path}?min_version={version + 1}"
        status, body, _, _ = read(f"{wait}&timeout_ms=300", follow=follow)
        assert status == 408 and f"version {version}" in body["message"], body
        with CommandClient(kafka_config, agg) as client:
            client.send(client.command(key, "Deposit", {"amount": 7}), wait=False)
        status, body, _, _ = read(f"{wait}&timeout_ms=30000", follow=follow)
        expected[key] = (balance + 7, version + 1)
        assert status == 200
        check(body, key, expected)

        # `kafold state get` against an instance that does not own the key
        capsys.readouterr()
        assert cli.main(["state", "get", "-c", str(conf), "account", key, "--url", group.url(away)]) == 0
        out = capsys.readouterr().out
        check(json.loads(out[out.index("{"):]), key, expected)
        assert cli.main(["state", "get", "-c", str(conf), "account", "nobody", "--url", group.url(away)]) == 1
        assert "404 Aggregate account/nobody not found" in capsys.readouterr().err

        # One instance restarts (stopped, then killed) while the other two are read: every answer is the right
        # state or a 503 with a Retry-After; never a 404, never another state.
        seen: Counter[str] = Counter()
        wrong: list[Any] = []
        stop = threading.Event()
        restarting = 1

        def reader() -> None:
            while not stop.is_set():
                for k in KEYS:
                    for i in (0, 2):
                        try:
                            status, body, headers, visited = read(f"{group.url(i)}/aggregates/account/{k}",
                                                                  follow=follow)
                        except Exception as e:  # an instance that stays up did not answer: a failure too
                            wrong.append((i, k, repr(e)))
                            continue
                        if status == 200:
                            seen["200"] += 1
                            if (body["state"]["balance"], body["version"]) != expected[k]:
                                wrong.append((i, k, body))
                        elif status == 503 and headers.get("Retry-After") and body.get("message"):
                            seen["503"] += 1
                        elif status == 0 and visited[-1].startswith(group.url(restarting)):
                            # redirect mode: a client sent to the instance that just stopped finds it closed
                            seen["redirected to the stopped instance"] += 1
                        else:
                            wrong.append((i, k, status, body, visited))

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        try:
            group.stop(restarting)  # gracefully: it leaves the group
            group.start(restarting)
            wait_for(group.shared, "the restarted daemon back in the group", 180)
            group.kill(restarting)  # kill -9: the group names it the owner until its session times out
            group.start(restarting)
            wait_for(group.shared, "the killed daemon back in the group", 180)
        finally:
            stop.set()
            thread.join(120)
        assert wrong == [], wrong[:10]
        assert seen["200"] > 0, seen
        print("reads during the restart:", dict(seen))
        for i in range(3):
            for k in KEYS:
                status, body, _, _ = read(f"{group.url(i)}/aggregates/account/{k}", follow=follow, tries_503=30)
                assert status == 200, (group.url(i), k, status, body)
                check(body, k, expected)
    finally:
        group.close()

