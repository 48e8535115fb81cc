"""A python effect for the untranslatable-records test: records each event it ran; refuses those marked `fail`
(while FAILING is set) with an error quoting their note, NUL and terminal escapes included."""

from __future__ import annotations

from kafold.connectors.effects.policy import PermanentEffectError
from kafold.envelope import Event

RAN: list[Event] = []
FAILING = {"on": True}


def run(event: Event) -> None:
    if FAILING["on"] and event.payload.get("fail"):
        raise PermanentEffectError(f"refused: {event.payload.get('note')}")
    RAN.append(event)
