"""Choosing the usable snapshot per aggregate of one partition, and where the tail replay must start. Pure.

Offset note: the tail starts at the lowest offset any chosen snapshot covers; an aggregate with snapshot records
but none usable needs a full replay (start = the partition's first offset); aggregates with no snapshot at all
have no events below the latest run marker (see `record.Marker`), so without a marker the start is also the
partition's first offset. Events below a chosen snapshot's offset are skipped for that aggregate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kafold import logs
from kafold.errors import DecodeError
from kafold.protect import DecryptError, Forgotten
from kafold.snapshot import record
from kafold.snapshot.record import ChecksumError, Marker, Snapshot

log = logs.get(__name__)

# Metric: snapshot records rejected, by (aggregate type, reason); exported by whoever serves metrics.
REJECTED: Counter[tuple[str, str]] = Counter()

REASONS = ("corrupt", "checksum", "fingerprint", "schema", "ahead", "misplaced", "out-of-order", "forgotten",
           "sealed")


@dataclass(frozen=True)
class Identity:
    """The running fold that snapshots must come from."""

    aggregate_type: str
    fingerprint: str
    state_schema_version: int
    # Protected aggregates (kafold.protect.state_sealer): opens a sealed state; a snapshot it cannot open (a
    # forgotten subject, or a state not sealed) is not used, like a fingerprint mismatch.
    sealer: Any = field(default=None, compare=False)


@dataclass
class Selection:
    """The outcome for one partition: bases by aggregate id (bytes), where to start, and what was rejected."""

    partition: int
    low: int
    end: int
    bases: dict[bytes, Snapshot] = field(default_factory=dict)
    marker: Marker | None = None
    rejected: Counter[str] = field(default_factory=Counter)
    orphans: set[bytes] = field(default_factory=set)  # had snapshot records, none usable: full replay

    @property
    def start(self) -> int:
        floor = self.marker.offset if self.marker is not None else self.low
        if self.orphans:
            floor = self.low
        lowest = min((s.offset for s in self.bases.values()), default=floor)
        return max(self.low, min(floor, lowest))


class Selector:
    """Feed the snapshot partition's records in log order; `result()` gives the Selection.

    A record is rejected (never used, counted in REJECTED, warned about once per partition) when it does not
    decode, its checksum fails, its fingerprint or state schema version differs from the running fold, it is
    ahead of the events (offset past the partition's end, or a version no history below its offset can reach),
    or it is older than a usable snapshot already seen for the same aggregate (an out-of-order write): of the
    usable ones the highest (offset, version) wins, whatever the log order.
    """

    def __init__(self, identity: Identity, partition: int, low: int, end: int, *, end_final: bool = True) -> None:
        self.identity = identity
        self.sel = Selection(partition, low, end)
        self._first_rejected: dict[str, str] = {}
        # end_final False: `end` is a lower bound of the partition's end until `settle` gives it; records claiming
        # an offset past it wait here (in log order) to be judged then
        self._deferred: list[tuple[bytes | None, bytes | None, int | None]] | None = None if end_final else []

    def settle(self, low: int, end: int) -> Selector:
        """The partition's bounds are known (`end` is not below the one given at creation): judge the deferred
        records. The choice is what feeding every record with these bounds from the start gives, since it does
        not depend on the order records are fed in (an older snapshot fed before a deferred newer one is then
        replaced rather than counted as out-of-order)."""
        deferred, self._deferred = self._deferred or [], None
        self.sel.low, self.sel.end = low, end
        for key, value, offset in deferred:
            self.feed(key, value, offset)
        return self

    def _reject(self, reason: str, key: bytes | None, offset: int | None) -> None:
        self.sel.rejected[reason] += 1
        REJECTED[(self.identity.aggregate_type, reason)] += 1
        self._first_rejected.setdefault(reason, f"key={key!r} snapshot_offset={offset}")

    def _check(self, snap: Snapshot | Marker) -> str | None:
        ident = self.identity
        if snap.aggregate_type != ident.aggregate_type or snap.partition != self.sel.partition:
            return "misplaced"
        if snap.fingerprint != ident.fingerprint:
            return "fingerprint"
        if snap.state_schema_version != ident.state_schema_version:
            return "schema"
        if snap.offset > self.sel.end or (isinstance(snap, Snapshot) and snap.version > snap.offset):
            return "ahead"
        return None

    def feed(self, key: bytes | None, value: bytes | None, offset: int | None = None) -> None:
        if record.is_marker(key):
            self._feed_marker(key, value, offset)
            return
        try:
            snap = record.decode(key, value)
        except ChecksumError:
            self._orphan(key)
            self._reject("checksum", key, offset)
            return
        except DecodeError:
            self._orphan(key)
            self._reject("corrupt", key, offset)
            return
        assert key is not None  # decode checked that the key is the aggregate id
        if self._deferred is not None and snap.offset > self.sel.end:
            self._deferred.append((key, value, offset))
            return
        reason = self._check(snap)
        if reason is not None:
            self._orphan(key)
            self._reject(reason, key, offset)
            return
        best = self.sel.bases.get(key)
        if best is not None and (snap.offset, snap.version) < (best.offset, best.version):
            self._reject("out-of-order", key, offset)
            return
        if self.identity.sealer is not None:
            opened = self._open(snap, key, offset)
            if opened is None:
                return
            snap = opened
        self.sel.bases[key] = snap
        self.sel.orphans.discard(key)

    def _open(self, snap: Snapshot, key: bytes, offset: int | None) -> Snapshot | None:
        """The snapshot with its sealed state opened; None (rejected: the aggregate folds from its events, which
        give the placeholder) when its subject was forgotten or the state does not open."""
        try:
            state = self.identity.sealer.open_state(snap.aggregate_type, snap.aggregate_id, snap.state)
        except (Forgotten, DecryptError) as e:
            self._orphan(key)
            self._reject("forgotten" if isinstance(e, Forgotten) else "sealed", key, offset)
            return None
        return snap._replace(state=state)

    def _orphan(self, key: bytes | None) -> None:
        if key is not None and key not in self.sel.bases:
            self.sel.orphans.add(key)

    def _feed_marker(self, key: bytes | None, value: bytes | None, offset: int | None) -> None:
        try:
            marker = record.decode_marker(key, value)
        except ChecksumError:
            self._reject("checksum", key, offset)
            return
        except DecodeError:
            self._reject("corrupt", key, offset)
            return
        if self._deferred is not None and marker.offset > self.sel.end:
            self._deferred.append((key, value, offset))
            return
        reason = self._check(marker)
        if reason is not None:
            self._reject(reason, key, offset)
        elif self.sel.marker is None or marker.offset >= self.sel.marker.offset:
            self.sel.marker = marker

    def result(self) -> Selection:
        if self._deferred is not None:
            raise RuntimeError("Selector.result() before settle(): the partition's end is not known yet")
        sel = self.sel
        if sel.rejected:
            log.warning("snapshot.rejected", aggregate=self.identity.aggregate_type, partition=sel.partition,
                        reasons=dict(sel.rejected), first=self._first_rejected, full_replay=len(sel.orphans),
                        fallback="older snapshot or full replay")
        return sel


def select(identity: Identity, partition: int, low: int, end: int,
           records: Any) -> Selection:
    """Selection over an iterable of (key, value, offset) snapshot records in log order."""
    selector = Selector(identity, partition, low, end)
    for key, value, offset in records:
        selector.feed(key, value, offset)
    return selector.result()
