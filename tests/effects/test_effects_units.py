"""Pure logic of the effect connectors: signatures, retry policy, response classes, offset tracking, config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kafold.connectors.api import TopicPartition
from kafold.connectors.effects.drivers import classify, derived_id, retry_after
from kafold.connectors.effects.policy import PermanentEffectError, RetriableEffectError, RetryPolicy
from kafold.connectors.effects.settings import PythonEffectConfig, WebhookConfig
from kafold.connectors.effects.signing import sign, verify
from kafold.connectors.effects.tracker import OffsetTracker
from kafold.schema import Problems, is_missing, load


def test_signature_matches_the_standard_webhooks_reference_vector() -> None:
    """The test vector published with the Standard Webhooks libraries."""
    secret, msg_id, ts, body = ("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek",
                                1614265330, b'{"test": 2432232314}')
    assert sign(msg_id, ts, body, [secret]) == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert verify(msg_id, ts, body, sign(msg_id, ts, body, ["old", secret]), secret, now=ts)


def test_verification_rejects_tampering_wrong_secret_and_stale_timestamps() -> None:
    header = sign("id1", 1000, b"{}", ["s1"])
    assert not verify("id1", 1000, b"{ }", header, "s1", now=1000)
    assert not verify("id2", 1000, b"{}", header, "s1", now=1000)
    assert not verify("id1", 1000, b"{}", header, "s2", now=1000)
    assert not verify("id1", 1000, b"{}", header, "s1", now=1000 + 301)


def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    policy, rng = RetryPolicy(10, 3600, 0.5, 8.0), random.Random(1)
    for attempt, cap in ((1, 0.5), (2, 1.0), (3, 2.0), (5, 8.0), (9, 8.0)):
        waits = [policy.delay(attempt, rng) for _ in range(200)]
        assert min(waits) >= 0 and max(waits) <= cap and max(waits) > cap / 2


def test_policy_parks_on_permanent_errors_exhausted_attempts_or_age() -> None:
    policy, rng = RetryPolicy(3, 10.0, 0.1, 1.0), random.Random(1)
    assert policy.next_delay(1, 0.0, PermanentEffectError("404"), rng) is None
    assert policy.next_delay(2, 0.0, RetriableEffectError("503"), rng) is not None
    assert policy.next_delay(3, 0.0, RetriableEffectError("503"), rng) is None
    assert policy.next_delay(1, 0.0, RetriableEffectError("429", retry_after_s=4.0), rng) == 4.0
    assert policy.next_delay(1, 8.0, RetriableEffectError("429", retry_after_s=4.0), rng) is None  # too old
    assert policy.next_delay(1, 0.0, ValueError("a user function bug"), rng) is not None  # unknown: retriable


def test_without_max_attempts_transient_failures_retry_until_max_age() -> None:
    policy, rng = RetryPolicy(0, 86400.0, 0.2, 60.0), random.Random(1)
    assert policy.next_delay(10_000, 3600.0, RetriableEffectError("connection refused"), rng) is not None
    assert policy.next_delay(10_000, 86399.0, RetriableEffectError("503", retry_after_s=5.0), rng) is None
    assert policy.next_delay(1, 0.0, PermanentEffectError("400"), rng) is None


@pytest.mark.parametrize(("status", "retriable"), [
    (500, True), (502, True), (503, True), (504, True), (408, True), (409, True), (425, True), (429, True),
    (400, False), (401, False), (403, False), (404, False), (410, False), (422, False), (301, False)])
def test_http_statuses_map_to_retriable_or_permanent(status: int, retriable: bool) -> None:
    error = classify(status, None)
    assert error is not None and error.retriable is retriable
    assert classify(200, None) is None and classify(204, None) is None


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after("7") == 7.0
    assert retry_after(None) is None and retry_after("soon") is None
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: retry now
    assert classify(503, "3").retry_after_s == 3.0  # type: ignore[union-attr]


def test_commit_offset_stops_at_the_first_incomplete_event() -> None:
    t, tp = OffsetTracker(), TopicPartition("t", 0)
    for off in (10, 11, 12, 14):  # 13 was dead-lettered by the runner: never tracked
        t.add(tp, off)
    assert t.committable({tp: 15}) == {tp: 10}
    assert not t.done(tp, 11) and t.committable({tp: 15}) == {tp: 10}  # 10 still in flight
    assert t.done(tp, 10) and t.committable({tp: 15}) == {tp: 12}
    t.done(tp, 14)
    assert t.committable({tp: 15}) == {tp: 12} and t.in_flight == 1
    t.done(tp, 12)
    assert t.committable({tp: 15}) == {tp: 15} and t.in_flight == 0
    t.add(tp, 15)
    t.drop(tp)
    assert t.committable({tp: 16}) == {tp: 16} and t.in_flight == 0


def test_derived_ids_are_deterministic_per_connector_source_and_index() -> None:
    assert derived_id("c", "e1", 0) == derived_id("c", "e1", 0)
    assert len({derived_id("c", "e1", 0), derived_id("c", "e1", 1), derived_id("d", "e1", 0),
                derived_id("c", "e2", 0)}) == 4


def _load(cls: type, raw: dict[str, object], env: dict[str, str] | None = None) -> tuple[object, list[str]]:
    problems = Problems("kafold.toml", env or {})
    return load(cls, raw, "connectors[0].config", problems, Path(".")), problems.items


def test_webhook_config_requires_https_unless_allowed_and_secret_references() -> None:
    _, errors = _load(WebhookConfig, {"url": "http://example.com/hook"})
    assert any("connectors[0].config" in e and "allow_http" in e for e in errors)
    _, errors = _load(WebhookConfig, {"url": "https://example.com/hook", "secret": "literal"})
    assert any("connectors[0].config.secret" in e and "literal secrets are refused" in e for e in errors)
    _, errors = _load(WebhookConfig, {"url": "https://example.com/hook", "headers": {"webhook-id": "x"}})
    assert any("headers" in e for e in errors)
    cfg, errors = _load(WebhookConfig, {"url": "https://example.com/hook", "secret_env": "HOOK_SECRET",
                                        "delivery": "at-most-once"}, {"HOOK_SECRET": "s3cr3t-value"})
    assert errors == [] and not is_missing(cfg) and "s3cr3t-value" not in repr(cfg)


def test_python_and_delivery_settings_are_validated_by_name() -> None:
    _, errors = _load(PythonEffectConfig, {"function": "no_colon", "delivery": "exactly-once", "max_attempts": -1})
    assert any("function" in e for e in errors)
    assert any("config.delivery" in e for e in errors) and any("config.max_attempts" in e for e in errors)
