"""How an aggregate fold reads a stored event: through the envelope's fast decoder, with the fold's own tolerance.

Both folds (the runtime's recovery and the snapshot runs' `Folder`) read an event's fields with `fields`, so they
decode alike. The envelope's fast path (`envelope.peek_body`, msgspec in C) reads every event kafold wrote, faster
than parsing to a dict. When it declines, the body is read as plain JSON instead (`Loose`) and the fold's own checks
decide (version an integer, the domain building the event): the envelope's decoder is stricter (unknown fields,
version bounds, id lengths) than what a fold has always accepted, and an event once folded must stay foldable, or a
replay would come to a different state than the one the runtime decided commands on.
"""

from __future__ import annotations

from typing import Any

import orjson

from kafold.envelope import peek_body


class Loose:
    """The fields a fold reads from a JSON object the fast path declined (KeyError: a field the fold needs is
    missing; TypeError: not a JSON object). The optional ones are None when absent."""

    __slots__ = ("aggregate_id", "causation_id", "event_id", "occurred_at", "payload", "type", "version")

    def __init__(self, body: Any) -> None:
        self.aggregate_id, self.version = body["aggregate_id"], body["version"]
        self.type, self.payload = body["type"], body["payload"]
        self.causation_id, self.occurred_at = body.get("causation_id"), body.get("occurred_at")
        self.event_id = body.get("event_id")


def fields(value: bytes | None) -> Any:
    """An event body's fields as attributes (aggregate_id, version, type, payload, causation_id, occurred_at,
    event_id); raises (orjson.JSONDecodeError, KeyError, TypeError) when it is no event a fold can read.
    Integers beyond 64 bits in a payload read exactly on the fast path (the plain path rounds them to floats, as
    folds always did); kafold's own `encode` never writes them."""
    body = peek_body(value)
    return body if body is not None else Loose(orjson.loads(value))  # type: ignore[arg-type]
