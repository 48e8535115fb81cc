"""CLI subcommands, one module per concern; each exposes register(subparsers)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec
import orjson

from kafold import config, devstack, protect
from kafold.config import KafoldConfig
from kafold.errors import ConfigError


def add_json_arg(p: argparse.ArgumentParser) -> None:
    """`--json` on a listing command: one JSON document on stdout instead of a table."""
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def print_json(value: Any) -> None:
    """`value` as one JSON document (datetimes as ISO 8601, bytes never: callers pass text; an integer beyond 64
    bits, which orjson refuses and a state may hold, written exactly by msgspec)."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        text = msgspec.json.format(msgspec.json.encode(value), indent=2)
    sys.stdout.write(text.decode() + "\n")


def effective(cfg: KafoldConfig, need: tuple[str, ...]) -> KafoldConfig:
    """`devstack.effective` for a command that reads events: PostgreSQL too when the configuration protects
    fields, whose subjects' keys live there (kafold.protect): on the dev stack it is taken from the stack like
    Kafka, not left empty."""
    if protect.setup(cfg) is not None and "postgres" not in need:
        need = (*need, "postgres")
    return devstack.effective(cfg, need=need)


def aggregate_named(loaded: config.Loaded, name: str) -> config.AggregateConfig:
    """The aggregate `name` of a loaded configuration; ConfigError naming the configured ones when there is none
    (`kafold aggregate`, `kafold events list`)."""
    for agg in loaded.config.aggregates:
        if agg.name == name:
            return agg
    known = ", ".join(a.name for a in loaded.config.aggregates) or "none"
    raise ConfigError([f"{loaded.path}: aggregates: no aggregate named {name!r} (configured: {known})"])
