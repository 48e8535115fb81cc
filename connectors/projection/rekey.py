"""A Debezium key change applied as a re-key: the old row moves to the new key, TOASTed values included.

Debezium sends a primary-key UPDATE as a delete of the old key naming the new one (convert/rekey.py, payload field
NEW_KEY) and then a create of the new key, at the same log position; under REPLICA IDENTITY DEFAULT that create
carries the unavailable-value placeholder for each unchanged TOASTed column. So when the delete removes the old
row, the fold puts a copy of it under the new key, with the old row's version: the create (a higher version)
then applies over it and its placeholder columns keep the moved values.

Exactly once: the move is part of the delete's fold, written in the transaction that moves the checkpoint past the
delete; a create in a later batch (or after a kill -9 in between) finds the moved row in the table. A redelivered
delete is a duplicate or stale (its old key's row is gone), so it moves nothing. The copy never replaces a row the
new key already has (one read in this batch, or in the table: the upsert's version guard keeps the higher version),
nor one its tombstone says was deleted at or after this change.
"""

from __future__ import annotations

import dataclasses

from kafold.connectors.convert.rekey import NEW_KEY, aggregate_id_of
from kafold.connectors.projection.mapping import Mapping, MappingError, Row
from kafold.envelope import Event

Key = tuple[object, ...]


def moved(mapping: Mapping, event: Event, row: Row) -> tuple[Key, Row] | None:
    """The new key of a key change's delete and the old `row` moved there (its version kept); None for a delete
    that names no new key, or one whose key does not map (the create then starts the row without the TOASTed
    values, as before)."""
    new_key = event.payload.get(NEW_KEY)
    if type(new_key) is not dict:
        return None
    payload = {k: v for k, v in event.payload.items() if k != NEW_KEY}
    payload.update(new_key)
    try:
        key = mapping.key(dataclasses.replace(event, payload=payload, aggregate_id=aggregate_id_of(new_key)))
    except (MappingError, ValueError):
        return None
    out = dict(row)
    out.update(zip(mapping.key_columns, key, strict=True))
    return key, out
