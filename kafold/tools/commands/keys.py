"""`kafold keys status|rotate|reapply|purge`: the subject key store (master-key rotation, erasures after a restore,
removing deleted keys' bytes)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kafold import config, db, devstack, erasure_log, key_rotation, protect
from kafold.errors import ConfigError
from kafold.tools.cli import add_config_arg


def register(sub: Any) -> None:
    p = sub.add_parser("keys", help="the subject key store: rotate the master key, re-apply erasures, purge")
    ksub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    s = ksub.add_parser("status", help="keys held, how many are not under the current master key, master key ids")
    add_config_arg(s)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(handler=status)
    r = ksub.add_parser("rotate", help="re-wrap every subject key under privacy.master_key (resumable: run again "
                        "after an interruption; privacy.previous_master_key is needed until it reports done)")
    add_config_arg(r)
    r.add_argument("--batch", type=int, default=key_rotation.BATCH, help="keys per committed batch")
    r.set_defaults(handler=rotate)
    a = ksub.add_parser("reapply", help="delete the keys the erasure topic names that the store still holds "
                        "(after a restore of the database; the daemon and `kafold db upgrade` do it too)")
    add_config_arg(a)
    a.set_defaults(handler=reapply)
    g = ksub.add_parser("purge", help="remove deleted keys' bytes from the key store's files now (VACUUM FULL of "
                        "the keys table; the daemon does it every privacy.key_purge_interval_s)")
    add_config_arg(g)
    g.add_argument("--force", action="store_true", help="purge even when nothing was deleted since the last purge")
    g.set_defaults(handler=purge)


def _ring(args: argparse.Namespace, need: tuple[str, ...] = ("postgres",)) -> tuple[config.KafoldConfig,
                                                                                     protect.KeyRing]:
    loaded = config.load_file(args.config)
    cfg = devstack.effective(loaded.config, need=need)
    protector = protect.build(cfg)
    if protector is None:
        raise ConfigError([f"{loaded.path}: no aggregate has `protect` rules: there are no subject keys"])
    if cfg.postgres.migrate_on_start:
        db.upgrade(cfg.postgres)
    return cfg, protector.ring


def status(args: argparse.Namespace) -> int:
    _, ring = _ring(args)
    out = {"keys": ring.store.count(), "not_under_current_master_key": key_rotation.pending(ring.store, ring.cipher),
           "master_key_id": ring.cipher.master_id.hex(),
           "previous_master_key_id": next((m.hex() for m in ring.cipher.masters if m != ring.cipher.master_id),
                                          None)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['keys']} subject keys; {out['not_under_current_master_key']} not under the current master key "
              f"{out['master_key_id']}" + (f" (previous: {out['previous_master_key_id']})"
                                           if out["previous_master_key_id"] else ""))
    return 0


def rotate(args: argparse.Namespace) -> int:
    _, ring = _ring(args)

    def show(p: key_rotation.RotationProgress) -> None:
        print(f"\r{p.seen}/{p.total} keys: {p.rewrapped} re-wrapped, {p.current} already current", end="",
              file=sys.stderr, flush=True)

    done = key_rotation.rotate(ring.store, ring.cipher, max(1, args.batch), show)
    print(file=sys.stderr)
    left = key_rotation.pending(ring.store, ring.cipher)
    ring.store.purge()  # the old wrappings stay in dead row versions until then
    if left:
        print(f"{left} keys are still not under master key {ring.cipher.master_id.hex()} (written under the "
              "previous one meanwhile?); run `kafold keys rotate` again")
        return 1
    print(f"done: {done.seen} keys under master key {ring.cipher.master_id.hex()} ({done.rewrapped} re-wrapped); "
          "privacy.previous_master_key can be removed once no backup older than this run is to be restored")
    return 0


def reapply(args: argparse.Namespace) -> int:
    cfg, ring = _ring(args, need=("kafka", "postgres"))
    gone = erasure_log.reapply(ring, erasure_log.ErasureLog(cfg.kafka, cfg.privacy.erasure_topic))
    ring.store.purge()
    print(f"{len(gone)} keys deleted again (subjects forgotten after the database's backup was taken)")
    return 0


def purge(args: argparse.Namespace) -> int:
    _, ring = _ring(args)
    purged = ring.store.purge(force=args.force)
    print("deleted keys' bytes removed from the key store's files" if purged else
          "nothing to purge (no key deleted or re-wrapped since the last purge)")
    return 0
