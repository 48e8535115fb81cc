"""`kafold effects show | parked list|retry|skip | reset-offsets`: inspect and steer the effect connectors."""

from __future__ import annotations

import argparse
from typing import Any

from kafold import config, devstack
from kafold.connectors.effects import ops
from kafold.errors import KafoldError
from kafold.terminal import visible
from kafold.tools.cli import add_config_arg
from kafold.tools.commands import add_json_arg, print_json


def register(sub: Any) -> None:
    p = sub.add_parser("effects", help="side-effect connectors: delivery ledger, parked keys, offset resets")
    cmds = p.add_subparsers(dest="effects_command", metavar="ACTION", required=True)
    show = cmds.add_parser("show", help="was this event's effect delivered, when, after how many tries")
    show.add_argument("event_id")
    add_config_arg(show)
    show.set_defaults(handler=handle_show)
    parked = cmds.add_parser("parked", help="keys parked after an effect ran out of retries")
    actions = parked.add_subparsers(dest="parked_command", metavar="ACTION", required=True)
    ls = actions.add_parser("list", help="list parked keys")
    add_config_arg(ls)
    ls.add_argument("--connector", help="only this connector")
    add_json_arg(ls)
    ls.set_defaults(handler=handle_list)
    for name, text in (("retry", "re-run the key's parked events in order"),
                       ("skip", "drop the key's head event (recorded as skipped), then re-run the rest")):
        a = actions.add_parser(name, help=text)
        if name == "retry":
            a.add_argument("key", nargs="?", help="the parked key (or --all)")
            a.add_argument("--all", action="store_true", help="retry every parked key (of --connector if given)")
        else:
            a.add_argument("key")
        add_config_arg(a)
        a.add_argument("--connector", help="the connector, when the key is parked in several")
        a.add_argument("--wait", type=float, default=30.0, metavar="S",
                       help="seconds to wait for the daemon's answer (0 = do not wait)")
        a.set_defaults(handler=handle_release, action=name)
    reset = cmds.add_parser("reset-offsets", help="move an effect connector's consumer group (re-fires effects "
                                                  "the ledger does not show as finished)")
    reset.add_argument("name", help="effect connector name")
    add_config_arg(reset)
    where = reset.add_mutually_exclusive_group(required=True)
    where.add_argument("--to-earliest", dest="to", action="store_const", const="earliest")
    where.add_argument("--to-latest", dest="to", action="store_const", const="latest")
    reset.add_argument("--yes", action="store_true", help="confirm: without it nothing is changed")
    reset.set_defaults(handler=handle_reset)


def _cfg(args: argparse.Namespace, need: tuple[str, ...]) -> config.KafoldConfig:
    return devstack.effective(config.load_file(args.config).config, need=need)


def handle_show(args: argparse.Namespace) -> int:
    rows = ops.show(_cfg(args, ("postgres",)).postgres, args.event_id)
    if not rows:
        print(f"no effect recorded for event {visible(args.event_id)}")
        return 1
    for r in rows:
        print(visible(f"{r['connector']}: {r['status']} after {r['attempts']} attempt(s); first "
                      f"{r['first_attempt_at']}, last {r['last_attempt_at']}, completed {r['completed_at'] or '-'}; "
                      f"latency {r['latency_ms'] if r['latency_ms'] is None else round(r['latency_ms'], 1)} ms; "
                      f"{r['topic']}[{r['partition']}]@{r['offset']}"))
        for f in r["failed_attempts"]:
            print(visible(f"  failed {f['attempted_at']} ({round(f['latency_ms'] or 0, 1)} ms): {f['error']}"))
    return 0


def handle_list(args: argparse.Namespace) -> int:
    rows = ops.parked(_cfg(args, ("postgres",)).postgres, args.connector)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no parked keys")
    for r in rows:
        req = f" (requested: {r['requested_action']})" if r["requested_action"] else ""
        print(visible(f"{r['connector']}  key={r['key']}  events={r['events']}  head={r['head_event_id']}  "
                      f"{r['topic']}[{r['partition']}]  since {r['parked_at']}{req}"))
        print(f"    {visible(r['error'])}")
    return 0


def handle_release(args: argparse.Namespace) -> int:
    pg = _cfg(args, ("postgres",)).postgres
    if getattr(args, "all", False) or args.key is None:
        return _release_all(args, pg)
    connector = ops.request(pg, args.key, args.action, args.connector)
    if args.wait <= 0:
        print(visible(f"{args.action} of key {args.key!r} ({connector}) requested"))
        return 0
    result = ops.wait(pg, connector, args.key, args.wait)
    print(visible({
        ops.WaitOutcome.RELEASED: f"key {args.key!r} ({connector}) released: its parked events were delivered in order",
        ops.WaitOutcome.PARKED: f"key {args.key!r} ({connector}) is parked again: an event failed again "
                                "(see `kafold effects parked list`)",
        ops.WaitOutcome.PENDING: f"no daemon answered within {args.wait:g}s; the request stays and runs when the "
                                 f"connector's daemon does"}[result]))
    return 0 if result is ops.WaitOutcome.RELEASED else 1


def _release_all(args: argparse.Namespace, pg: config.PostgresConfig) -> int:
    if not args.all or args.key is not None:
        raise KafoldError("name one parked key, or give --all (not both)")
    asked = ops.request_all(pg, args.connector)
    where = f" of {args.connector}" if args.connector else ""
    if not asked:
        print(f"no parked keys{where}")
        return 0
    if args.wait <= 0:
        print(f"retry of {asked} parked key(s){where} requested")
        return 0
    pending, parked = ops.wait_all(pg, args.connector, args.wait)
    print(f"{asked} parked key(s){where}: {asked - pending - parked} released, {parked} parked again, "
          f"{pending} not answered within {args.wait:g}s (they run when the connector's daemon does)")
    return 0 if not pending and not parked else 1


def handle_reset(args: argparse.Namespace) -> int:
    cfg = _cfg(args, ("kafka",))
    found = [c for c in cfg.connectors if c.name == args.name]
    if not found:
        raise KafoldError(f"no connector named {args.name!r} in {args.config}")
    con = found[0]
    if con.connector_class not in ("webhook", "kafka", "python") and "effects" not in con.connector_class:
        raise KafoldError(f"connector {args.name!r} is not an effect connector")
    group = f"{cfg.daemon.group_prefix}.{con.name}"
    if not args.yes:
        print(f"would move consumer group {group!r} on {', '.join(con.topics)} to the {args.to} offsets; "
              "effects the ledger does not show as finished would run (again). Add --yes to do it.")
        return 1
    moved = ops.reset_offsets(cfg.kafka, group, list(con.topics), args.to)
    for tp, off in sorted(moved.items()):
        print(f"{tp}  -> {off}")
    return 0
