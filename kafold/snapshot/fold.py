"""A snapshot run's side of the one fold (kafold.fold): an aggregate's domain, and states on top of base snapshots.

Offset note: a base snapshot covering offset `o` gives its aggregate's entry `covered = o`: the Folder skips the
aggregate's events below `o` (already in the state) unread, and the snapshots written at `end` cover up to `end`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kafold import logs, protect
from kafold.config import AggregateConfig, FoldErrorPolicy
from kafold.domain import AggregateDomain
from kafold.envelope import epoch_ms, utc_now
from kafold.errors import ConfigError
from kafold.fold import UNSET, Folder
from kafold.snapshot.record import Encoded, Encoder, Snapshot
from kafold.snapshot.select import Identity

log = logs.get(__name__)


@dataclass(frozen=True)
class Domain:
    """initial / evolve and the payload and state conversions of one aggregate type, as the daemon loads them.

    Built by `kafold.domain.AggregateDomain.load`, the one loader: `EVENT_TYPES` found by the same rules (the evolve
    module's, else the decide module's; without one, events are dicts with their `type`), and the state stored as
    JSON through the evolve module's `state_to_json` / `state_from_json` when it defines them, otherwise a dataclass
    state through its fields and anything else as is. So a snapshot run folds exactly what the runtime folds.
    """

    identity: Identity
    initial: Callable[[], Any]
    evolve: Callable[[Any, Any], Any]
    event: Callable[[str, dict[str, Any], int], Any]  # a stored event's type, payload, schema version -> domain
    to_json: Callable[[Any], Any]
    from_json: Callable[[Any], Any]
    window_ms: int = 86_400_000  # the aggregate's idempotency window, which snapshots carry
    on_fold_error: FoldErrorPolicy = FoldErrorPolicy.STOP
    # Protected fields (kafold.protect): events opened by the one fold's hook; states sealed by `identity.sealer`
    unseal: Callable[[str, str, dict[str, Any]], dict[str, Any]] | None = None

    @classmethod
    def load(cls, agg: AggregateConfig, python_path: Sequence[str] = (),
             protector: protect.Protector | None = None) -> Domain:
        """`protector`: the caller's (kafold.protect.build of its configuration), needed by aggregates with
        protected fields."""
        d = AggregateDomain.load(agg, tuple(python_path)).protected(protector)
        if agg.protect and d.unseal is None:
            raise ConfigError([f"aggregates.{agg.name}.protect: no key ring was handed to the aggregate's snapshot "
                               "domain (Domain.load(..., protector=kafold.protect.build(cfg)))"])
        ident = Identity(agg.name, d.fingerprint, agg.state_schema_version,
                         protect.state_sealer(d.protector, agg.name))
        return cls(ident, d.initial, d.evolve, d.codec.event, d.state_to_json, d.state_from_json,
                   int(agg.idempotency_window_s * 1000), agg.on_fold_error, d.unseal)


def _window(commands: Any) -> dict[str, list[int]]:
    return {c[0]: [c[1], c[2], c[3]] for c in commands}


# The most command ids one snapshot record carries: its value stays well under Kafka's default 1 MB record limit.
# A busier aggregate's snapshot carries the newest ids and a marker ["", t, 0, 0] saying ids decided before t are
# not carried; a restore reads them back from the events partition (daemon/aggregates/recovery.note_events).
MAX_SNAPSHOT_COMMANDS = 8000
SEAL_BATCH = 20_000  # sealed states: their subjects' keys looked up this many at a time (kafold.protect.prefetch)


def _commands(window: dict[str, list[int]], window_ms: int) -> list[list[Any]]:
    """A snapshot's `commands`: the window's ids within `window_ms` of the aggregate's latest command time."""
    if not window:
        return []
    cutoff = max(w[0] for w in window.values()) - window_ms
    kept: list[list[Any]] = [[cid, *w] for cid, w in window.items() if w[0] >= cutoff]
    if len(kept) <= MAX_SNAPSHOT_COMMANDS:
        return kept
    kept.sort(key=lambda c: c[1])
    newest = kept[-MAX_SNAPSHOT_COMMANDS:]
    return [["", newest[0][1], 0, 0], *newest]


class Held:
    """One aggregate in a snapshot run: its state (UNSET until first needed: then built from `base`, its snapshot's
    state JSON, or `initial()`), version, the offset its base covers, the version it started from, and its
    idempotency window (command id -> [command time ms, version after, events])."""

    __slots__ = ("base", "covered", "since", "state", "version", "window")

    def __init__(self, version: int = 0, covered: int = 0, base: Any = None,
                 window: dict[str, list[int]] | None = None) -> None:
        self.state: Any = UNSET
        self.version, self.covered, self.base, self.since = version, covered, base, version
        self.window: dict[str, list[int]] = window if window is not None else {}


class Tail:
    """A Folder's `States` for a snapshot run: aggregates folded on top of base snapshots, and the snapshots they
    give at the end of the run."""

    def __init__(self, domain: Domain, bases: dict[bytes, Snapshot] | None = None) -> None:
        self.domain = domain
        self.entries: dict[str, Held] = {
            key.decode(): Held(s.version, s.offset, s.state, _window(s.commands)) for key, s in (bases or {}).items()}

    # ---- States (what the Folder calls) -------------------------------------------------------------------
    def new(self, aggregate_id: str) -> Held:
        return Held()

    def add(self, aggregate_id: str, entry: Held) -> None:
        self.entries[aggregate_id] = entry

    def thaw(self, entry: Held) -> Any:
        return self.domain.initial() if entry.base is None else self.domain.from_json(entry.base)

    def note(self, entry: Held, aggregate_id: str, cause: str, occurred_at: Any, version: int, event_id: Any) -> None:
        seen = entry.window.get(cause)
        if seen is None:
            entry.window[cause] = [epoch_ms(occurred_at), version, 1]
        else:
            seen[1] = version
            seen[2] += 1

    # ---- results ------------------------------------------------------------------------------------------
    def state(self, aggregate_id: str) -> Any:
        """The domain state of one aggregate (converting a base snapshot's JSON on first use)."""
        entry = self.entries[aggregate_id]
        if entry.state is UNSET:
            entry.state = self.thaw(entry)
        return entry.state

    def states(self) -> dict[str, tuple[Any, int]]:
        """Every aggregate with at least one event folded: id -> (domain state, version)."""
        return {aid: (self.state(aid), e.version) for aid, e in self.entries.items() if e.version > 0}

    def snapshots(self, partition: int, end: int, refresh_lag: int | None = None) -> Iterator[Snapshot]:
        """Snapshots at `end` for aggregates changed by this fold (and for unchanged ones whose snapshot lags
        `end` by more than `refresh_lag` offsets: same state and version, moved forward, which is still true
        because they have no events in between)."""
        ident, created_at = self.domain.identity, utc_now()  # one time for the run
        for aid, state_json, version, commands in self._due(end, refresh_lag):
            yield Snapshot(ident.aggregate_type, aid, state_json, version, partition, end,
                           ident.fingerprint, ident.state_schema_version, created_at, "", commands)

    def encoded_snapshots(self, partition: int, end: int, refresh_lag: int | None = None) -> Iterator[Encoded]:
        """`snapshots(...)` as the (key, value, headers) records to produce (`Snapshot.encode`'s bytes)."""
        ident = self.domain.identity
        encoder = Encoder(ident.aggregate_type, partition, end, ident.fingerprint, ident.state_schema_version,
                          utc_now())
        encode = encoder.encode
        for aid, state_json, version, commands in self._due(end, refresh_lag):
            yield encode(aid, state_json, version, commands)

    def _due(self, end: int, refresh_lag: int | None) -> Iterator[tuple[str, Any, int, list[list[Any]]]]:
        to_json, window_ms = self.domain.to_json, self.domain.window_ms
        sealer, atype = self.domain.identity.sealer, self.domain.identity.aggregate_type
        ids = list(self.entries) if sealer is not None else []
        for n, (aid, e) in enumerate(self.entries.items()):
            if sealer is not None and n % SEAL_BATCH == 0:  # the next keys in one round trip (not one each)
                sealer.prefetch([i.encode() for i in ids[n:n + SEAL_BATCH]])
            if e.version > e.since:
                state = to_json(e.state)
            elif refresh_lag is not None and e.base is not None and end - e.covered > refresh_lag:
                state = e.base
            else:
                continue
            if sealer is not None:  # personal data never in clear on the snapshot topic (kafold.protect)
                state = sealer.seal_state(atype, aid, state)
            yield aid, state, e.version, _commands(e.window, window_ms)


def folder(domain: Domain, bases: dict[bytes, Snapshot] | None = None, partition: int | None = None
           ) -> Folder[Tail]:
    """The Folder of one events partition in a snapshot run, on top of `bases` (key -> usable snapshot)."""
    return Folder(domain, Tail(domain, bases), partition)


def log_bad(folder: Folder[Tail], partition: int) -> None:
    """Events parked under `on_fold_error = "dead-letter"` (the runtime dead-letters them; a run leaves them out)."""
    if folder.bad:
        log.warning("snapshot.events_left_out", aggregate=folder.held.domain.identity.aggregate_type,
                    partition=partition, events=folder.bad, policy=str(folder.on_error),
                    first=[p.error.describe() for p in folder.parked[:3]])
