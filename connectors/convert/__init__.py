"""Converters: records kafold did not write (plain JSON, Debezium, Schema Registry formats) as Events."""

from __future__ import annotations

from typing import Any

from kafold.config import SnapshotSweep
from kafold.connectors.convert.api import Converter, ConvertError, ValueFormat
from kafold.connectors.convert.debezium import DebeziumConverter
from kafold.connectors.convert.plain import JsonConverter, JsonFormat
from kafold.connectors.convert.schemaless import ColumnTypes, field_decoders

__all__ = ["ConvertError", "Converter", "ValueFormat", "converter_for"]

REGISTRY_KINDS = ("avro", "jsonschema", "protobuf")


def value_format(kind: str, registry_config: Any, message_type: str = "") -> ValueFormat:
    if kind == "json":
        return JsonFormat()
    # Imported here: the registry formats load confluent_kafka.schema_registry, which a kafold-envelope daemon
    # never needs.
    from kafold.connectors.convert.registry import registry_format
    return registry_format(kind, registry_config, message_type)


def converter_for(connector_config: Any, registry_config: Any = None) -> Converter | None:
    """The connector's converter; None for `kafold` envelopes (the intake keeps its fast path)."""
    kind = str(getattr(connector_config, "converter", "kafold"))
    options = connector_config.convert
    if kind == "kafold":
        return None
    if kind == "debezium":
        columns = None
        if not options.schemas and options.format == "json" and isinstance(connector_config.config, dict):
            columns = ColumnTypes(field_decoders(connector_config.config, options.binary_handling_mode))
        sweep = SnapshotSweep(options.snapshot_sweep)
        return DebeziumConverter(options, value_format(options.format, registry_config, options.message_type),
                                 columns, sweep is SnapshotSweep.SWEEP
                                 or (sweep is SnapshotSweep.AUTO and len(connector_config.topics) == 1))
    if kind == "json":
        return JsonConverter(options)
    if kind in REGISTRY_KINDS:
        return JsonConverter(options, value_format(kind, registry_config, options.message_type))
    raise ValueError(f"unknown converter {kind!r}")
