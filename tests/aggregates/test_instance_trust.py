"""Instances trust only instances (daemon/aggregates/trust.py, docs/security.md#trust-between-instances): a state read
is sent on, or redirected, only to a group member whose advertised address is signed with the deployment's instance
secret, to a URL built from that address and the fixed state path, with the instance credential and never the
caller's token; the CLI carries its token to the host it was given only. On Apache Kafka: a rogue member of the
aggregate's group, with a chosen client id and a real HTTP server at the address it claims, gets no request."""

from __future__ import annotations

import asyncio
import http.server
import json
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import quote

import aiohttp
import pytest
import trustme
from aiohttp import web
from confluent_kafka import KafkaException
from confluent_kafka import TopicPartition as KafkaTP
from confluent_kafka.admin import AdminClient, ConsumerGroupDescription, MemberAssignment, MemberDescription

from kafold import config, kafka_clients, topics
from kafold.client import CommandClient, http_get
from kafold.config import DaemonConfig, KafkaConfig
from kafold.daemon.aggregates import routing, trust
from kafold.daemon.aggregates.trust import InstanceKey, Peer
from kafold.errors import ConfigError, KafoldError
from kafold.partitioning import partition_for
from kafold.schema import Secret
from kafold.testing import free_port
from kafold.tools import cli
from tests.aggregates.agg_support import bank_daemon_toml
from tests.aggregates.test_state_routing import KAFOLD, call, read
from tests.support import child_env, wait_for

SECRET = "an-instance-secret-of-forty-four-characters!"
OTHER = "another-deployments-secret-also-long-enough!"
TOKEN = "s3cret-token-for-state-reads"
SECRET_VAR = "KAFOLD_TEST_INSTANCE_SECRET"


# ---- the advertisement ---------------------------------------------------------------------------------------
def test_an_advertisement_verifies_only_for_its_address_group_and_secret() -> None:
    key = InstanceKey([SECRET])
    cid = routing.member_client_id("kafold", "http://10.0.0.5:8083", "g.aggregate.account", key)
    assert "/" not in cid and ":" not in cid
    desc = ConsumerGroupDescription("g", False, [
        MemberDescription("m", cid, "/h", MemberAssignment([KafkaTP("x.commands", 0)]))], "range", "STABLE", None)
    assert routing.owners(desc, "x.commands", "g.aggregate.account", key)[0].peer == Peer("http", "10.0.0.5", 8083, "")
    for group, k in (("g.aggregate.other", key), ("g.aggregate.account", InstanceKey([OTHER])),
                     ("g.aggregate.account", None)):
        assert routing.owners(desc, "x.commands", group, k)[0].peer is None
    # another address under the same signature; no signature; a signature of garbage
    url, mac = trust.advertised(cid)
    assert url == "http://10.0.0.5:8083" and mac
    for forged in (f"kafold@{quote('http://10.0.0.6:8083', safe='')}@k1.{mac}",
                   f"kafold@{quote('http://10.0.0.5:8083', safe='')}", f"kafold@{quote(url, safe='')}@k1.AAAA"):
        assert routing._owner(forged, "g.aggregate.account", key).peer is None, forged
    # rotation: a member signing with the previous secret verifies where both are accepted
    old = routing.member_client_id("kafold", url, "g", InstanceKey([OTHER]))
    assert routing._owner(old, "g", InstanceKey([SECRET, OTHER])).peer is not None
    assert routing.member_client_id("kafold", url, "g", None) == f"kafold@{quote(url, safe='')}"  # unsigned


def test_even_a_signed_address_is_used_only_as_scheme_host_port_and_plain_prefix() -> None:
    key = InstanceKey([SECRET])
    for url in ("http://127.0.0.1:9/steal#", "http://127.0.0.1:9/x?a=1", "http://u:p@127.0.0.1:9",
                "http://127.0.0.1:99999", "http://127.0.0.1:9/a/../admin", "http://127.0.0.1:9/a%2F..",
                "http://127.0.0.1:9/ a", "ftp://127.0.0.1:9", "http://:9", "http://127.0.0.1:9\n",
                "http://127.0.0.1:9\\@evil"):
        with pytest.raises(ValueError):
            Peer.parse(url)
        cid = routing.member_client_id("kafold", url, "g", key)  # signed all the same: still not used
        assert routing._owner(cid, "g", key).peer is None, url
    peer = Peer.parse("https://Orders-2.orders.svc:8443/kafold/")
    assert (peer.origin, peer.prefix) == ("https://orders-2.orders.svc:8443", "/kafold")
    assert Peer.parse("http://[::1]:9000").origin == "http://[::1]:9000"
    assert Peer.parse("http://h").port == 80 and Peer.parse("https://h").port == 443
    assert peer.state_path("account", "a/b#c?d", [("min_version", "2")]) == \
        "/kafold/aggregates/account/a%2Fb%23c%3Fd?min_version=2"


def test_the_instance_secret_is_a_reference_long_enough_and_never_shown(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kafold.toml"
    for text, named in (('instance_secret = "x"', "daemon.instance_secret: literal secrets are refused"),
                        ('instance_secret_previous_env = "V"', "daemon.instance_secret: instance_secret_previous is"),
                        ('peer_ca_file = "/nope.pem"', "daemon.peer_ca_file: file '/nope.pem' does not exist"),
                        ('advertised_url = "http://h:1/x#"', "daemon.advertised_url: expected"),
                        ('advertised_url = "http://u@h:1"', "daemon.advertised_url: expected")):
        with pytest.raises(ConfigError) as bad:
            config.parse(f"[daemon]\n{text}\n", path, {"V": SECRET})
        assert named in "\n".join(bad.value.problems), bad.value.problems
    monkeypatch.setenv("SHORT", "too-short")
    with pytest.raises(ConfigError, match=r"daemon.instance_secret: .* shorter than 32"):
        InstanceKey.of(DaemonConfig(instance_secret=Secret("env:SHORT")))
    monkeypatch.setenv("GOOD", SECRET)
    key = InstanceKey.of(DaemonConfig(instance_secret=Secret("env:GOOD")))
    assert key is not None and SECRET not in repr(key) and InstanceKey.of(DaemonConfig()) is None


# ---- the signed read -----------------------------------------------------------------------------------------
def test_a_signed_read_is_accepted_for_that_read_only_and_only_for_a_while() -> None:
    key, now = InstanceKey([SECRET]), 1_800_000_000.0
    path = "/aggregates/account/acc-1?min_version=2&timeout_ms=100"
    header = {trust.AUTH_HEADER: trust.read_credential(key, path, now)}
    assert trust.instance_read(key, "GET", path, header, now + 5)
    assert trust.instance_read(InstanceKey([OTHER, SECRET]), "GET", path, header, now)  # while rotating
    assert not trust.instance_read(key, "GET", path.replace("acc-1", "acc-2"), header, now)
    assert not trust.instance_read(key, "POST", path, header, now)
    assert not trust.instance_read(key, "GET", path, header, now + trust.MAX_SKEW_S + 1)
    assert not trust.instance_read(InstanceKey([OTHER]), "GET", path, header, now)
    assert not trust.instance_read(None, "GET", path, header, now)
    for bad in ("", "t=x,mac=y", "t=1,mac=" + "A" * 500, "garbage", "t=,", "\udcff", f"t={int(now)},mac=\udcff"):
        assert not trust.instance_read(key, "GET", path, {trust.AUTH_HEADER: bad}, now)
    assert not trust.instance_read(key, "GET", path + "\udcff", header, now)  # undecodable bytes: no exception
    # a redirect's Location: the credential in its query covers everything before it
    signed = trust.signed_redirect(key, f"{path}&kafold_redirected=1", now)
    assert trust.instance_read(key, "GET", signed, {}, now + 1)
    assert not trust.instance_read(key, "GET", signed.replace("min_version=2", "min_version=1"), {}, now)
    assert not trust.instance_read(key, "GET", signed, {}, now + 60)
    # a MAC made for one use does not pass for the other
    mac = header[trust.AUTH_HEADER].split("mac=")[1]
    assert not trust.instance_read(key, "GET", f"{path}&kafold_t={int(now)}&kafold_mac={mac}", {}, now)


# ---- the router's decisions ---------------------------------------------------------------------------------
def _router(key: InstanceKey | None, owner: routing.Owner | None, mode: str = "forward") -> routing.StateRouter:
    """A router whose group names `owner` for every partition (no Kafka)."""
    async def call(fn: Any, *args: Any) -> Any:
        return fn(*args)

    daemon = DaemonConfig(http_port=8083, state_routing=routing.StateRouting(mode))
    r = routing.StateRouter(daemon, key, call)
    r.directory = lambda slot: cast(Any, SimpleNamespace(owner=lambda partition, fresh=False: owner))  # type: ignore[method-assign]
    return r


def _read(router: routing.StateRouter, **headers: str) -> routing.Answer:
    slot = SimpleNamespace(name="account", failed=False, thread=SimpleNamespace(is_alive=lambda: True),
                           runtime=SimpleNamespace(gates={}), config=SimpleNamespace(partitions=4))
    request = SimpleNamespace(headers=headers, query={})
    return asyncio.run(router.read(cast(Any, slot), "acc-1", routing.Wait(), cast(Any, request), cast(Any, None)))


def test_without_an_instance_secret_nothing_is_sent_on_and_the_answer_says_why() -> None:
    owner = routing._owner(routing.member_client_id("kafold", "http://10.0.0.9:8083", "g", InstanceKey([SECRET])),
                           "g", InstanceKey([SECRET]))
    for mode in ("forward", "redirect"):
        got = _read(_router(None, owner, mode))
        assert got.status == 503 and "instance_secret_env" in got.body["message"] and not got.headers


def test_a_member_that_does_not_verify_gets_neither_a_read_nor_a_redirect() -> None:
    key = InstanceKey([SECRET])
    unsigned = routing._owner(f"kafold@{quote('http://10.0.0.9:8083/x#', safe='')}", "g", key)
    for mode in ("forward", "redirect"):
        got = _read(_router(key, unsigned, mode))
        assert got.status == 503 and "does not verify" in got.body["message"] and not got.headers, got
    # a verified owner: the redirect names the URL built from its address, with a credential for that read
    owner = routing._owner(routing.member_client_id("kafold", "http://10.0.0.9:8083/p", "g", key), "g", key)
    got = _read(_router(key, owner, "redirect"))
    location = got.headers["Location"]
    assert got.status == 307 and location.startswith(
        "http://10.0.0.9:8083/p/aggregates/account/acc-1?kafold_redirected=1&kafold_t="), location
    assert trust.instance_read(key, "GET", location.removeprefix("http://10.0.0.9:8083"), {})
    # a read that came from an instance is never sent on (nor is anything that only claims to)
    got = _read(_router(key, owner), **{trust.AUTH_HEADER: "t=1,mac=x"})
    assert got.status == 503 and got.headers[routing.NOT_OWNER_HEADER]


# ---- the forward itself (https, its credential, its size) ---------------------------------------------------
def test_a_forward_goes_over_verified_https_with_the_instance_credential_and_a_bounded_answer(
        tmp_path: Path) -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    key = InstanceKey([SECRET])
    seen: list[tuple[str, dict[str, str]]] = []

    async def state(request: web.Request) -> web.Response:
        seen.append((request.raw_path, dict(request.headers)))
        if not trust.instance_read(key, request.method, request.raw_path, request.headers):
            return web.json_response({"message": "no"}, status=401)
        if request.match_info["id"] == "big":
            return web.json_response({"state": "x" * 4096})
        return web.json_response({"id": request.match_info["id"], "served_by": "owner"})

    def router(ca: str | None) -> routing.StateRouter:
        daemon = DaemonConfig(peer_ca_file=ca, forward_max_bytes=2048)
        async def call(fn: Any, *args: Any) -> Any:
            return fn(*args)

        return routing.StateRouter(daemon, key, call)

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/kafold/aggregates/{name}/{id}", state)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
        await site.start()
        port = runner.addresses[0][1]
        peer = Peer.parse(f"https://127.0.0.1:{port}/kafold")
        wait = routing.Wait(2, 100)
        try:
            async with aiohttp.ClientSession() as session:
                got = await router(str(ca_file)).forward(session, peer, peer.state_path("account", "a b", [
                    ("min_version", "2"), ("timeout_ms", "100")]), wait)
                assert got is not None and (got.status, got.body) == (200, {"id": "a b", "served_by": "owner"})
                path, headers = seen[-1]
                assert path == "/kafold/aggregates/account/a%20b?min_version=2&timeout_ms=100"
                assert "Authorization" not in headers and trust.AUTH_HEADER in headers
                got = await router(str(ca_file)).forward(session, peer, peer.state_path("account", "big"), wait)
                assert got is not None and got.status == 502 and "forward_max_bytes" in got.body["message"]
                # the system's trust store does not know this CA: nothing is read, the read answers 503 upstream
                before = len(seen)
                assert await router(None).forward(session, peer, peer.state_path("account", "a"), wait) is None
                assert len(seen) == before
        finally:
            await runner.cleanup()

    asyncio.run(main())


# ---- the CLI's redirects -------------------------------------------------------------------------------------
class _Recorder(http.server.BaseHTTPRequestHandler):
    """Records each request's path and Authorization header; answers as `routes` says (path -> (status, headers,
    body)), else 200 with a JSON state."""

    seen: list[tuple[str, str | None]]
    routes: dict[str, tuple[int, dict[str, str], bytes]]

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        status, headers, body = self.routes.get(self.path.split("?")[0], (200, {}, b'{"state": "forged"}'))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return None


@contextmanager
def recording_server(routes: dict[str, tuple[int, dict[str, str], bytes]] | None = None
                     ) -> Iterator[tuple[int, list[tuple[str, str | None]]]]:
    """A local HTTP server on a free port recording every request: (port, [(path, Authorization)])."""
    seen: list[tuple[str, str | None]] = []
    handler = type("Handler", (_Recorder,), {"seen": seen, "routes": routes or {}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_cli_sends_its_token_to_the_origin_it_was_given_only() -> None:
    with recording_server() as (elsewhere, far):
        hops = {"/same": (307, {"Location": "/other"}, b""),
                "/other": (302, {"Location": f"http://localhost:{elsewhere}/state"}, b""),  # another host
                "/file": (307, {"Location": "file:///etc/passwd"}, b""),
                "/loop": (307, {"Location": "/loop"}, b"")}
        with recording_server(hops) as (port, near):
            status, body, _, answered = http_get(f"http://127.0.0.1:{port}/same", TOKEN, 5)
            assert (status, json.loads(body), answered) == (200, {"state": "forged"},
                                                            f"http://localhost:{elsewhere}/state")
            assert near == [("/same", f"Bearer {TOKEN}"), ("/other", f"Bearer {TOKEN}")]  # same origin: kept
            assert far == [("/state", None)]  # another host (or port, or scheme): no token
            with pytest.raises(KafoldError, match="not an http"):
                http_get(f"http://127.0.0.1:{port}/file", TOKEN, 5)
            with pytest.raises(KafoldError, match="more than 5 redirects"):
                http_get(f"http://127.0.0.1:{port}/loop", TOKEN, 5)


# ---- on Apache Kafka: a rogue member, a legitimate second instance -------------------------------------------
class Rogue:
    """A confluent-kafka consumer joining the aggregate's group as the daemons do (kafold's own consumer settings,
    the same group protocol), with a chosen client id; it polls so that it keeps what the group assigns it."""

    def __init__(self, kafka: KafkaConfig, group_id: str, topic: str, client_id: str) -> None:
        self.consumer = kafka_clients.consumer(kafka, group_id, **{"client.id": client_id})
        self.consumer.subscribe([topic])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.consumer.poll(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.consumer.close()


def _members(kafka: KafkaConfig, group_id: str) -> dict[str, set[int]]:
    """client id -> partitions, of the members holding some."""
    admin = AdminClient(kafka_clients.librdkafka(kafka))
    try:
        desc = admin.describe_consumer_groups([group_id], request_timeout=10)[group_id].result()
    except KafkaException:
        return {}
    return {m.client_id: {tp.partition for tp in m.assignment.topic_partitions}
            for m in desc.members if m.assignment and m.assignment.topic_partitions}


@pytest.mark.integration
@pytest.mark.apache_kafka
@pytest.mark.timeout(240)
def test_a_rogue_group_member_gets_no_read_while_a_fellow_instance_still_does(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, broker_kind: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    if broker_kind != "kafka":
        pytest.skip("several members in one group run on Apache Kafka only (docs/brokers.md)")
    monkeypatch.setenv(SECRET_VAR, SECRET)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    conf = tmp_path / "kafold.toml"
    conf.write_text(bank_daemon_toml(kafka_config, unique, 0, partitions=6, daemon_extra=(
        f'api_token_file = "{token_file}"\ninstance_secret_env = "{SECRET_VAR}"\nshutdown_grace_s = 2.0')))
    loaded = config.load_file(conf)
    agg = loaded.config.aggregates[0]
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    group_id, commands = f"{unique}.aggregate.account", agg.topic("commands")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen[bytes]] = []
    rogue: Rogue | None = None
    # A forwards reads, B redirects them: both kinds of hand-over, one group
    with recording_server() as (rogue_port, rogue_seen):
        try:
            for i, mode in enumerate(("forward", "redirect")):
                env = child_env({"KAFOLD_DAEMON__HTTP_PORT": str(ports[i]), "KAFOLD_DAEMON__STATE_ROUTING": mode})
                with open(tmp_path / f"daemon-{i}.log", "ab") as out:
                    procs.append(subprocess.Popen([KAFOLD, "--log-format", "json", "daemon", "-c", str(conf)],
                                                  stdout=out, stderr=subprocess.STDOUT, env=env))
            wait_for(lambda: len(_members(kafka_config, group_id)) == 2, "two daemons sharing the partitions", 90)
            keys = [f"acc-{i}" for i in range(18)]
            with CommandClient(kafka_config, agg) as client:
                results = client.send_many([client.command(k, "OpenAccount", {"owner": k}) for k in keys],
                                           timeout=60)
                assert {r.status for r in results.values()} == {"accepted"}

            # The rogue: its client id claims an address whose '#' would turn "<url>/aggregates/..." into a GET of
            # its own choosing, and carries a made-up signature.
            claimed = f"http://127.0.0.1:{rogue_port}/steal#"
            rogue_id = f"kafold@{quote(claimed, safe='')}@k1.{'A' * 43}"
            rogue = Rogue(kafka_config, group_id, commands, rogue_id)
            wait_for(lambda: len(_members(kafka_config, group_id)) == 3, "the rogue holding partitions too", 60)
            members = _members(kafka_config, group_id)
            stolen = members[rogue_id]
            rogue_keys = [k for k in keys if partition_for(k.encode(), 6) in stolen]
            assert rogue_keys, (stolen, members)

            # Reads of the rogue's keys, at either instance, in either mode: 503 naming why; nothing sent to it.
            for url in urls:
                for k in rogue_keys:
                    status, body, headers = call(f"{url}/aggregates/account/{k}")
                    assert status == 503 and "does not verify" in body["message"], (status, body)
                    assert "Retry-After" not in headers and "Location" not in headers
                capsys.readouterr()
                assert cli.main(["state", "get", "-c", str(conf), "account", rogue_keys[0], "--url", url]) == 1
                assert "does not verify" in capsys.readouterr().err

            # Every other key: served by its owner, reached from the other instance with the instance credential.
            owners: dict[str, str] = {}
            for k in (k for k in keys if k not in rogue_keys):
                for i, url in enumerate(urls):
                    status, body, _, visited = read(f"{url}/aggregates/account/{k}", follow=i == 1, tries_503=30)
                    assert status == 200 and body["id"] == k and body["version"] == 1, (url, k, status, body)
                    owners.setdefault(k, body["served_by"])
                    assert body["served_by"] == owners[k]
                    if i == 1 and owners[k] == urls[0]:  # B redirected: to A, with a credential good for that read
                        assert len(visited) == 2 and "kafold_mac=" in visited[1], visited
                        assert call(visited[1], token=None)[0] == 200
            assert set(owners.values()) == set(urls), owners
            a_key = next(k for k, u in owners.items() if u == urls[0])
            b_key = next(k for k, u in owners.items() if u == urls[1])
            # the owner accepts a fellow instance's credential, not a made-up one, and not for anything else
            assert call(f"{urls[1]}/aggregates/account/{b_key}", token=None)[0] == 401
            forged = {trust.AUTH_HEADER: f"t={int(time.time())},mac={'A' * 43}"}
            assert call(f"{urls[1]}/aggregates/account/{b_key}", token=None, headers=forged)[0] == 401
            good = {trust.AUTH_HEADER: trust.read_credential(InstanceKey([SECRET]), "/status")}
            assert call(f"{urls[1]}/status", token=None, headers=good)[0] == 401

            # `kafold state get` at B for A's key: redirected across origins (another port) without the token
            capsys.readouterr()
            assert cli.main(["state", "get", "-c", str(conf), "account", a_key, "--url", urls[1]]) == 0
            out = capsys.readouterr().out
            assert json.loads(out[out.index("{"):])["served_by"] == urls[0]

            assert rogue_seen == [], rogue_seen  # not one request, so not one token
            logs = (tmp_path / "daemon-0.log").read_text() + (tmp_path / "daemon-1.log").read_text()
            assert "aggregate.owner_unverified" in logs and TOKEN not in logs and SECRET not in logs
        finally:
            if rogue is not None:
                rogue.close()
            for proc in procs:
                proc.kill()
                proc.wait()
