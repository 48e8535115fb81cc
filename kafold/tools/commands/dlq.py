"""`kafold dlq list|show|replay|discard -c FILE`: inspect dead letters and replay them once the cause is fixed.

A projection's dead letter that holds its row key back (see connectors/projection/holds.py) is replayed or discarded
together with the events held behind it, in order; every record gets an answer (applied, held, skipped as stale,
already applied, refused) and a replay that applied nothing exits 1."""

from __future__ import annotations

import argparse
import base64
from pathlib import Path
from typing import Any

from psycopg import sql
from psycopg.rows import dict_row
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kafold import config, db, devstack, kafka_clients, protect, upcast
from kafold.connectors.convert import converter_for
from kafold.connectors.dlq import OPEN_STATUSES, DeadLetterStatus, stored_headers
from kafold.connectors.projection import ProjectionConnector
from kafold.connectors.projection.holds import Release
from kafold.connectors.projection.mapping import Mapping, load_mapper
from kafold.connectors.registry import instantiate
from kafold.errors import ConfigError, KafoldError
from kafold.terminal import visible
from kafold.tools.cli import add_config_arg
from kafold.tools.commands import add_json_arg, print_json

STATUSES = tuple(s.value for s in DeadLetterStatus)


def register(sub: Any) -> None:
    p = sub.add_parser("dlq", help="inspect and replay dead letters (the dead-letter table in PostgreSQL)")
    dsub = p.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)
    ls = dsub.add_parser("list", help="dead letters, newest first")
    add_config_arg(ls)
    ls.add_argument("--connector", help="only this connector's")
    ls.add_argument("--status", choices=(*STATUSES, "all"), default=DeadLetterStatus.NEW.value, help="default: new")
    ls.add_argument("--limit", type=int, default=50)
    add_json_arg(ls)
    ls.set_defaults(handler=list_)
    show = dsub.add_parser("show", help="one dead letter in full: coordinates, error, headers, key and value")
    add_config_arg(show)
    show.add_argument("id", type=int)
    show.set_defaults(handler=show_)
    rp = dsub.add_parser("replay", help="re-publish dead letters to their source topic, or re-apply them")
    add_config_arg(rp)
    rp.add_argument("ids", type=int, nargs="*", help="dead-letter ids (or --connector with --all)")
    rp.add_argument("--connector", help="with --all: every new dead letter of this connector")
    rp.add_argument("--all", action="store_true")
    rp.add_argument("--to", choices=("auto", "topic", "apply"), default="auto",
                    help="apply: run it through the connector's projection directly, then the events held behind "
                    "it (PostgreSQL projections only); topic: produce the record again to its source topic; auto "
                    "(default): apply for postgres-projection connectors, topic for the others")
    rp.add_argument("--value-file", type=Path, help="replace the value with this file's bytes (one id only)")
    rp.set_defaults(handler=replay)
    dc = dsub.add_parser("discard", help="mark dead letters as discarded (kept for the record); a projection's "
                         "dead letter that holds its row key back releases the events held behind it")
    add_config_arg(dc)
    dc.add_argument("ids", type=int, nargs="+")
    dc.set_defaults(handler=discard)


def _cfg(args: argparse.Namespace, need: tuple[str, ...] = ("postgres",)) -> tuple[config.KafoldConfig, Path]:
    loaded = config.load_file(args.config)
    return devstack.effective(loaded.config, need=need), loaded.base


COLUMNS = "id, connector, topic, partition, \"offset\", key, value, headers, error_class, error_message, reason, " \
          "status, created_at, replayed_at, hold_key"


def _rows(pgc: config.PostgresConfig, where: str, params: tuple[Any, ...], limit: int | None = None
          ) -> list[dict[str, Any]]:
    query = sql.SQL("SELECT " + COLUMNS + " FROM {} WHERE " + where + " ORDER BY id DESC").format(
        db.table(pgc, "dead_letters"))
    if limit is not None:
        query = sql.SQL("{} LIMIT {}").format(query, sql.Literal(limit))
    with db.connect(pgc, row_factory=dict_row) as conn:
        return list(conn.execute(query, params).fetchall())


def list_(args: argparse.Namespace) -> int:
    cfg, _ = _cfg(args)
    where, params = ["TRUE"], []
    if args.connector:
        where.append("connector = %s")
        params.append(args.connector)
    if args.status != "all":
        where.append("status = %s")
        params.append(args.status)
    rows = _rows(cfg.postgres, " AND ".join(where), tuple(params), args.limit)
    if args.json:
        print_json([{k: r[k] for k in ("id", "connector", "topic", "partition", "offset", "reason", "error_class",
                                       "error_message", "status", "hold_key", "created_at", "replayed_at")}
                    for r in rows])
        return 0
    table = Table("id", "connector", "record", "reason", "error", "status", "holds key", "created")
    for r in rows:
        # Text, not markup: a record's content is shown as it is, escaped, never interpreted by rich.
        cells = (str(r["id"]), r["connector"], f"{r['topic']}[{r['partition']}]@{r['offset']}", r["reason"],
                 f"{r['error_class'].rpartition('.')[2]}: {r['error_message'][:80]}", r["status"],
                 r["hold_key"] or "", r["created_at"].isoformat(timespec="seconds"))
        table.add_row(*(Text(visible(c)) for c in cells))
    Console().print(table)
    print(f"{len(rows)} dead letter(s)")
    return 0


def _text(value: bytes | None) -> str:
    """Bytes as a terminal may print them: UTF-8 with control characters escaped, else base64."""
    if value is None:
        return "(none)"
    try:
        return visible(bytes(value).decode("utf-8"))
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(bytes(value)).decode()


def show_(args: argparse.Namespace) -> int:
    cfg, _ = _cfg(args)
    rows = _rows(cfg.postgres, "id = %s", (args.id,))
    if not rows:
        raise KafoldError(f"no dead letter with id {args.id}")
    r = rows[0]
    for name in ("id", "connector", "topic", "partition", "offset", "status", "hold_key", "reason", "error_class",
                 "error_message", "created_at", "replayed_at"):
        print(f"{name:<14} {visible(r[name], lines=name == 'error_message')}")
    print("headers")
    for name, value in stored_headers(r["headers"]):
        print(f"  {visible(name)}: {_text(value)}")
    print(f"key            {_text(r['key'])}")
    print(f"value          {_text(r['value'])}")
    return 0


def _selected(args: argparse.Namespace, pgc: config.PostgresConfig) -> list[dict[str, Any]]:
    if args.ids:
        rows = _rows(pgc, "id = ANY(%s)", (args.ids,))
        missing = sorted(set(args.ids) - {r["id"] for r in rows})
        if missing:
            raise KafoldError(f"no dead letter with id {', '.join(map(str, missing))}")
    elif getattr(args, "all", False) and args.connector:
        rows = _rows(pgc, "connector = %s AND status = %s", (args.connector, DeadLetterStatus.NEW.value))
    else:
        raise KafoldError("name dead-letter ids, or --connector NAME --all")
    if getattr(args, "value_file", None) is not None and len(rows) != 1:
        raise KafoldError("--value-file replaces one record's value: name exactly one id")
    return sorted(rows, key=lambda r: (r["topic"], r["partition"], r["offset"]))


def replay(args: argparse.Namespace) -> int:
    cfg, base = _cfg(args, ("postgres", "kafka") if args.to == "topic" else ("postgres",))
    rows = _selected(args, cfg.postgres)
    if args.value_file is not None:
        rows[0]["value"] = args.value_file.read_bytes()
    projections = _projections(cfg, base, {r["connector"] for r in rows}, args.config) if args.to != "topic" else {}
    if args.to == "apply":
        other = sorted({r["connector"] for r in rows} - set(projections))
        if other:
            raise KafoldError(f"connector(s) {', '.join(other)} are not postgres-projection connectors in the "
                              "configuration; replay them with --to topic")
    applied = 0
    by_topic = [r for r in rows if r["connector"] not in projections]
    if by_topic:
        holding = [r["id"] for r in by_topic if r["hold_key"] is not None and r["status"] in OPEN_STATUSES]
        if holding:
            raise KafoldError(f"dead letter(s) {', '.join(map(str, holding))} hold a projection's row key back: "
                              "re-published, they would land behind the events they hold; replay them with --to "
                              "apply (the default)")
        cfg = devstack.effective(cfg, need=("postgres", "kafka"))
        _to_topic(cfg, by_topic)
        _mark(cfg.postgres, [r["id"] for r in by_topic], DeadLetterStatus.REPLAYED)
        for r in by_topic:
            print(visible(f"#{r['id']} {r['topic']}[{r['partition']}]@{r['offset']}: re-published to the source "
                          "topic"))
        applied += len(by_topic)
    for name, release in projections.items():
        done: set[int] = set()
        with release:
            for r in rows:
                if r["connector"] != name or r["id"] in done:
                    continue
                value = r["value"] if args.value_file is not None else None
                for outcome in release.replay(r["id"], value):
                    done.add(outcome.id)
                    applied += outcome.applied
                    print(visible(outcome.line()))
    print(f"{len(rows)} dead letter(s) replayed: {applied} record(s) applied" +
          ("" if applied else "; nothing was applied"))
    return 0 if applied else 1


def _projections(cfg: config.KafoldConfig, base: Path, names: set[str], path: Path) -> dict[str, Any]:
    """A holds.Release per postgres-projection connector among `names` (the others are not in the result)."""
    by_name = {c.name: c for c in cfg.connectors}
    out: dict[str, Any] = {}
    # Dead letters keep protected fields sealed as they came: their replay opens them as the live intake does
    # (the placeholder once the subject is forgotten), never applies a stored clear value.
    protect.build(cfg)
    for name in sorted(names):
        settings = by_name.get(name)
        if settings is None or settings.connector_class != "postgres-projection":
            continue
        with config.python_path(cfg, base):
            connector = instantiate(settings, base)
            if not isinstance(connector, ProjectionConnector):
                continue
            pc = connector.config
            mapping = Mapping(pc, load_mapper(pc.mapper) if pc.mapper else None)
            upcaster = upcast.build(settings.upcasters, f"connector {name!r}")
        repair = f"kafold projection rebuild {name} -c {path}"
        out[name] = Release(cfg.postgres, name, pc, mapping, repair, upcaster, converter_for(settings, cfg.registry))
    return out


def _to_topic(cfg: config.KafoldConfig, rows: list[dict[str, Any]]) -> None:
    producer = kafka_clients.producer(cfg.kafka, **{"enable.idempotence": True, "acks": "all"})
    errors: list[str] = []
    for r in rows:
        # The source partitioner places the key as the original producer did (same key, same partition).
        headers: list[tuple[str, str | bytes | None]] = [*stored_headers(r["headers"])]
        producer.produce(r["topic"], key=r["key"], value=r["value"], headers=headers,
                         on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
    if producer.flush(30) or errors:
        raise KafoldError(f"re-publishing failed: {errors[:3] or 'not acknowledged within 30 s'}; nothing marked")


def _mark(pgc: config.PostgresConfig, ids: list[int], status: DeadLetterStatus) -> None:
    query = sql.SQL("UPDATE {} SET status = %s, replayed_at = CASE WHEN %s THEN now() "
                    "ELSE replayed_at END WHERE id = ANY(%s)").format(db.table(pgc, "dead_letters"))
    with db.connect(pgc) as conn:
        conn.execute(query, (status.value, status is DeadLetterStatus.REPLAYED, ids))


def discard(args: argparse.Namespace) -> int:
    cfg, base = _cfg(args)
    rows = _selected(args, cfg.postgres)
    holding = {r["connector"] for r in rows if r["hold_key"] is not None and r["status"] in OPEN_STATUSES}
    projections = _projections(cfg, base, holding, args.config)
    missing = sorted(holding - set(projections))
    if missing:
        raise ConfigError([f"connectors: {name!r} (whose dead letters hold row keys back) is not a postgres-projection "
                           "connector in the configuration" for name in missing])
    plain = [r for r in rows if r["connector"] not in projections]
    _mark(cfg.postgres, [r["id"] for r in plain], DeadLetterStatus.DISCARDED)
    for r in plain:
        print(visible(f"#{r['id']} {r['topic']}[{r['partition']}]@{r['offset']}: discarded (not applied)"))
    for name, release in projections.items():
        with release:
            for r in rows:
                if r["connector"] == name:
                    for outcome in release.discard(r["id"]):
                        print(visible(outcome.line()))
    print(f"{len(rows)} dead letter(s) discarded")
    return 0
