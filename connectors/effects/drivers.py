"""The three effects behind one interface: webhook (an HTTP POST), kafka (idempotent produce), python (a call)."""

from __future__ import annotations

import asyncio
import email.utils
import inspect
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from kafold import kafka_clients, tracing
from kafold.config import KafkaConfig
from kafold.connectors.effects.policy import EffectError, PermanentEffectError, RetriableEffectError
from kafold.connectors.effects.settings import (
    KafkaEffectConfig,
    PythonEffectConfig,
    WebhookConfig,
)
from kafold.connectors.effects.signing import sign
from kafold.connectors.effects.webhook_client import HttpError, WebhookClient
from kafold.envelope import KAFOLD_NAMESPACE, Event, body_json, encode, uuid5
from kafold.protect import Protector
from kafold.refs import import_ref

RETRY_STATUSES = frozenset({408, 409, 425, 429})


class Effect(ABC):
    """One kind of side effect; `run` raises EffectError (or anything: treated as retriable)."""

    endpoint = ""  # what the effect talks to (the circuit's label): no credentials, no query

    async def start(self) -> None:
        return None

    @abstractmethod
    async def run(self, event: Event) -> None:
        """Perform the effect of `event` once."""

    async def close(self) -> None:
        return None


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def classify(status: int, retry_after_header: str | None) -> EffectError | None:
    """None for 2xx; otherwise the error a response status means (see the README's webhook table)."""
    if 200 <= status < 300:
        return None
    if status in (429, 503):
        return RetriableEffectError(f"HTTP {status}", retry_after_s=retry_after(retry_after_header))
    if status >= 500 or status in RETRY_STATUSES:
        return RetriableEffectError(f"HTTP {status}")
    if 300 <= status < 400:
        return PermanentEffectError(f"HTTP {status}: redirects are not followed; configure the final URL")
    return PermanentEffectError(f"HTTP {status}")


class Webhook(Effect):
    """POST with Standard Webhooks headers; `webhook-id` (the event id) is the receiver's idempotency key."""

    def __init__(self, config: WebhookConfig) -> None:
        self.config = config
        self.secrets = [s.reveal() for s in (config.secret, config.previous_secret) if s is not None]
        self.mapper: Callable[[Event], Any] | None = (
            import_ref(config.body) if config.body not in ("event", "payload") else None)
        self.client: WebhookClient | None = None
        parts = urlsplit(config.url)
        self.endpoint = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"

    async def start(self) -> None:
        self.client = WebhookClient(self.config.url, timeout_s=self.config.timeout_s,
                                    connect_timeout_s=self.config.connect_timeout_s,
                                    headers=[*self.config.headers.items(), ("content-type", "application/json")])

    def body(self, event: Event) -> bytes:
        if self.mapper is not None:
            return orjson.dumps(self.mapper(event))
        if self.config.body == "payload":
            return orjson.dumps(event.payload)
        return body_json(event)

    async def run(self, event: Event) -> None:
        assert self.client is not None, "start() first"
        try:
            body = self.body(event)
        except Exception as e:
            raise PermanentEffectError(f"body mapping failed: {type(e).__name__}: {e}") from e
        ts = int(time.time())
        headers = [("webhook-id", event.event_id), ("webhook-timestamp", str(ts))]
        if self.secrets:
            headers.append(("webhook-signature", sign(event.event_id, ts, body, self.secrets)))
        if tracing.tracer() is not None:  # the executor's effect span is current: the receiver continues the trace
            headers += [(k, v.decode()) for k, v in tracing.inject()]
        try:
            resp = await self.client.post(body, headers)
        except TimeoutError as e:
            raise RetriableEffectError(f"timed out after {self.config.timeout_s}s") from e
        except ValueError as e:  # an event id that cannot be a header: no attempt will ever send it
            raise PermanentEffectError(f"event_id: {e}") from e
        except (OSError, HttpError) as e:
            raise RetriableEffectError(f"{type(e).__name__}: {e}") from e
        error = classify(resp.status, resp.headers.get("retry-after"))
        if error is not None:
            raise error

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def derived_id(connector: str, source_event_id: str, index: int) -> str:
    """uuid5 of (connector, source event, index): the same source event always yields the same derived ids."""
    return uuid5(KAFOLD_NAMESPACE, f"effect/{connector}/{source_event_id}/{index}")


class KafkaEffect(Effect):
    """Produces derived events through an idempotent producer (acks=all); success = acknowledged."""

    def __init__(self, config: KafkaEffectConfig, kafka: KafkaConfig, connector: str,
                 protector: Protector | None = None) -> None:
        self.config = config
        self.connector = connector
        self.endpoint = f"kafka:{config.topic}"
        self.function: Callable[[Event], Any] | None = import_ref(config.function) if config.function else None
        # The events it derives come from events whose protected fields the intake opened: each is sealed again
        # under the rules of its own aggregate and type (kafold.protect) before it is written, as the aggregate
        # runtime seals what `decide` returns. A derived type without rules is written as it is (docs/security.md).
        # `protector`: the task's (TaskConfig.protector).
        self.protector = protector
        self.producer = kafka_clients.producer(kafka, **{"enable.idempotence": True, "acks": "all",
                                                         "linger.ms": 5})
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"kafold-effect-producer-{connector}",
                                        daemon=True)

    async def start(self) -> None:
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.producer.poll(0.05)

    def derive(self, event: Event) -> list[Event]:
        out = self.function(event) if self.function is not None else dict(event.payload)
        items = out if isinstance(out, list) else [] if out is None else [out]
        derived = []
        for i, item in enumerate(items):
            if isinstance(item, Event):
                derived.append(item)
                continue
            if not isinstance(item, dict):
                raise PermanentEffectError(f"function returned {type(item).__name__}, expected dict or Event")
            derived.append(Event.new(self.config.type or event.type, self.config.aggregate_type or
                                     event.aggregate_type, event.aggregate_id, event.version, item,
                                     event_id=derived_id(self.connector, event.event_id, i),
                                     correlation_id=event.correlation_id, causation_id=event.event_id))
        return derived

    async def run(self, event: Event) -> None:
        try:
            derived = self.derive(event)
            if self.protector is not None:  # the subject's key is cached: the intake has just opened the event
                derived = [self.protector.resealed(d) for d in derived]
        except EffectError:
            raise
        except Exception as e:
            raise PermanentEffectError(f"deriving failed: {type(e).__name__}: {e}") from e
        loop = asyncio.get_running_loop()
        futures = []
        for d in derived:
            fut: asyncio.Future[None] = loop.create_future()

            def delivered(err: Any, _msg: Any, fut: asyncio.Future[None] = fut) -> None:
                loop.call_soon_threadsafe(_settle, fut, err)

            key, value, headers = encode(d)
            try:
                self.producer.produce(self.config.topic, value=value, key=key, headers=headers,
                                      on_delivery=delivered)
            except BufferError as e:
                raise RetriableEffectError("producer queue full") from e
            futures.append(fut)
        await asyncio.gather(*futures)

    async def close(self) -> None:
        self._stop.set()
        kafka_clients.close_producer(self.producer, 5)


def _settle(fut: asyncio.Future[None], err: Any) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(RetriableEffectError(f"produce failed: {err}"))


class PythonEffect(Effect):
    """Calls `module:function(event)`: awaited when async, else run in a worker thread."""

    def __init__(self, config: PythonEffectConfig) -> None:
        self.function = import_ref(config.function)
        self.endpoint = f"python:{config.function}"
        self.is_async = inspect.iscoroutinefunction(self.function)

    async def run(self, event: Event) -> None:
        if self.is_async:
            await self.function(event)
        else:
            await asyncio.to_thread(self.function, event)
