"""`kafold config validate|show|reference`: check a configuration without opening any connection."""

from __future__ import annotations

import argparse
from typing import Any

from kafold import config
from kafold.tools.cli import add_config_arg
from kafold.tools.commands.reference import render


def register(sub: Any) -> None:
    p = sub.add_parser("config", help="validate a configuration (no connections opened), or print the reference")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    v = csub.add_parser("validate", help="check a kafold.toml and print every problem found")
    add_config_arg(v)
    v.set_defaults(handler=validate)
    r = csub.add_parser("reference", help="print the configuration reference (Markdown; docs/configuration.md)")
    r.set_defaults(handler=reference)


def validate(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    cfg = loaded.config
    print(f"{args.config}: ok ({len(cfg.aggregates)} aggregates, {len(cfg.connectors)} connectors, "
          f"{len(config.topic_map(cfg))} topics)")
    return 0


def reference(args: argparse.Namespace) -> int:
    print(render())
    return 0
