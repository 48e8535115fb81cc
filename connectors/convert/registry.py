"""Schema Registry value formats (Avro, JSON Schema, Protobuf) decoded by confluent-kafka's own deserializers.

A record framed for a Confluent-compatible registry is a magic byte 0, a 4-byte schema id, then the encoded value.
The deserializer fetches the writer's schema by id through `SchemaRegistryClient`, which keeps it in its cache
(`cache_capacity`): each id is fetched once per process, not once per record.

Errors: a registry that cannot be reached or answers 5xx is retried on the one backoff (kafold.retry) for
`retry_within_s` (short: a blip), then the `RetriableError` goes up: the daemon's runner backs off with the
partitions paused (membership kept, a stop served) and decodes the same record again until the registry answers, so
a registry stopped for a while holds the partition back in order and nothing is dead-lettered or skipped.
A registry that refuses kafold's credentials (401, 403) is held back the same way: good records must not be
dead-lettered because a password expired. Anything that is wrong with the record itself (bad magic byte, an id the
registry does not know, bytes that do not match the schema, more items than `max_decoded_items`: connectors/convert/
bounds.py) is a `ConvertError` naming the topic and the schema id: a dead letter, later records flow. An unknown id
is remembered for `unknown_id_ttl_s`, so a flood of records naming it costs one registry request, not one each.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import enum
import io
import struct
import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from confluent_kafka.serialization import MessageField, SerializationContext

from kafold import logs
from kafold.connectors.convert.bounds import AvroWalk, TooMany, excess
from kafold.errors import ConfigError, RetriableError
from kafold.refs import import_ref
from kafold.retry import retrying

try:
    from kafold.connectors.convert.api import ConvertError
except ImportError:  # pragma: no cover - until the converters' api module is in the tree
    from kafold.errors import RecordError

    class ConvertError(RecordError):  # type: ignore[no-redef]
        """A record that its converter cannot turn into an event (reason `convert-failed`)."""

        def __init__(self, message: str, *, raw: Any = None, reason: str = "convert-failed") -> None:
            super().__init__(message, raw=raw, reason=reason)

if TYPE_CHECKING:
    from kafold.config import RegistryConfig

log = logs.get(__name__)

MAGIC = 0
HEADER = struct.Struct(">bI")
NOT_FOUND_CODES = frozenset({40401, 40402, 40403, 40408})  # subject / version / schema not found
AUTH_STATUSES = (401, 403)


class RegistryKind(enum.StrEnum):
    """The value formats a Schema Registry frames."""

    AVRO = "avro"
    JSONSCHEMA = "jsonschema"
    PROTOBUF = "protobuf"


def client_conf(cfg: RegistryConfig) -> dict[str, Any]:
    """The `SchemaRegistryClient` settings of a `[registry]` section (the password read from its reference)."""
    conf: dict[str, Any] = {"url": cfg.url, "timeout": cfg.timeout_s, "cache.capacity": cfg.cache_capacity,
                            # one try per call: the runner's backoff retries, not the client's own loop
                            "max.retries": 0}
    if cfg.username:
        password = cfg.password.reveal() if cfg.password is not None else ""
        conf["basic.auth.user.info"] = f"{cfg.username}:{password}"
    if cfg.ssl_ca_location:
        conf["ssl.ca.location"] = cfg.ssl_ca_location
    return conf


class RegistryFormat:
    """One registry-framed value format: `load` turns the record's bytes into a dict (or list / scalar)."""

    def __init__(self, kind: RegistryKind, registry: RegistryConfig, message_type: str = "") -> None:
        # the registry's serdes: kafold[registry], only for a registry converter
        from confluent_kafka.schema_registry import SchemaRegistryClient

        self.kind = kind
        self.url = registry.url
        self.retry_within_s = registry.retry_within_s
        self.max_items = registry.max_decoded_items
        self.unknown_ttl_s = registry.unknown_id_ttl_s
        self.unknown_max = registry.unknown_id_max
        self._unknown: dict[int, tuple[float, str]] = {}  # schema id -> (forgotten at, monotonic; why), oldest first
        self._auth_failing = False
        self.client = SchemaRegistryClient(client_conf(registry))
        self._value = self._deserializer(message_type)
        self._key: Any = None  # built on the first key that needs one
        self._message_type = message_type
        # Avro schema id -> its parsed writer schema, read straight with fastavro; None: the schema has rules or
        # references, so confluent's deserializer runs (it applies them). The deserializer walks the schema again
        # for every record (~95 µs a record against ~10 µs here, docs/benchmarks.md); a schema without rules
        # decodes the same either way. With it, either way, the schema's item walk (bounds.AvroWalk).
        self._avro: dict[int, tuple[Any, AvroWalk]] = {}

    def _deserializer(self, message_type: str) -> Any:
        # the registry's serdes: kafold[registry], only for a registry converter
        from confluent_kafka.schema_registry.avro import AvroDeserializer
        from confluent_kafka.schema_registry.json_schema import JSONDeserializer
        from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer

        if self.kind is RegistryKind.AVRO:
            return AvroDeserializer(self.client)
        if self.kind is RegistryKind.JSONSCHEMA:
            return JSONDeserializer(None, schema_registry_client=self.client)
        if not message_type:
            raise ConfigError(["connectors.convert.message_type: the protobuf format needs message_type = "
                               "\"module:Class\" (the generated message class the records were written with)"])
        return ProtobufDeserializer(import_ref(message_type), {"use.deprecated.format": False},
                                    schema_registry_client=self.client)

    def load(self, topic: str, data: bytes, *, is_key: bool) -> Any:
        where = f"topic {topic!r} {'key' if is_key else 'value'}"
        if data is None or len(data) < HEADER.size or data[0] != MAGIC:
            first = "no bytes" if not data else f"first byte {data[0]}"
            raise ConvertError(f"{where}: not framed for a schema registry (expected magic byte 0 and a 4-byte "
                               f"schema id, got {first}, {len(data or b'')} bytes)", reason="convert-failed")
        schema_id = HEADER.unpack_from(data)[1]
        self._known_unknown(schema_id, where)
        if is_key:
            if self._key is None:
                self._key = self._deserializer(self._message_type)
            des = self._key
        else:
            des = self._value
        ctx = SerializationContext(topic, MessageField.KEY if is_key else MessageField.VALUE)

        def step() -> Any:
            try:
                if self.kind is RegistryKind.AVRO:
                    if schema_id not in self._avro:
                        self._avro[schema_id] = self._avro_schema(schema_id)
                    parsed, walk = self._avro[schema_id]
                    if walk.needed or len(data) - HEADER.size > self.max_items:
                        walk.check(data[HEADER.size:], self.max_items)
                    if parsed is not None:
                        # fastavro: kafold[registry], only for an avro registry converter
                        from fastavro import schemaless_reader

                        return schemaless_reader(io.BytesIO(data[HEADER.size:]), parsed, None)
                return des(data, ctx)
            except Exception as e:  # sorted below: the deserializers raise many kinds for bad bytes
                raise self._classify(e, where, schema_id) from e

        def warn(e: Exception, delay: float) -> None:
            log.warning("registry.retrying", error=str(e), retry_in_s=delay, topic=topic, schema_id=schema_id)

        # Retried here, blocking the batch (records are decoded before the task's put, outside the runner's put
        # retry): the partition waits in order, nothing is skipped or dead-lettered. Past `retry_within_s`
        # (kept under the consumer's poll interval) the RetriableError goes up to the runner.
        value = retrying(step, within_s=self.retry_within_s, on_retry=warn, first_delay=0.2, max_delay=5.0)
        if self._auth_failing:
            self._auth_failing = False
            log.info("registry.authentication_restored", url=self.url, topic=topic)
        if self.kind is RegistryKind.PROTOBUF:
            # protobuf: kafold[registry], only for a protobuf registry converter
            from google.protobuf.json_format import MessageToDict

            value = MessageToDict(value, preserving_proto_field_name=True)
        elif self.kind is RegistryKind.AVRO:
            value = jsonable(value)
        if len(data) - HEADER.size > self.max_items:  # a shorter record cannot hold more items than bytes
            field = excess(value, self.max_items)
            if field is not None:
                raise ConvertError(f"{where}: schema id {schema_id}: {TooMany(field, self.max_items)}",
                                   reason="too-large")
        return value

    def _known_unknown(self, schema_id: int, where: str) -> None:
        """ConvertError at once for a schema id the registry said it does not know, within unknown_id_ttl_s."""
        known = self._unknown.get(schema_id)
        if known is None:
            return
        if time.monotonic() < known[0]:
            raise ConvertError(f"{where}: {known[1]} (remembered as unknown for {self.unknown_ttl_s:g} s: "
                               "registry.unknown_id_ttl_s)", reason="unknown-schema")
        del self._unknown[schema_id]

    def _remember_unknown(self, schema_id: int, why: str) -> None:
        self._unknown.pop(schema_id, None)
        self._unknown[schema_id] = (time.monotonic() + self.unknown_ttl_s, why)
        while len(self._unknown) > self.unknown_max:
            del self._unknown[next(iter(self._unknown))]

    def _avro_schema(self, schema_id: int) -> tuple[Any, AvroWalk]:
        """The parsed writer schema of `schema_id` (None when it has rules or references: confluent's deserializer
        reads it) and its item walk (over the referenced schemas too)."""
        # fastavro: kafold[registry], only for an avro registry converter
        from fastavro import parse_schema

        schema = self.client.get_schema(schema_id)  # cached by the client: one fetch per id
        raw = orjson.loads(schema.schema_str or "null")
        walk = AvroWalk(raw, tuple(orjson.loads(s) for s in self._referenced(schema, set())))
        if schema.schema_str is None or schema.rule_set is not None or schema.references:
            return None, walk
        return parse_schema(raw), walk

    def _referenced(self, schema: Any, seen: set[tuple[str, int]]) -> list[str]:
        """The texts of the schemas `schema` references, theirs first (once each)."""
        out: list[str] = []
        for ref in schema.references or ():
            key = (ref.subject, ref.version)
            if key in seen:
                continue
            seen.add(key)
            found = self.client.get_version(ref.subject, ref.version).schema  # cached by the client
            out += self._referenced(found, seen)
            if found.schema_str:
                out.append(found.schema_str)
        return out

    def _classify(self, e: Exception, where: str, schema_id: int) -> Exception:
        """RetriableError for a registry that is down or failing; ConvertError for a record that is wrong."""
        # the registry's serdes: kafold[registry], only for a registry converter
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        if isinstance(e, TooMany):
            return ConvertError(f"{where}: schema id {schema_id}: {e}", reason="too-large")
        err = e
        while err is not None and not isinstance(err, SchemaRegistryError) and not _transport(err):
            err = err.__cause__ or err.__context__  # type: ignore[assignment]
        if isinstance(err, SchemaRegistryError):
            status = err.http_status_code
            if status == 404 or err.error_code in NOT_FOUND_CODES:
                why = (f"schema id {schema_id} is unknown to the registry at {self.url} "
                       f"({err.error_code}: {err.error_message})")
                self._remember_unknown(schema_id, why)
                return ConvertError(f"{where}: {why}", reason="unknown-schema")
            if status in AUTH_STATUSES:
                if not self._auth_failing:
                    self._auth_failing = True
                    log.error("registry.authentication_failed", url=self.url, status=status, schema_id=schema_id,
                              hint="check [registry] username / password; the partition waits until it is fixed")
                return RetriableError(f"schema registry {self.url}: authentication failed fetching schema id "
                                      f"{schema_id} (HTTP {status}: {err.error_message})")
            if status >= 500 or status in (408, 429) or status < 0:
                return RetriableError(f"schema registry {self.url} failed fetching schema id {schema_id} "
                                      f"(HTTP {status}: {err.error_message})")
            return ConvertError(f"{where}: schema id {schema_id}: the registry refused it (HTTP {status}, "
                                f"{err.error_code}: {err.error_message})", reason="convert-failed")
        if err is not None:
            return RetriableError(f"schema registry {self.url} unreachable fetching schema id {schema_id}: "
                                  f"{type(err).__name__}: {err}")
        return ConvertError(f"{where}: bytes do not match {self.kind.value} schema id {schema_id}: "
                            f"{type(e).__name__}: {e}", reason="convert-failed")


def jsonable(value: Any) -> Any:
    """Avro's logical types as JSON values, so an Avro payload is stored like its JSON form: timestamps and dates as
    ISO 8601, decimals as strings (exact), uuids as strings, bytes as base64."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    return value


def _transport(e: BaseException) -> bool:
    """A connection-level failure (refused, reset, timed out) from the HTTP client or the OS."""
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return any(c.__name__ in ("TransportError", "ConnectError", "TimeoutException", "NetworkError")
               for c in type(e).__mro__)


def registry_format(kind: str | RegistryKind, registry_config: RegistryConfig | None,
                    message_type: str = "") -> RegistryFormat:
    """The value format `kind` (avro, jsonschema, protobuf) reading through the registry of `registry_config`."""
    if registry_config is None or not registry_config.url:
        raise ConfigError([f"registry.url: converter {str(kind)!r} needs a [registry] section with its url"])
    return RegistryFormat(RegistryKind(kind), registry_config, message_type)
