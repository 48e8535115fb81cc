"""The effect connectors' settings, declared once: common delivery/retry keys plus one table per effect type."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from kafold.connectors.effects.webhook_client import header_safe
from kafold.schema import Secret, setting

AT_LEAST_ONCE = "at-least-once"
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 5.1: a header name
AT_MOST_ONCE = "at-most-once"


@dataclass(frozen=True, kw_only=True)
class EffectConfig:
    """Keys every effect connector has: delivery mode, retry policy and flow control."""

    delivery: str = setting(AT_LEAST_ONCE, doc="`at-least-once`: commit after the effect; `at-most-once`: commit "
                            "before it (a crash loses the in-flight effects, never repeats one).",
                            choices=(AT_LEAST_ONCE, AT_MOST_ONCE))
    max_attempts: int = setting(0, doc="Attempts per event before it is parked; 0 = no limit (transient failures "
                                "are retried until max_age_s).", minimum=0)
    max_age_s: float = setting(86400.0, doc="Park an event once retrying it would pass this age (seconds since its "
                               "first attempt); waiting on an open circuit counts.", minimum=0)
    backoff_initial_s: float = setting(0.2, doc="First retry delay cap; doubles per attempt (full jitter).",
                                       minimum=0)
    backoff_max_s: float = setting(60.0, doc="Largest retry delay (a Retry-After is honoured up to max_age_s).",
                                   minimum=0)
    circuit_failure_ratio: float = setting(0.5, doc="Open the endpoint's circuit when at least this share of the "
                                           "last circuit_window requests failed transiently (0 = never).",
                                           minimum=0)
    circuit_window: int = setting(20, doc="Requests the circuit looks back on.", minimum=1)
    probe_max_s: float = setting(10.0, doc="Longest wait between probes of an open circuit (from "
                                 "backoff_initial_s, doubling; a Retry-After can make it longer).", minimum=0.01)
    parked_retry_every_s: float = setting(0.0, doc="Re-release every parked key on this schedule, in order "
                                          "(0 = only on `kafold effects parked retry`).", minimum=0)
    concurrency: int = setting(64, doc="Effects running at once (across keys; one at a time per key).", minimum=1)
    max_in_flight: int = setting(20000, doc="Events handed over but not yet completed before fetching pauses.",
                                 minimum=1)
    ledger_flush_ms: int = setting(200, doc="Accepted and ignored: ledger rows are written as soon as the "
                                   "ledger's writer is free, with whatever queued meanwhile (natural batching).",
                                   minimum=1)
    request_poll_s: float = setting(1.0, doc="How often the task looks for `parked retry|skip` requests.",
                                    minimum=0.05)

    def __post_init__(self) -> None:
        if self.circuit_failure_ratio > 1:
            raise ValueError(f"circuit_failure_ratio: expected a share between 0 and 1, got "
                             f"{self.circuit_failure_ratio}")


@dataclass(frozen=True, kw_only=True)
class WebhookConfig(EffectConfig):
    url: str = setting(doc="Where events are POSTed; https unless allow_http = true.")
    allow_http: bool = setting(False, doc="Allow a plain http:// URL (local receivers, tests).")
    secret: Secret | None = setting(doc="Standard Webhooks signing secret (`whsec_<base64>` or raw text).",
                                    secret=True)
    previous_secret: Secret | None = setting(
        doc="A second signing secret during rotation: requests carry both signatures.", secret=True)
    timeout_s: float = setting(10.0, doc="Whole-request timeout; a timeout is retried.", minimum=0.01)
    connect_timeout_s: float = setting(5.0, doc="TCP/TLS connect timeout.", minimum=0.01)
    body: str = setting("event", doc="Request body: `event` (the envelope), `payload`, or `module:function(event) "
                        "-> dict`.")
    headers: dict[str, str] = setting(factory=dict, doc="Extra static request headers (no secrets here).")

    def __post_init__(self) -> None:
        super().__post_init__()
        parts = urlsplit(self.url)
        # Error messages show the URL without its query and credentials: they may hold a token.
        shown = f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"
        if parts.scheme not in ("https", "http") or not parts.netloc:
            raise ValueError(f"url: expected an https:// URL, got {shown!r}")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"url: credentials in the URL ({shown!r}) would be logged and stored in plain text; "
                             "sign requests with `secret` or send a header")
        if parts.scheme == "http" and not self.allow_http:
            raise ValueError(f"url: {shown!r} is plain http; use https or set allow_http = true")
        if self.body not in ("event", "payload") and ":" not in self.body:
            raise ValueError(f"body: expected `event`, `payload` or `module:function`, got {self.body!r}")
        for name, value in self.headers.items():
            if name.lower().startswith("webhook-") or name.lower() in ("content-type", "content-length", "host"):
                raise ValueError(f"headers: {name!r} is set by kafold")
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"headers: {name!r} is not a valid HTTP header name")
            header_safe(value, f"headers: the value of {name!r}")


@dataclass(frozen=True, kw_only=True)
class KafkaEffectConfig(EffectConfig):
    topic: str = setting(doc="Topic the derived event or command is produced to.")
    type: str = setting("", doc="Type of the derived event; empty = the source event's type.")
    aggregate_type: str = setting("", doc="Aggregate type of the derived event; empty = the source's. Its "
                                  "protected fields are sealed under that aggregate's and type's `protect` rules "
                                  "(none: written as derived; docs/security.md#where-personal-data-may-stay).")
    function: str = setting("", doc="Optional `module:function(event)` returning the derived payload (a dict), "
                            "an Event, a list of them, or None for nothing.")


@dataclass(frozen=True, kw_only=True)
class PythonEffectConfig(EffectConfig):
    function: str = setting(doc="`module:function(event)`, sync (run in a thread) or async; raise "
                            "PermanentEffectError to park at once, anything else is retried.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if ":" not in self.function:
            raise ValueError(f"function: expected `module:function`, got {self.function!r}")
