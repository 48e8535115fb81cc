"""The daemon's web server with an API token, on a real broker: every route it serves (kafold's views, Faust's own,
whatever a Faust upgrade adds) is in the documented open set or answers 401 without the token; a malformed
Authorization header is refused, never a 500, and no header value reaches the log."""

from __future__ import annotations

import http.client
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from faust.web.drivers.aiohttp import Web as AiohttpWeb

from kafold import logs
from kafold.config import KafkaConfig
from kafold.daemon import connect_api
from kafold.daemon import http as daemon_http
from kafold.testing import free_port
from tests.daemon.daemon_support import Running, daemon_in_process, write_config
from tests.support import ROOT, create_topic


@pytest.fixture
def guarded(request: pytest.FixtureRequest, tmp_path: Path, kafka_config: KafkaConfig, unique: str,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Running, Path]]:
    """A daemon with an API token whose whole log output (every logger, debug up) goes to the returned file, in the
    log format of the test's parameter (JSON unless it says console)."""
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    token = f"tok-{unique}"
    monkeypatch.setenv("KAFOLD_TEST_API_TOKEN", token)
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port(),
                        daemon_extra='api_token_env = "KAFOLD_TEST_API_TOKEN"')
    log_file = tmp_path / "daemon.log"
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    logs.configure("debug", getattr(request, "param", "json"), str(log_file))
    root.setLevel(logging.DEBUG)  # configure keeps third-party loggers at warning and up; here all of it is read
    try:
        with daemon_in_process(path, token=token) as d:
            yield d, log_file
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _served(d: Running) -> list[tuple[str, str, str]]:
    """(method, canonical route, a concrete path) for every route of the running daemon's aiohttp router."""
    assert d.host.worker is not None
    web = d.host.worker.app.web
    assert isinstance(web, AiohttpWeb)
    router = web.web_app.router
    out = []
    for route in router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        if "path" in info:
            concrete = info["path"]
        elif "formatter" in info:
            concrete = re.sub(r"\{[^}]*\}", "x", info["formatter"])
        else:  # static files and the like: anything under the prefix
            concrete = info.get("prefix", "/") + "/x"
        method = "GET" if route.method == "*" else route.method
        out.append((method, route.resource.canonical if route.resource is not None else concrete, concrete))
    return out


def _call(port: int, method: str, path: str, token: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path, body=b"" if method in ("POST", "PUT", "PATCH") else None,
                     headers={"Authorization": f"Bearer {token}"} if token else {})
        return conn.getresponse().status
    finally:
        conn.close()


def test_every_route_the_daemon_serves_is_documented_open_or_needs_the_token(
        guarded: tuple[Running, Path]) -> None:
    d, _ = guarded
    served = _served(d)
    canonicals = {canonical for _, canonical, _ in served}
    assert {*daemon_http.ROUTES, *connect_api.ROUTES} <= canonicals, canonicals  # the enumeration sees the router
    assert canonicals >= daemon_http.OPEN_PATHS
    doors = []
    for method, canonical, concrete in served:
        status = _call(d.port, method, concrete)
        if canonical in daemon_http.OPEN_PATHS:
            assert method != "GET" or status in (200, 503), (method, concrete, status)
        elif status != 401:
            doors.append((method, concrete, status))
    assert doors == [], f"served without the token: {doors}"
    assert _call(d.port, "GET", "/router/") == _call(d.port, "GET", "/no/such/route") == 401
    assert _call(d.port, "GET", "/metrics", d.token) == 200
    for path in daemon_http.OPEN_PATHS:  # the documented open set is the constant's
        assert f"`{path}`" in (ROOT / "docs" / "security.md").read_text()


def _raw(port: int, head: bytes) -> int:
    """Send `head` as the whole request over a plain socket; the status code of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(head)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize("guarded", ["json", "console"], indirect=True)
def test_a_malformed_authorization_header_is_refused_and_no_header_value_is_logged(
        guarded: tuple[Running, Path]) -> None:
    d, log_file = guarded
    assert d.token is not None
    token = d.token.encode()

    def request(path: bytes, *headers: bytes) -> int:
        return _raw(d.port, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                    + b"".join(h + b"\r\n" for h in headers) + b"\r\n")

    # Reaching kafold: undecodable bytes, a non-UTF-8 scheme, the token with trailing garbage: 401, never 500.
    for value in (b"Bearer " + token + b"\xff", b"Bearer \xff" + token, b"\xff\xfe " + token,
                  b"Bearer " + token + b"\xed\xa0\x80", b"Bearer " + token + b" \xc3\x28"):
        assert request(b"/metrics", b"Authorization: " + value) == 401, value
        assert request(b"/connectors", b"Authorization: " + value) == 401, value
    assert request(b"/health", b"Authorization: Bearer " + token + b"\xff") == 200
    # Refused by aiohttp's parser (control characters): 400 or 401, but nothing logged may quote them.
    for header in (b"Authorization: Bearer " + token + b"\x00", b"Authorization: Bearer " + token + b"\x01",
                   b"X-Api-Key: " + token + b"\x00", b"X-Note\x00" + token + b": 1"):
        assert request(b"/metrics", header) in (400, 401), header
    assert request(b"/metrics", b"Authorization: Bearer " + token) == 200
    text = log_file.read_text(encoding="utf-8", errors="replace")
    assert "aiohttp.server" in text and "Withheld" in text, "the capture holds aiohttp's log of the parser errors"
    assert d.token not in text
    assert "Bearer" not in text and "X-Api-Key" not in text and "X-Note" not in text
