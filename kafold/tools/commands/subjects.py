"""`kafold subjects forget SUBJECT`: crypto-shred a subject's protected fields by deleting its data key."""

from __future__ import annotations

import argparse
import getpass
import json
import sys

from kafold import config, db, devstack, protect
from kafold.errors import ConfigError
from kafold.tools.cli import add_config_arg


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("subjects", help="personal data: forget a subject (crypto-shredding)")
    ssub = p.add_subparsers(dest="subjects_command", metavar="SUBCOMMAND", required=True)
    f = ssub.add_parser("forget", help="delete a subject's data key: its protected fields read as the placeholder "
                        "everywhere (a running daemon sees it within a few seconds)")
    add_config_arg(f)
    f.add_argument("subject", metavar="SUBJECT", help="the subject (aggregate id or payload value of the rule)")
    f.add_argument("--actor", default=None, help="who asks, recorded with the erasure (default: the OS user)")
    f.add_argument("--json", action="store_true", help="print one JSON object")
    f.add_argument("--yes", action="store_true",
                   help="forget without asking (required when standard input is not a terminal: it cannot be undone)")
    f.add_argument("--dry-run", action="store_true",
                   help="say whether a key is held for the subject and what a forget would record; change nothing")
    f.set_defaults(handler=forget)


def forget(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    cfg = devstack.effective(loaded.config)
    protector = protect.build(cfg)
    if protector is None:
        raise ConfigError([f"{loaded.path}: no aggregate has `protect` rules: nothing to forget"])
    if cfg.postgres.migrate_on_start:
        db.upgrade(cfg.postgres)  # the keys table exists before the first daemon wrote a protected event
    actor = args.actor or f"cli:{getpass.getuser()}"
    digest = protector.ring.cipher.subject_hash(args.subject)
    if args.dry_run:
        held = protector.ring.lookup(args.subject)[1] is not None
        out: dict[str, object] = {"subject_hash": digest, "key_held": held, "actor": actor, "dry_run": True}
        print(json.dumps(out) if args.json else
              f"dry run: {'a key is held' if held else 'no key held (already forgotten or never written)'}; a forget "
              f"would delete it and record the erasure as {digest[:16]}… by {actor}; nothing changed")
        return 0
    if not args.yes and not confirmed(args.subject):
        print("not forgotten: a forget cannot be undone; confirm on a terminal or pass --yes", file=sys.stderr)
        return 2
    try:
        existed = protector.ring.forget(args.subject, actor)
    finally:
        if protector.ring.erasure_log is not None:
            protector.ring.erasure_log.close()
    out = {"subject_hash": digest, "key_deleted": existed, "actor": actor}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"forgotten ({'key deleted' if existed else 'no key held: already forgotten or never written'}); "
              f"erasure recorded as {digest[:16]}… by {actor}")
    return 0


def confirmed(subject: str) -> bool:
    """On a terminal, the subject typed back; without one (a script), never: scripts say `--yes`."""
    if not sys.stdin.isatty():
        return False
    try:
        answer = input(f"Forget {subject!r}? Its protected fields become unreadable everywhere, for good.\n"
                       "Type the subject again to confirm: ")
    except EOFError:
        return False
    return answer.strip() == subject
