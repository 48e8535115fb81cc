"""Debezium's key change: the new key a delete of the old key names in its `__debezium.newkey` header.

An UPDATE of a primary key comes from Debezium as a delete of the old key (header `__debezium.newkey`: the new key)
and a create of the new key (header `__debezium.oldkey`), both at the change's log position. Under REPLICA IDENTITY
DEFAULT the create carries the unavailable-value placeholder for an unchanged TOASTed column, whose value is only in
the projection's old row: the delete's event names the new key (payload field NEW_KEY) so that the projection moves
the old row to it before the create applies (projection/rekey.py).

The header is written by the worker's `header.converter`: Connect's default (SimpleHeaderConverter) writes the key
struct as JSON (`{"id":50}`, as seen from Connect 4.3.1 with Debezium 3.6.1); JsonConverter writes it with or
without its `{"schema", "payload"}` wrapper.
"""

from __future__ import annotations

from typing import Any

import orjson

NEW_KEY = "__debezium.newkey"  # the header, and the delete's payload field holding the new key (an object)


def aggregate_id_of(key: dict[str, Any]) -> str:
    """A Debezium key's aggregate id: its one value as text, several as sorted JSON."""
    return (str(next(iter(key.values()))) if len(key) == 1
            else orjson.dumps(key, option=orjson.OPT_SORT_KEYS).decode())


def parse_key(raw: str) -> Any:
    """The key a `__debezium.newkey` header holds (a JSON object, or a wrapper of one); None if it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
