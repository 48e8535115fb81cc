"""kafold.daemon_api's flows, driven by hand (no HTTP): what both clients send, and what they make of each answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kafold import daemon_api, tokens
from kafold.daemon_api import ANSWER_MAX_BYTES, Backoff, Endpoint, Hop, NotVisible, Reply, Unreachable
from kafold.errors import KafoldError
from kafold.tokens import BadToken

TOKEN = tokens.encode({("acc.events", 0): 41})


def reply(status: int, body: Any = None, headers: dict[str, str] | None = None, url: str = "") -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Reply(status, raw, headers or {}, url)


def first(flow: daemon_api.Flow[Any]) -> Any:
    done, step = daemon_api.resume(flow, None)
    assert not done
    return step


def test_a_wait_asks_again_on_408_and_after_no_answer_until_covered() -> None:
    flow = Endpoint("http://d:8083/", "secret").wait_flow("accounts", TOKEN, timeout=30)
    hop = first(flow)
    assert isinstance(hop, Hop) and hop.bearer == "secret"
    assert hop.url.startswith("http://d:8083/connectors/accounts/wait?token=kf1.") and "timeout_ms=" in hop.url
    assert isinstance(daemon_api.resume(flow, reply(408, {"covered": False, "behind": []}))[1], Hop)
    assert daemon_api.resume(flow, Unreachable.of(ConnectionRefusedError("refused")))[1] == \
        Backoff(daemon_api.UNREACHABLE_RETRY_S)
    assert isinstance(daemon_api.resume(flow, None)[1], Hop)
    assert daemon_api.resume(flow, reply(200, {"covered": True})) == (True, None)


def test_a_wait_ends_with_not_visible_bad_token_or_the_daemons_error() -> None:
    ended = Endpoint("http://d").wait_flow("accounts", TOKEN, timeout=0)
    first(ended)
    with pytest.raises(NotVisible, match=r"did not cover the token within 0\.0s"):
        daemon_api.resume(ended, reply(408, {"covered": False, "behind": []}))
    refused = Endpoint("http://d").wait_flow("accounts", TOKEN, timeout=5)
    first(refused)
    with pytest.raises(BadToken, match="names a topic"):
        daemon_api.resume(refused, reply(400, {"message": "token: names a topic the connector does not read"}))
    unknown = Endpoint("http://d").wait_flow("nope", TOKEN, timeout=5)
    first(unknown)
    with pytest.raises(KafoldError, match="HTTP 404: unknown connector"):
        daemon_api.resume(unknown, reply(404, {"message": "unknown connector"}))
    with pytest.raises(BadToken):
        first(Endpoint("http://d").wait_flow("accounts", "kf1.forged", timeout=5))


def test_a_state_read_waits_out_a_moving_partition_and_names_a_redirected_failure() -> None:
    flow = Endpoint("http://a:1").state_flow("account", "acc/1", min_version=4, timeout=30)
    hop = first(flow)
    assert hop.url == "http://a:1/aggregates/account/acc%2F1?min_version=4&timeout_ms=30000"
    assert daemon_api.resume(flow, reply(503, {"message": "moving"}, {"Retry-After": "1"}, hop.url))[1] == Backoff(1.0)
    hop = daemon_api.resume(flow, None)[1]
    moved = daemon_api.resume(flow, reply(307, b"", {"Location": "http://b:1/aggregates/account/acc%2F1"}))[1]
    assert moved.url == "http://b:1/aggregates/account/acc%2F1" and moved.bearer is None
    with pytest.raises(KafoldError, match=r"\(redirected to http://b:1/aggregates/account/acc%2F1\): 404 no events"):
        daemon_api.resume(flow, reply(404, {"message": "no events"}, url=moved.url))
    no_wait = Endpoint("http://a:1").state_flow("account", "x")
    first(no_wait)
    with pytest.raises(KafoldError, match="503 down"):
        daemon_api.resume(no_wait, reply(503, {"message": "down"}))  # no Retry-After: asking again will not help


def test_redirects_keep_the_token_on_its_origin_and_stop_at_bad_ones() -> None:
    flow = daemon_api.get("http://a:80/x", "t", 5)
    assert first(flow).bearer == "t"
    same = daemon_api.resume(flow, reply(302, b"", {"Location": "http://a/y"}))[1]
    assert (same.url, same.bearer) == ("http://a/y", "t")  # the default port is the same origin
    other = daemon_api.resume(flow, reply(302, b"", {"Location": "https://a/y"}))[1]
    assert other.bearer is None
    with pytest.raises(KafoldError, match="not an http"):
        daemon_api.resume(flow, reply(307, b"", {"Location": "file:///etc/passwd"}))
    looping = daemon_api.get("http://a/loop", None, 5)
    first(looping)
    with pytest.raises(KafoldError, match="more than 5 redirects"):
        for _ in range(6):
            daemon_api.resume(looping, reply(307, b"", {"Location": "/loop"}))
    big = daemon_api.get("http://a/big", None, 5)
    first(big)
    with pytest.raises(KafoldError, match="larger than"):
        daemon_api.resume(big, Reply(200, b"x" * (ANSWER_MAX_BYTES + 1), {}, "http://a/big"))
