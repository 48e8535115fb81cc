"""Property-based hostile input: the envelope decoder and the config loader fail only with their own errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafold import config
from kafold.envelope import ROUTING_HEADERS, Event, decode, encode
from kafold.errors import ConfigError, DecodeError

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
header_names = st.sampled_from([*ROUTING_HEADERS, "other", "kafold-x"])
headers = st.lists(st.tuples(header_names, st.none() | st.binary(max_size=40)), max_size=6)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.none() | st.binary(max_size=30), value=st.none() | st.binary(max_size=300), hdrs=headers)
def test_random_bytes_yield_an_event_or_a_decode_error(key: bytes | None, value: bytes | None,
                                                       hdrs: list[tuple[str, bytes | None]]) -> None:
    """Arbitrary key, value and headers never crash the decoder with anything but DecodeError."""
    try:
        decode(key, value, hdrs, raw="raw-marker")
    except DecodeError as e:
        assert e.raw == "raw-marker"  # carried for dead-lettering
        assert str(e).startswith("invalid kafold envelope: ")


VALID = Event.new("AccountOpened", "account", "acc-1", 1, {"owner": "ann"})


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["event_id", "type", "aggregate_type", "aggregate_id", "version", "occurred_at",
                              "correlation_id", "payload", "schema_version", "causation_id", "extra"]),
       replacement=json_values)
def test_one_forged_field_is_rejected_or_consistent(field: str, replacement: Any) -> None:
    """A valid envelope with one field replaced by any JSON value decodes to that value or is refused."""
    key, value, hdrs = encode(VALID)
    body = orjson.loads(value)
    body[field] = replacement
    try:
        data = json.dumps(body).encode()
    except ValueError:
        return
    try:
        event = decode(key, data, hdrs)
    except DecodeError:
        return
    assert getattr(event, field) == replacement  # accepted only if it kept the envelope consistent


def test_deeply_nested_and_huge_payloads_are_refused() -> None:
    key, _, hdrs = encode(VALID)
    body = orjson.loads(encode(VALID)[1])
    nested: Any = 1
    for _ in range(200):
        nested = [nested]
    body["payload"] = {"x": nested}
    for data in (orjson.dumps(body), b'{"payload": "' + b"x" * 2_000_000 + b'"}'):
        try:
            decode(key, data, hdrs)
        except DecodeError as e:
            assert e.reason in ("too-deep", "too-large")
        else:
            raise AssertionError("accepted a hostile payload")


# ---- config loader ---------------------------------------------------------------------------------------
def _toml(value: Any) -> str:
    """A TOML inline value (JSON string escapes are valid TOML basic-string escapes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value) if not (isinstance(value, float) and math.isinf(value)) else "inf"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"


keys = st.sampled_from(["bootstrap_servers", "url", "name", "class", "topics", "partitions", "password",
                        "password_env", "sasl_password_file", "http_port", "config", "evolve", "x"]) | st.text(
    min_size=1, max_size=8)
toml_scalars = st.booleans() | st.integers(-5, 70000) | st.text(max_size=12)
toml_values = st.recursive(toml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(keys, inner, max_size=4), max_leaves=12)
sections = st.dictionaries(
    st.sampled_from(["kafka", "postgres", "daemon", "snapshots", "aggregates", "connectors", "topics", "kafak"]),
    toml_values | st.lists(st.dictionaries(keys, toml_values, max_size=5), max_size=2), max_size=5)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(doc=sections)
def test_any_config_loads_or_fails_with_config_error(doc: dict[str, Any], tmp_path_factory: Any) -> None:
    """Any TOML document loads or raises ConfigError whose every line names the file."""
    path = Path(tmp_path_factory.mktemp("cfg")) / "kafold.toml"
    text = "\n".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in doc.items())
    try:
        config.parse(text, path, {})
    except ConfigError as e:
        assert e.problems and all(p.startswith(f"{path}: ") for p in e.problems)


def test_nesting_beyond_the_parsers_own_limits_is_a_decode_error() -> None:
    """Thousands of levels (past msgspec's and orjson's recursion limits) raise DecodeError, never RecursionError."""
    key, value, hdrs = encode(VALID)
    for depth in (1000, 5000, 100_000):
        nested = b"[" * depth + b"]" * depth
        for data in (value.replace(b'"payload":{', b'"payload":{"d":' + nested + b",", 1),
                     value[:-1] + b',"x":' + nested + b"}"):
            try:
                decode(key, data, hdrs)
            except DecodeError as e:
                assert e.reason in ("too-deep", "bad-json", "unknown-field"), e
            else:
                raise AssertionError("accepted a hostile payload")
