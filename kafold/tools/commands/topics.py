"""`kafold topics ensure|list`: create the topics a configuration implies and report drift."""

from __future__ import annotations

import argparse
from typing import Any

from kafold import config, devstack, topics
from kafold.tools.cli import add_config_arg
from kafold.tools.commands import add_json_arg, print_json


def register(sub: Any) -> None:
    p = sub.add_parser("topics", help="create and check the topics a configuration implies")
    tsub = p.add_subparsers(dest="topics_command", metavar="ACTION", required=True)
    e = tsub.add_parser("ensure", help="create missing topics, then report drift (exit 1 on errors)")
    add_config_arg(e)
    add_json_arg(e)
    e.set_defaults(handler=ensure)
    s = tsub.add_parser("list", help="show the configured topics as the broker has them (changes nothing)")
    add_config_arg(s)
    add_json_arg(s)
    s.set_defaults(handler=list_)


def _run(args: argparse.Namespace, create: bool) -> int:
    cfg = devstack.effective(config.load_file(args.config).config, need=("kafka",))
    specs = config.topic_map(cfg).values()
    report = topics.ensure(cfg.kafka, specs) if create else topics.check(cfg.kafka, specs)
    if args.json:
        print_json({"ok": report.ok, "topics": [
            {"name": t.spec.name, "purpose": t.spec.purpose, "partitions": t.partitions,
             "expected_partitions": t.spec.partitions, "state": t.action,
             "drift": [{"what": d.what, "expected": d.expected, "actual": d.actual, "severity": d.severity}
                       for d in t.drift]} for t in report.topics]})
        return 0 if report.ok else 1
    print(report.table())
    errors, missing = report.errors, [t.spec.name for t in report.topics if t.action == "missing"]
    if errors:
        print(f"\n{len(errors)} error(s): the broker's topics do not match what kafold relies on; "
              "fix them by hand (kafold never alters existing topics)")
    if missing:
        print(f"\n{len(missing)} topic(s) missing; run `kafold topics ensure -c {args.config}`")
    return 0 if report.ok else 1


def ensure(args: argparse.Namespace) -> int:
    return _run(args, create=True)


def list_(args: argparse.Namespace) -> int:
    return _run(args, create=False)
