"""The `kafold` command line: one subcommand module per concern under kafold.commands."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kafold import __version__, logs
from kafold.errors import ConfigError, KafoldError

# Each module exposes register(subparsers); its handlers take the parsed args and return an exit code.
COMMAND_MODULES = ("config", "dev", "topics", "daemon", "run", "aggregate", "status", "db", "dlq", "effects",
                   "snapshot", "bench", "projection")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kafold", description="Kafka as a practical event store for Python services.")
    parser.add_argument("--version", action="version", version=f"kafold {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto",
                        help="log format (auto: console on a TTY, JSON otherwise)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"kafold.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure("debug" if args.debug else "info", args.log_format)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as e:
        print("configuration error:\n  " + "\n  ".join(e.problems), file=sys.stderr)
        return 2
    except KafoldError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, metavar="FILE", help="path to kafold.toml")


if __name__ == "__main__":
    sys.exit(main())
