"""`kafold command send` and `kafold state get`: request/reply with an aggregate, and its current state."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kafold import config, devstack, protect
from kafold.client import CommandClient, DaemonClient
from kafold.errors import KafoldError
from kafold.partitioning import partition_for
from kafold.snapshot.fold import Domain
from kafold.snapshot.restore import restore
from kafold.tools import commands
from kafold.tools.cli import add_config_arg
from kafold.tools.commands import aggregate_named


def register(sub: Any) -> None:
    cmd = sub.add_parser("command", help="send a command to an aggregate (and wait for its result)")
    csub = cmd.add_subparsers(dest="command_action", metavar="ACTION", required=True)
    send = csub.add_parser("send", help="send one command; --wait prints its result")
    add_config_arg(send)
    send.add_argument("aggregate", help="aggregate name ([[aggregates]].name)")
    send.add_argument("id", help="aggregate id")
    send.add_argument("type", help="command type, e.g. Deposit")
    send.add_argument("--data", default="{}", help="command data as a JSON object")
    send.add_argument("--expected-version", type=int, default=None, help="reject unless the aggregate is at it")
    send.add_argument("--wait", action="store_true", help="wait for the result and print it")
    send.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the result")
    send.add_argument("--wait-visible", metavar="CONNECTOR", default=None,
                      help="also wait (implies --wait, up to --timeout more) until CONNECTOR, e.g. a projection, "
                           "has committed the command's events: asks the daemon of the config ([daemon] http_port)")
    send.set_defaults(handler=send_command)
    state = sub.add_parser("state", help="the current state of one aggregate (snapshot + tail)")
    ssub = state.add_subparsers(dest="state_action", metavar="ACTION", required=True)
    get = ssub.add_parser("get", help="print the state of AGGREGATE ID as JSON, and how it was obtained")
    add_config_arg(get)
    get.add_argument("aggregate")
    get.add_argument("id")
    get.add_argument("--url", default=None, help="ask this running daemon (any instance of the group, e.g. "
                     "http://127.0.0.1:8083) instead of folding the events here")
    get.add_argument("--min-version", type=int, default=None,
                     help="with --url: wait until the state has reached this version")
    get.add_argument("--version", type=int, default=None, metavar="N",
                     help="the state after the aggregate's first N events (read through the history index, "
                          "kafold.history; needs [postgres])")
    get.add_argument("--timeout", type=float, default=10.0,
                     help="with --url: seconds to wait (for --min-version, and while the key's partition moves)")
    get.set_defaults(handler=get_state)


def send_command(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    agg = aggregate_named(loaded, args.aggregate)
    try:
        data = json.loads(args.data)
    except json.JSONDecodeError as e:
        raise KafoldError(f"--data: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise KafoldError("--data: expected a JSON object")
    cfg = devstack.effective(loaded.config, need=("kafka",))
    daemon = DaemonClient.for_config(cfg.daemon) if args.wait_visible else None
    with CommandClient(cfg.kafka, agg, daemon) as client:
        command = client.command(args.id, args.type, data, expected_version=args.expected_version)
        result = client.send(command, wait=args.wait or bool(args.wait_visible), timeout=args.timeout)
        if result is not None and args.wait_visible:
            try:
                client.wait_visible(result, args.wait_visible, args.timeout)
            except KafoldError:  # the command was decided all the same: its result first, then the error (exit 1)
                print(json.dumps(result.to_json()))
                raise
    if result is None:
        print(json.dumps({"command_id": command.command_id, "sent": True}))
        return 0
    print(json.dumps(result.to_json()))
    return 0 if result.status == "accepted" else 1


def get_state(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    agg = aggregate_named(loaded, args.aggregate)
    if args.version is not None and args.version < 1:
        raise KafoldError("--version: expected a version of 1 or more")
    if args.url:
        print(json.dumps(state_from_daemon(loaded.config.daemon, args.url, agg.name, args.id, args.min_version,
                                           args.timeout, args.version), indent=2))
        return 0
    if args.version is not None:
        return _state_at(args)
    cfg = commands.effective(loaded.config, ("kafka",))
    paths = [str((loaded.base / p).resolve()) for p in cfg.daemon.python_path]
    protect.build(cfg)  # protected fields read in clear, or as the placeholder once forgotten (kafold.protect)
    domain = Domain.load(agg, paths)
    partition = partition_for(args.id.encode(), agg.partitions)
    restored = restore(cfg.kafka, agg, domain, partition)
    if args.id not in restored.states:
        raise KafoldError(f"aggregate {args.aggregate}/{args.id} has no events (partition {partition})")
    state, version = restored.states[args.id]
    print(json.dumps({"aggregate": args.aggregate, "id": args.id, "version": version,
                      "state": domain.to_json(state),
                      "obtained": {"partition": partition, "snapshots_used_in_partition": restored.snapshots_used,
                                   "tail_events_replayed": restored.events_read,
                                   "replayed_from_offset": restored.start, "end_offset": restored.end}},
                     default=str, indent=2))
    return 0


def _state_at(args: argparse.Namespace) -> int:
    """`state get --version N`: the fold of the aggregate's first N events, fetched through the history index."""
    from kafold.tools.commands.history import history_of  # the history's imports (psycopg) only for this option

    with history_of(args.config, args.aggregate) as h:
        state, version = h.state_at(args.id, args.version)
        print(json.dumps({"aggregate": args.aggregate, "id": args.id, "version": version,
                          "state": h.domain.to_json(state),
                          "obtained": {"partition": h.partition_of(args.id), "events_folded": version,
                                       "through": "history index"}}, default=str, indent=2))
    return 0


def state_from_daemon(daemon: config.DaemonConfig, url: str, aggregate: str, aggregate_id: str,
                      min_version: int | None, timeout: float, version: int | None = None) -> dict[str, Any]:
    """GET /aggregates/{aggregate}/{id} from the daemon at `url` (any instance: it forwards or redirects to the
    owner; the token goes to `url`'s host only), asked again while the key's partition moves (503, Retry-After)
    until `timeout` s (kafold.daemon_api). KafoldError for anything but the state."""
    token = daemon.api_token.reveal() if daemon.api_token is not None else None
    return DaemonClient(url, token).state(aggregate, aggregate_id, min_version, timeout, version)
