"""The daemon's history reads: `GET /aggregates/{name}/{id}/events` (paged) and `GET /aggregates/{name}/{id}?version=N`.

Any instance answers them, whoever owns the key's partition: they read the events topic (read_committed) and the
history index in PostgreSQL (kafold.history), never the runtime's states, so no read is sent on to the owner.
One History per aggregate, made on first use and used by one request at a time (its Kafka readers and index
connection are not shared by threads); the requests run in the host's executor.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from kafold import logs
from kafold.config import KafoldConfig, python_path
from kafold.daemon.aggregates.routing import Answer
from kafold.errors import KafoldError, RetriableError
from kafold.event_index import IndexUnavailable
from kafold.fold import FoldError
from kafold.history import DEFAULT_LIMIT, MAX_LIMIT, History, NotFound
from kafold.snapshot.fold import Domain

if TYPE_CHECKING:
    from kafold.daemon.tasks import AggregateSlot
    from kafold.protect import Protector

log = logs.get(__name__)


def _number(query: Any, name: str, default: int, low: int, high: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw[:40]!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name}: expected {low}..{high}, got {value}")
    return value


def page_query(query: Any) -> tuple[int, int]:
    """(from_version, limit) of `?from_version=N&limit=L`; ValueError naming the bad parameter."""
    return _number(query, "from_version", 1, 1, 2**62), _number(query, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)


def version_query(query: Any) -> int | None:
    """`?version=N` (None when absent); ValueError when it is no version."""
    return None if query.get("version") is None else _number(query, "version", 1, 1, 2**62)


class Histories:
    """The host's history readers, one per aggregate (see the module docstring)."""

    def __init__(self, cfg: KafoldConfig, base: Path, protector: Protector | None) -> None:
        self.cfg, self.base, self.protector = cfg, base, protector
        self.made: dict[str, tuple[History, threading.Lock]] = {}
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            for made, _ in self.made.values():
                made.close()
            self.made.clear()

    def _history(self, slot: AggregateSlot) -> tuple[History, threading.Lock]:
        with self.lock:
            got = self.made.get(slot.name)
            if got is None:
                cfg = self.cfg
                if not cfg.postgres.url:
                    raise IndexUnavailable("the history index needs [postgres] (url)")
                domain = Domain.load(slot.config, python_path(cfg, self.base).paths, self.protector)
                got = self.made[slot.name] = (History(cfg.kafka, cfg.postgres, slot.config, domain), threading.Lock())
            return got

    def page(self, slot: AggregateSlot, aggregate_id: str, from_version: int, limit: int) -> Answer:
        def read(h: History) -> Answer:
            page = h.events(aggregate_id, from_version, limit)
            body: dict[str, Any] = {"aggregate": slot.name, "id": aggregate_id, "partition": page.partition,
                                    "events": page.events, "next": None}
            if page.next_version is not None:
                body["next"] = (f"/aggregates/{quote(slot.name, safe='')}/{quote(aggregate_id, safe='')}/events?"
                                + urlencode({"from_version": page.next_version, "limit": limit}))
            return Answer(200, body, {})
        return self._answer(slot, read)

    def state(self, slot: AggregateSlot, aggregate_id: str, version: int) -> Answer:
        def read(h: History) -> Answer:
            state, at = h.state_at(aggregate_id, version)
            return Answer(200, {"aggregate": slot.name, "id": aggregate_id, "version": at,
                                "state": h.domain.to_json(state), "read_from": "history",
                                "partition": h.partition_of(aggregate_id)}, {})
        return self._answer(slot, read)

    def _answer(self, slot: AggregateSlot, read: Any) -> Answer:
        """`read(history)` under the aggregate's lock, its errors as answers."""
        try:
            history, lock = self._history(slot)
            with lock:
                answer: Answer = read(history)
                return answer
        except NotFound as e:
            return Answer.problem(404, str(e))
        except IndexUnavailable as e:
            return Answer.problem(503, str(e))
        except RetriableError as e:
            return Answer.moving(f"the history cannot be read now: {e}")
        except FoldError as e:  # the one fold refuses an event: the same reason a replay would stop for
            return Answer.problem(422, e.describe())
        except KafoldError as e:
            log.warning("history.read_failed", aggregate=slot.name, error=str(e)[:400])
            return Answer.problem(500, str(e))
