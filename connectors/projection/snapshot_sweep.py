"""The sweep at the end of a completed Debezium snapshot: rows the snapshot did not read are deleted.

Debezium snapshots a table again when it has lost its offsets (a Connect worker killed before its first offset
flush, a new slot, `snapshot.mode` asking for it) and sends no delete for a row deleted before that snapshot. Every
row the snapshot reads carries the snapshot's log position as its version, and the projection's version column
keeps the position of a row's last change; so when the snapshot's last record arrives (the converter marks it:
SNAPSHOT_END), the rows still older than that position are the ones the source no longer has. They go in the
transaction of the batch holding that record — the rows this batch has loaded here, in the fold (each leaving a
tombstone just below the snapshot's position when deduplicating by version), the rest with one `DELETE … WHERE
_kafold_version < position` (sql.delete_older) — so the sweep happens once with the checkpoint that passes it, and
doing it again after a crash deletes nothing more. A row changed after the snapshot started has a higher version and
stays. It needs the projection to hold one source table (the positions are the whole database's: see
`snapshot_sweep` in [connectors.convert]) on one partition, Debezium's default: with several, a snapshot's reads in
a partition behind the one holding its last record are applied after the sweep (they re-create their rows), and a
change older than the snapshot still to come there could bring back a row swept from the table alone.
"""

from __future__ import annotations

from typing import Any

from kafold.connectors.convert.api import SNAPSHOT_END
from kafold.connectors.projection.config import VERSION_COLUMN
from kafold.envelope import Event

Key = tuple[Any, ...]


def ends_snapshot(event: Event) -> bool:
    """`event` is the last record of a completed snapshot that the converter marked for a sweep."""
    return event.payload.get(SNAPSHOT_END) is True


def sweep(state: dict[Key, Any], below: int, gone: dict[Key, int] | None, buried: dict[Key, int]) -> None:
    """Remove from `state` each row older than `below` (in place); deduplicating by version (`gone` given), each
    leaves a tombstone just below the snapshot: no change older than it brings the row back, and a read of the same
    snapshot delivered later (another partition) still applies."""
    for key, row in state.items():
        if row is not None and (row.get(VERSION_COLUMN) or 0) < below:
            state[key] = None
            if gone is not None:
                gone[key] = buried[key] = max(below - 1, gone.get(key, 0))
