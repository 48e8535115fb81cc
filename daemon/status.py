"""What GET /status reports: built once here, for its JSON (daemon/http.py) and for the status page (status_page.py)."""

from __future__ import annotations

from typing import Any

from psycopg import sql

from kafold import db, logs
from kafold.config import PostgresConfig
from kafold.connectors.dlq import OPEN_STATUSES
from kafold.daemon.aggregates.gate import STATUS_FIELDS
from kafold.daemon.hosting import Host
from kafold.daemon.rates import WINDOW_S

log = logs.get(__name__)

# Where an aggregate partition's state came from: the snapshot it restored (the events offset the snapshot covers;
# None: a full replay) and the offset its tail replay started at.
RESTORE_FIELDS = ("snapshot_version", "start", "events_replayed")
# A dead letter as /status shows it: where it came from and why in a word. Never its key, value, headers or error
# message: those quote what the record held (personal data among it); `kafold dlq show ID` has them.
DEAD_LETTER_FIELDS = ("id", "connector", "topic", "partition", "offset", "reason", "status", "created_at")
NEWEST_DEAD_LETTERS = 5
# /status must answer while PostgreSQL is away (`kafold status` gives up on the daemon after 3 s): a short connect
# and statement timeout, then the section says it is unavailable.
PG_TIMEOUT_S = 1


async def report(host: Host) -> dict[str, Any]:
    """The daemon's status: its partitions, effects, aggregates and offset accounting from memory, and the open dead
    letters from PostgreSQL (read in the executor) when a connector of the daemon uses it (else kafold's tables
    may not exist there: a daemon of log sinks keeps its dead letters in their DLQ topics only)."""
    body = from_memory(host)
    pgc = host.cfg.postgres
    if pgc.url and any(g.connector.uses_postgres for g in host.groups):
        body["dead_letters"] = await host.call(dead_letters, pgc)
    return body


def from_memory(host: Host) -> dict[str, Any]:
    """Everything /status reports that the daemon holds in memory (no I/O)."""
    rows = []
    for slot in host.slots:
        base = {"connector": slot.connector.name, "task": slot.task_id, "state": slot.state}
        snapshot = sorted(slot.runner.progress.snapshot.values(), key=lambda p: p.tp)
        if not snapshot:
            rows.append({**base, "topic": None, "partition": None})
        for p in snapshot:
            rows.append({**base, "topic": p.tp.topic, "partition": p.tp.partition, "committed": p.committed,
                         "position": p.position, "end_offset": p.high_watermark if p.high_watermark is not None
                         else p.listed_end, "lag": p.lag, "lag_seconds": round(p.lag_seconds(), 3),
                         "caught_up": p.caught_up})
    effects = [{"connector": slot.connector.name, "task": slot.task_id, **st} for slot in host.slots
               if "circuit" in (st := slot.runner.task_status)]
    # The offset accounting (daemon/accounting.py): every partition a task's runner has seen records of.
    accounting = [{"connector": slot.connector.name, "task": slot.task_id, **a.as_dict()}
                  for slot in host.slots for a in slot.runner.accounts.values()]
    aggregates = [{"aggregate": name, **{k: p.get(k) for k in (*STATUS_FIELDS, *RESTORE_FIELDS)}}
                  for name, slot in host.aggregates.items() for p in slot.runtime.partitions()]
    rates = host.rates.per_second()
    return {"source": "daemon", "worker_id": host.worker_id, "partitions": rows, "effects": effects,
            "aggregates": aggregates, "accounting": accounting,
            "rates": {"window_s": WINDOW_S,
                      "connectors": {k.partition(":")[2]: v for k, v in rates.items() if k.startswith("connector:")},
                      "aggregates": {k.partition(":")[2]: v for k, v in rates.items() if k.startswith("aggregate:")}}}


def dead_letters(pgc: PostgresConfig) -> dict[str, Any]:
    """Open (new or held) dead letters: the count per connector and the newest few, DEAD_LETTER_FIELDS only; or
    {"error": <class>} when PostgreSQL cannot be read (its message may name hosts: logged, not shown)."""
    table = db.table(pgc, "dead_letters")
    open_ = [s.value for s in OPEN_STATUSES]
    try:
        with db.connect(pgc, connect_timeout=PG_TIMEOUT_S,
                        options=f"-c statement_timeout={PG_TIMEOUT_S * 1000}") as conn:
            counts = conn.execute(sql.SQL("SELECT connector, count(*) FROM {} WHERE status = ANY(%s) "
                                          "GROUP BY connector ORDER BY connector").format(table), (open_,)).fetchall()
            newest = conn.execute(sql.SQL("SELECT {} FROM {} WHERE status = ANY(%s) ORDER BY id DESC LIMIT %s").format(
                sql.SQL(", ").join(map(sql.Identifier, DEAD_LETTER_FIELDS)), table),
                (open_, NEWEST_DEAD_LETTERS)).fetchall()
    except Exception as e:  # not reachable, not migrated yet: the rest of /status still answers
        log.warning("status.dead_letters_unavailable", error_class=type(e).__name__, error=str(e))
        return {"error": type(e).__name__}
    return {"open": {c: n for c, n in counts},
            "newest": [{**dict(zip(DEAD_LETTER_FIELDS, r, strict=True)), "created_at": r[-1].isoformat()}
                       for r in newest]}
