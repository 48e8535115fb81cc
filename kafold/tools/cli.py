"""The `kafold` command line: one subcommand module per concern under kafold.tools.commands."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kafold import __version__, logs
from kafold.errors import ConfigError, KafoldError
from kafold.extras import missing_extra

# Each module exposes register(subparsers); its handlers take the parsed args and return an exit code. Keyed by the
# top-level commands a module registers: a run imports only its own command's module (which imports what it needs at
# its top), so no command pays the start-up of the others' dependencies; help, or no known command, imports them all.
COMMANDS = {"config": "config", "dev": "dev", "topics": "topics", "daemon": "daemon", "run": "run",
            "command": "aggregate", "state": "aggregate", "status": "status", "db": "db", "dlq": "dlq",
            "effects": "effects", "snapshot": "snapshot", "bench": "bench", "projection": "projection",
            "events": "events", "subjects": "subjects", "keys": "keys"}
COMMAND_MODULES = tuple(dict.fromkeys(COMMANDS.values()))
GLOBAL_OPTIONS_WITH_VALUE = ("--log-format",)
GLOBAL_FLAGS = ("--debug",)
CONFIG_ENV = "KAFOLD_CONFIG"


def hoist_global_options(argv: Sequence[str]) -> list[str]:
    """`argv` with the global options (`--debug`, `--log-format X`) moved before the command, wherever they were
    written (`kafold dlq list --debug` as `kafold --debug dlq list`); nothing after a `--` moves."""
    front: list[str] = []
    rest: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            rest += [token, *tokens]
            break
        if token in GLOBAL_FLAGS or any(token.startswith(f"{o}=") for o in GLOBAL_OPTIONS_WITH_VALUE):
            front.append(token)
        elif token in GLOBAL_OPTIONS_WITH_VALUE:
            front += [token, *(next(tokens, ""),)]
        else:
            rest.append(token)
    return front + rest


def command_modules(argv: Sequence[str] | None) -> tuple[str, ...]:
    """The command modules to register for `argv`: the one of the command it names, else all of them."""
    previous = ""
    for token in argv or ():
        if not token.startswith("-") and previous not in GLOBAL_OPTIONS_WITH_VALUE:
            return (COMMANDS[token],) if token in COMMANDS else COMMAND_MODULES
        previous = token
    return COMMAND_MODULES


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or (given the arguments to parse) of the command they name."""
    parser = argparse.ArgumentParser(
        prog="kafold", description="Kafka as a practical event store for Python services.")
    parser.add_argument("--version", action="version", version=f"kafold {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto",
                        help="log format (auto: console on a TTY, JSON otherwise)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in command_modules(argv):
        importlib.import_module(f"kafold.tools.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(hoist_global_options(sys.argv[1:] if argv is None else argv))
    except ImportError as e:
        why = missing_extra(e)
        if why is None:
            raise
        print(f"error: {why}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    args = build_parser(argv).parse_args(argv)
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
    """`-c FILE`, or the file `KAFOLD_CONFIG` names (read when the parser is built, as the command runs)."""
    default = os.environ.get(CONFIG_ENV) or None
    p.add_argument("-c", "--config", required=default is None, default=default, metavar="FILE",
                   help=f"path to kafold.toml (default ${CONFIG_ENV}{f': {default}' if default else ''})")


if __name__ == "__main__":
    sys.exit(main())
