"""After a re-apply of the erasure log deleted keys: those subjects' rows folded again in every projection of
protected fields.

A database restored from a backup made before a forget holds the forgotten subjects' keys (deleted again by the
re-apply, kafold.erasure_log) and the backup's projection rows, made with those keys: clear values. The re-apply
returns the subjects whose keys it deleted; each `postgres-projection` that folds an event type with a protect rule
gets one `Refresh` of all of them (subject_refresh.py: one read of its topics, then exactly those rows replaced under
the live table's lock, so it runs safely beside the live connector). Run by the daemon at start and by
`kafold db upgrade`. A projection that fails is logged with the command that does the same by hand (a rebuild: it
needs no subject list, which no log line holds) and the next one is refreshed; nothing here raises.

Note on offsets: a refresh commits nothing to Kafka and moves no live checkpoint (scratch.py); the rows it replaces
hold exactly the events below the live checkpoints read under the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from kafold import db, logs
from kafold.config import KafoldConfig
from kafold.connectors.projection import rebuild as rb
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.subject_refresh import Refresh, Refreshed, protected_types
from kafold.protect import Protector

__all__ = ["PROJECTION_CLASS", "refresh_restored"]

log = logs.get(__name__)
PROJECTION_CLASS = "postgres-projection"
PROGRESS_S = 10.0  # at most one progress line per projection this often: a long history logs steadily, not per batch


def refresh_restored(cfg: KafoldConfig, base: Path, subjects: Collection[str], protector: Protector | None, *,
                     stop: threading.Event | None = None, config_file: str = "FILE") -> list[Refreshed]:
    """Refresh the rows of `subjects` in each projection of protected fields in `cfg`, read with `protector` (the
    caller's, kafold.protect.build of `cfg`); the results of those that ran (failures logged as
    `protect.restored_refresh_failed` with the command to run by hand, `config_file` in it)."""
    if not subjects or protector is None or not protector.rules:
        return []
    done: list[Refreshed] = []
    for settings in cfg.connectors:
        if settings.connector_class != PROJECTION_CLASS or (stop is not None and stop.is_set()):
            continue
        name = settings.name
        by_hand = f"kafold projection rebuild {name} -c {config_file}"
        started = time.monotonic()
        try:
            plan = rb.plan(cfg, base, name, protector)
            if not protected_types(plan.mapping, protector):
                continue
            if not _exists(plan):  # not created yet (its connector never ran on this database): no row to refresh
                log.info("protect.restored_refresh_skipped", projection=name, reason="its table does not exist")
                continue
            log.info("protect.restored_refresh_started", projection=name, subjects=len(subjects))
            result = Refresh(plan, subjects, on_progress=_progress(name), stop=stop).run()
        except Exception as e:  # any failure: this projection's rows stay as restored; the others are still tried
            log.error("protect.restored_refresh_failed", projection=name, error_class=type(e).__name__,
                      error=str(e), hint=f"its restored rows may still hold forgotten subjects' values: run "
                      f"`{by_hand}`")
            continue
        seconds = round(time.monotonic() - started, 3)
        if not result.completed:
            log.warning("protect.restored_refresh_stopped", projection=name, events=result.events, seconds=seconds,
                        hint=f"stopped before the rows were replaced: run `{by_hand}`")
        elif result.held:
            log.warning("protect.restored_refresh_held", projection=name, rows=result.rows, held=result.held,
                        seconds=seconds, hint="rows held behind a dead letter were left as restored: replay or "
                        f"discard the dead letters (`kafold dlq list`), then run `{by_hand}`")
        else:
            log.info("protect.restored_refreshed", projection=name, rows=result.rows, row_keys=result.keys,
                     events=result.events, seconds=seconds)
        done.append(result)
    return done


def _exists(plan: rb.Plan) -> bool:
    c = plan.config
    with db.connect(plan.pgc) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (q.regclass_text(c.schema, c.table),)).fetchone()
    return bool(row and row[0])


def _progress(name: str) -> Callable[[rb.Progress], None]:
    """A progress callback logging `protect.restored_refresh_progress` at most every PROGRESS_S."""
    last = [time.monotonic()]

    def report(p: rb.Progress) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_S:
            last[0] = now
            log.info("protect.restored_refresh_progress", projection=name, phase=p.phase, covered=p.done,
                     target=p.total, events=p.events)
    return report
