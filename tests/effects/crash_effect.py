"""A python effect for the at-most-once crash test: appends each event id to a file; dies on a marked event."""

from __future__ import annotations

import os
import signal

from kafold.envelope import Event


def record(event: Event) -> None:
    if event.payload.get("crash"):
        os.kill(os.getpid(), signal.SIGKILL)  # the crash lands after the commit and before this effect
    with open(os.environ["KT_EFFECT_LOG"], "a", encoding="utf-8") as f:
        f.write(event.event_id + "\n")
