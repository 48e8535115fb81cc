"""`kafold dev up|status|down`: a local broker (tansu or Apache Kafka) and PostgreSQL for development and tests."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from kafold.tools.dev import apache_kafka, registry_server
from kafold.tools.dev import stack as devstack


def register(sub: Any) -> None:
    p = sub.add_parser("dev", help="run a local broker (tansu, or Apache Kafka) and PostgreSQL (pgserver) for "
                                   "development")
    dsub = p.add_subparsers(dest="dev_command", metavar="ACTION", required=True)
    for name, handler, doc in (
        ("up", up, "start the local stack (idempotent) and print how to reach it"),
        ("status", status, "show whether the local stack is running"),
        ("down", down, "stop the local stack, leaving no process behind (tansu's data is memory-only; Apache "
                       "Kafka's stays in the state dir)"),
    ):
        a = dsub.add_parser(name, help=doc)
        a.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                       help="where the stack keeps its state (default: $KAFOLD_DEV_DIR or "
                            "$XDG_STATE_HOME/kafold/dev)")
        if name == "up":
            add_broker_args(a)
            a.add_argument("--registry", action="store_true",
                           help="also run a Schema Registry (Apicurio, built once with Maven; in memory) for the "
                                "avro / jsonschema / protobuf converters")
        a.set_defaults(handler=handler)


def add_broker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", choices=devstack.BROKERS, default=None,
                   help="tansu: the embedded broker, memory only (default); kafka: Apache Kafka, fetched once with "
                        "Maven (needs Java 17+ and mvn), its data kept in the state dir")
    p.add_argument("--nodes", type=int, choices=(1, 3), default=None,
                   help="Apache Kafka nodes on loopback: 3 gives replication factor 3, min ISR 2 (default 1)")


def _show(stack: devstack.DevStack) -> None:
    pids = ", ".join(str(b.pid) for b in stack.brokers)
    if stack.kind == "kafka":
        print(f"kafka     {stack.bootstrap_servers}  (Apache Kafka {apache_kafka.version()}, {stack.nodes} node(s), "
              f"replication factor {stack.replication_factor}, pid {pids}, data in {stack.state_dir / 'kafka'})")
    else:
        print(f"kafka     {stack.bootstrap_servers}  (tansu, pid {pids}, memory only)")
    print(f"postgres  {stack.postgres_url}  (pid {stack.postgres.pid})")
    print(f"state     {stack.state_dir}")
    print()
    print("# kafold commands find this stack when [kafka].bootstrap_servers / [postgres].url are empty;")
    print("# for other tools or a non-default state dir:")
    env = stack.env()
    if stack.state_dir != devstack.default_state_dir().expanduser().resolve():
        env["KAFOLD_DEV_DIR"] = str(stack.state_dir)
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")


def up(args: argparse.Namespace) -> int:
    stack = devstack.up(args.state_dir, broker=args.broker, nodes=args.nodes)
    _show(stack)
    if args.registry:
        url = registry_server.dev_up(stack.state_dir)
        print(f"registry  {url}  (Apicurio Registry {registry_server.version()}, in memory)")
        print(f"export KAFOLD_REGISTRY__URL={shlex.quote(url)}")
    return 0


def status(args: argparse.Namespace) -> int:
    stack = devstack.status(args.state_dir)
    if stack is None:
        print(f"not running (state dir {args.state_dir or devstack.default_state_dir()})")
        return 1
    _show(stack)
    if url := registry_server.dev_url(stack.state_dir):
        print(f"registry  {url}")
    return 0


def down(args: argparse.Namespace) -> int:
    stopped = devstack.down(args.state_dir)
    stopped = registry_server.dev_down((args.state_dir or devstack.default_state_dir()).expanduser().resolve()) \
        or stopped
    print("stopped" if stopped else "not running")
    return 0
