"""The status page's rendering (daemon/status_page.py), its HTTP Basic check (daemon/http.py), and the dead-letter
section when PostgreSQL is away (daemon/status.py). Pure but for one refused connection on loopback."""

from __future__ import annotations

import base64
import hashlib
import re
import time
from typing import Any

import pytest
from structlog.testing import capture_logs

from kafold.config import PostgresConfig
from kafold.daemon import status
from kafold.daemon.http import basic_authorized
from kafold.daemon.status_page import HEADERS, render

HOSTILE = '<script>alert(1)</script>"\'&<img src=x onerror=alert(2)>'
EMPTY: dict[str, Any] = {"source": "daemon", "worker_id": "w-1", "partitions": [], "effects": [], "aggregates": [],
                         "accounting": []}


def report(**over: Any) -> dict[str, Any]:
    return {**EMPTY, **over}


def markup(page: str) -> str:
    """The page without its text: the tags and attributes a browser would act on."""
    return re.sub(r">[^<]*<", "><", page)


def test_every_value_from_outside_is_escaped() -> None:
    """A hostile connector id, topic, task state, aggregate id, endpoint, dead-letter reason and worker id show as
    text: no tag or attribute of theirs reaches the markup."""
    page = render(report(
        worker_id=HOSTILE,
        partitions=[{"connector": HOSTILE, "task": 0, "state": HOSTILE, "topic": HOSTILE, "partition": 0,
                     "committed": 1, "end_offset": 2, "lag": 1, "lag_seconds": 0.5, "caught_up": False}],
        accounting=[{"connector": HOSTILE, "task": 0, "topic": HOSTILE, "partition": 0, "seen": 3}],
        effects=[{"connector": HOSTILE, "task": 0, "endpoint": HOSTILE, "circuit": HOSTILE, "parked_keys": 2}],
        aggregates=[{"aggregate": HOSTILE, "partition": 0, "phase": HOSTILE, "position": 5, "captured_end": 5,
                     "snapshot_version": HOSTILE, "start": HOSTILE, "events_replayed": 1}],
        dead_letters={"open": {HOSTILE: 1}, "newest": [
            {"id": 7, "connector": HOSTILE, "topic": HOSTILE, "partition": 0, "offset": 9, "reason": HOSTILE,
             "status": HOSTILE, "created_at": HOSTILE}]}))
    assert "<script" not in page and "<img" not in page and "onerror=alert" not in markup(page)
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#x27;&amp;&lt;img src=x onerror=alert(2)&gt;"
    assert page.count(escaped) >= 15  # each value above, in its cell (and the title and heading)
    assert set(re.findall(r"<(\w+)", page)) <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3",
                                                "p", "code", "table", "tr", "th", "td", "span"}


def test_escaped_values_in_attributes_too() -> None:
    """A quote in a value cannot end an attribute: every attribute value in the page is one of the page's own."""
    page = render(report(partitions=[{"connector": 'x" class="evil', "task": 0, "state": 'RUNNING" x="',
                                      "topic": "t", "partition": 0}]))
    attributes = set(re.findall(r'\s(\w[\w-]*)="([^"]*)"', markup(page)))
    assert attributes <= {("lang", "en"), ("charset", "utf-8"), ("http-equiv", "refresh"), ("content", "10"),
                          ("name", "viewport"), ("content", "width=device-width, initial-scale=1"),
                          ("class", "n"), ("class", "ok"), ("class", "warn"), ("class", "bad"),
                          ("class", "empty"), ("class", "meta"), ("class", "n rate")}


def test_empty_states_say_so() -> None:
    """A daemon with nothing running shows each section's empty state; without PostgreSQL, where dead letters are."""
    page = render(report())
    for said in ("no connector runs in this daemon", "no records seen yet", "no effect connector",
                 "no aggregate runs in this daemon", "no connector of this daemon uses PostgreSQL"):
        assert said in page
    assert "<table>" not in page
    assert "no open dead letters" in render(report(dead_letters={"open": {}, "newest": []}))
    assert "PostgreSQL could not be read (OperationalError)" in render(report(dead_letters={
        "error": "OperationalError"}))


def test_states_and_snapshots_shown() -> None:
    """A connector's summary adds its partitions' lag; an aggregate shows its phase and the snapshot it restored."""
    rows = [{"connector": "accounts", "task": 0, "state": "RUNNING", "topic": "e", "partition": p, "lag": 3,
             "lag_seconds": 1.5 * p} for p in (0, 1)]
    page = render(report(partitions=rows, aggregates=[
        {"aggregate": "account", "partition": 0, "phase": "LIVE", "snapshot_version": 120, "start": 121},
        {"aggregate": "account", "partition": 1, "phase": "RECOVERING", "snapshot_version": None}],
        rates={"window_s": 60.0, "connectors": {"accounts": 42.5}, "aggregates": {"account": 7.0}}))
    assert '<td>accounts</td><td><span class="ok">RUNNING</span></td><td class="n">2</td><td class="n rate">42.5</td>' \
           '<td class="n">6</td><td class="n">1.5</td>' in page
    assert '<td>account</td><td class="n rate">7.0</td>' in page
    # before the daemon's second sample there is no rate yet: shown as such, not as zero
    assert '<td>accounts</td><td><span class="ok">RUNNING</span></td><td class="n">2</td><td class="n rate">…</td>' \
        in render(report(partitions=rows))
    assert '<span class="ok">LIVE</span>' in page and '<span class="warn">RECOVERING</span>' in page
    assert "covers events up to offset 120, tail from 121" in page and "none (full replay)" in page


def test_fold_error_text_not_shown() -> None:
    """A fold error may quote an event's data: the page says there is one, not what it says."""
    page = render(report(aggregates=[{"aggregate": "account", "partition": 0, "phase": "STOPPED",
                                      "fold_error": "KeyError: 'Jane Doe, 1 High Street'"}]))
    assert "Jane" not in page and "fold error (text in <code>kafold status</code>)" in page


def test_headers_allow_only_the_pages_own_style() -> None:
    """The CSP allows no script, and a style only when it hashes like the one the page carries; nothing is cached."""
    styles = re.findall(r"<style>(.*?)</style>", render(report()), re.S)
    assert len(styles) == 1
    digest = base64.b64encode(hashlib.sha256(styles[0].encode()).digest()).decode()
    policy = HEADERS["Content-Security-Policy"]
    assert policy.startswith("default-src 'none';") and f"style-src 'sha256-{digest}';" in policy
    assert "script-src" not in policy and "unsafe" not in policy
    assert HEADERS["Cache-Control"] == "no-store"


def basic(user_pass: bytes) -> str:
    return "Basic " + base64.b64encode(user_pass).decode()


@pytest.mark.parametrize(("header", "ok"), [
    (basic(b"kafold:s3cret"), True),
    (basic(b":s3cret"), True),  # any user name: the token is the credential
    ("basic " + base64.b64encode(b"x:s3cret").decode(), True),
    (basic(b"kafold:s3cret2"), False),
    (basic(b"kafold:s3cre"), False),
    (basic(b"s3cret"), False),  # no colon: a user name, no password
    ("Bearer s3cret", False),
    ("Basic !!!not-base64", False),
    ("Basic " + "\udcff", False),  # undecodable bytes as aiohttp hands them over
    ("Basic", False),
    ("", False),
])
def test_basic_authorized(header: str, ok: bool) -> None:
    """The token as HTTP Basic's password, and nothing else, passes; a malformed header is refused, not raised."""
    assert basic_authorized("s3cret", header) is ok


def test_basic_never_passes_without_a_token() -> None:
    """With no token configured every request passes the bearer check already: Basic adds nothing."""
    assert basic_authorized(None, basic(b"kafold:")) is False


def test_dead_letters_unreadable_say_so_without_the_message() -> None:
    """PostgreSQL away: the section names the error's class (its message may name hosts), logged under a dotted
    event, within the short timeout instead of holding /status up."""
    pgc = PostgresConfig(url="postgresql://kafold@127.0.0.1:1/kafold")  # nothing listens on port 1
    started = time.monotonic()
    with capture_logs() as logged:
        got = status.dead_letters(pgc)
    assert got == {"error": "RetriableError"}
    assert time.monotonic() - started < status.PG_TIMEOUT_S + 2
    assert [e["event"] for e in logged] == ["status.dead_letters_unavailable"]
