"""`kafold subjects forget SUBJECT`: crypto-shred a subject's protected fields by deleting its data key."""

from __future__ import annotations

import argparse
import getpass
import json

from kafold import config, db, devstack, protect
from kafold.cli import add_config_arg
from kafold.errors import ConfigError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("subjects", help="personal data: forget a subject (crypto-shredding)")
    ssub = p.add_subparsers(dest="subjects_command", metavar="SUBCOMMAND", required=True)
    f = ssub.add_parser("forget", help="delete a subject's data key: its protected fields read as the placeholder "
                        "everywhere (a running daemon sees it within a few seconds)")
    add_config_arg(f)
    f.add_argument("subject", metavar="SUBJECT", help="the subject (aggregate id or payload value of the rule)")
    f.add_argument("--actor", default=None, help="who asks, recorded with the erasure (default: the OS user)")
    f.add_argument("--json", action="store_true", help="print one JSON object")
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
    try:
        existed = protector.ring.forget(args.subject, actor)
    finally:
        if protector.ring.erasure_log is not None:
            protector.ring.erasure_log.close()
    digest = protector.ring.cipher.subject_hash(args.subject)
    out = {"subject_hash": digest, "key_deleted": existed, "actor": actor}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"forgotten ({'key deleted' if existed else 'no key held: already forgotten or never written'}); "
              f"erasure recorded as {digest[:16]}… by {actor}")
    return 0
