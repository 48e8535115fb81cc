"""`kafold bench AREA [--json]`: measure an area's speed and memory targets and print the figures."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from typing import Any

from kafold.devstack import BROKERS
from kafold.tools.bench import AREAS, BROKER_USAGE


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure throughput, latency and memory (starts the dev stack if needed)")
    areas = p.add_subparsers(dest="area", metavar="AREA", required=True)
    for area, module in sorted(AREAS.items()):
        mod = importlib.import_module(f"kafold.tools.bench.{module}")
        ap = areas.add_parser(area, help=(mod.__doc__ or "").strip().splitlines()[0])
        ap.add_argument("--json", action="store_true", help="print one JSON object with the figures")
        ap.add_argument("--broker", choices=BROKERS, help="the dev stack's broker to measure on (default: the "
                        "running stack's, else tansu); a stack with another broker is started for the bench")
        mod.add_arguments(ap)
        ap.set_defaults(handler=lambda args, mod=mod: _run(mod, args))


def _run(mod: Any, args: argparse.Namespace) -> int:
    # SIGTERM (a timeout, a supervisor) unwinds like Ctrl-C, so the stack and daemons the bench started are stopped
    # by its exit handlers instead of being left running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    figures: dict[str, Any] = mod.run(args)
    figures.update(BROKER_USAGE)  # the broker's own CPU time over the bench (when it ran on the dev stack)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    else:
        width = max(map(len, figures), default=0)
        for key, value in figures.items():
            print(f"{key:<{width}}  {'absent' if value is None else value}")  # None: not computable
    return 0
