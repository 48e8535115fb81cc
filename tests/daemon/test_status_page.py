"""The status page (/ui) of a daemon running the bank example with traffic, seen in a real browser (headless
Chromium): behind the API token as HTTP Basic's password, it shows the connectors, the `account` aggregate and a
dead letter's coordinates and reason, never a payload or the token."""

from __future__ import annotations

import base64
import logging
import re
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from kafold import config, kafka_clients, logs, topics
from kafold.client import CommandClient, DaemonClient
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import accounts_projection_toml, bank_daemon_toml
from tests.daemon.daemon_support import daemon_in_process
from tests.support import browser, wait_for

PERSONAL = "Jane Q. Example, 1 High Street"  # in a malformed record's bytes: must not reach the page
WIDTH, HEIGHT = 1280, 1100


def basic(token: str) -> str:
    return "Basic " + base64.b64encode(f"kafold:{token}".encode()).decode()


def fetch(url: str, authorization: str | None, method: str = "GET") -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if authorization:
        req.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_status_page_in_a_browser(tmp_path: Path, kafka_config: KafkaConfig, pg_url: str, unique: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands flow through the bank aggregate into a projection and a log connector, a malformed record is
    dead-lettered; Chromium, given the token as Basic's password, renders a page naming both connectors RUNNING,
    the `account` aggregate LIVE and the dead letter's reason, without its bytes or the token."""
    browser.chromium()  # skips first, before a daemon starts, where there is no browser
    token = f"tok-{unique}-secret"
    monkeypatch.setenv("KAFOLD_TEST_API_TOKEN", token)
    port, table, other = free_port(), f"sp_{uuid.uuid4().hex[:12]}", f"{unique}.other"
    path = tmp_path / "kafold.toml"
    projection = accounts_projection_toml("accounts", f"{unique}.events", table).replace(
        f'topics = ["{unique}.events"]', f'topics = ["{unique}.events", "{other}"]')
    path.write_text(f"""
{bank_daemon_toml(kafka_config, unique, port, partitions=2, daemon_extra='api_token_env = "KAFOLD_TEST_API_TOKEN"')}
[postgres]
url = "{pg_url}"

[[topics]]
name = "{other}"

{projection}

[[connectors]]
name = "audit-log"
class = "log"
topics = ["{unique}.events"]
""")
    loaded = config.load_file(path)
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    log_file = tmp_path / "daemon.log"
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    logs.configure("debug", "json", str(log_file))
    root.setLevel(logging.DEBUG)  # every logger's every line is searched for the token below
    page_url = f"http://127.0.0.1:{port}/ui"
    try:
        with daemon_in_process(path, token=token) as d:
            wait_for(lambda: d.get("/ready")[0] == 200, "the daemon ready", 90)
            client = CommandClient(kafka_config, loaded.config.aggregates[0],
                                   DaemonClient(f"http://127.0.0.1:{port}", token))
            for n in range(6):
                opened = client.send(client.command(f"acct-{n}", "OpenAccount", {"owner": f"owner {n}"}), timeout=60)
                assert opened is not None and opened.accepted
                deposit = client.send(client.command(f"acct-{n}", "Deposit", {"amount": 10 + n}), timeout=60)
                assert deposit is not None and deposit.accepted
            client.wait_visible(deposit, "accounts", timeout=30)
            producer = kafka_clients.producer(kafka_config)
            producer.produce(other, key=b"acct-x", value=f'{{"owner": "{PERSONAL}", '.encode())  # truncated JSON
            assert producer.flush(10) == 0
            wait_for(lambda: (d.get("/status")[1].get("dead_letters") or {}).get("open", {}).get("accounts") == 1,
                     "the malformed record dead-lettered", 30)
            # rates need two of the daemon's samples (daemon/rates.py: every 5 s)
            wait_for(lambda: "accounts" in d.get("/status")[1]["rates"]["connectors"], "a records/s rate", 30)
            rates = d.get("/status")[1]["rates"]
            assert rates["connectors"]["accounts"] >= 0 and "account" in rates["aggregates"], rates

            # the token guard: the page takes the token as Basic's password, the rest of the API does not
            assert fetch(page_url, None)[0] == 401
            assert fetch(page_url, None)[2]["WWW-Authenticate"].startswith("Basic ")
            assert fetch(page_url, basic("wrong"))[0] == 401
            assert fetch(f"http://127.0.0.1:{port}/status", basic(token))[0] == 401
            assert fetch(f"http://127.0.0.1:{port}/reload", basic(token), "POST")[0] == 401  # no CSRF door
            status, body, headers = fetch(page_url, basic(token))
            assert status == 200 and headers["Content-Type"].startswith("text/html")
            assert "default-src 'none'" in headers["Content-Security-Policy"]

            # the browser: the token as the URL's password, the way a person's browser sends it after the prompt
            authed = f"http://kafold:{token}@127.0.0.1:{port}/ui"
            dom = browser.dump_dom(authed, tmp_path)
            shot = tmp_path / "status.png"
            browser.screenshot(authed, tmp_path, shot, WIDTH, HEIGHT)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)

    text = " ".join(dom.split())
    assert "<h1>kafold status</h1>" in text
    for name in ("accounts", "audit-log"):
        assert f'<td>{name}</td><td><span class="ok">RUNNING</span></td>' in text, f"{name} not shown RUNNING"
    assert text.count('<td>account</td><td class="n">') == 2  # one row per partition of the aggregate
    assert re.search(r'<td>accounts</td><td><span class="ok">RUNNING</span></td><td class="n">\d+</td>'
                     r'<td class="n rate">\d+\.\d</td>', text), "the projection's records/s"
    assert '<td class="n rate">…</td>' not in text  # every connector and aggregate has its rate by now
    assert text.count('<span class="ok">LIVE</span>') == 2
    assert "<td>bad-json</td>" in text and f"<td>{other}</td>" in text  # the dead letter's reason and topic
    assert "Jane" not in dom and PERSONAL not in body
    assert token not in dom and token not in body
    logged = log_file.read_text()
    assert "runner.batch" in logged  # the daemon logged there (debug and up, every logger)
    assert token not in logged

    data = shot.read_bytes()
    width, height, pixels = browser.png_pixels(data)
    assert (width, height) == (WIDTH, HEIGHT)
    drawn, colours = browser.ink(pixels)
    assert drawn > 0.02 and colours > 50, f"the screenshot looks blank: {drawn:.1%} drawn, {colours} colours"
