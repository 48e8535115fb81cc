"""The one vocabulary for where an event or a command failed, as Kafka Connect's `errors/Stage` is for a record.

The folder sets it on every FoldError, deciding a command sets it on the RecordError of a defect, and `kafold events
audit` counts by it. The reason strings users see in dead-letter headers are derived from it here, and only here,
so they stay what they have always been.
"""

from __future__ import annotations

import enum


class Stage(enum.StrEnum):
    """In the order an event goes through them when folded (then the stages only deciding a command has)."""

    DECODE = "decode"  # the record: its key, its bytes as an event body, its version, key and time
    UPCAST = "upcast"  # an upcaster step
    READ = "read"      # the payload into today's class: protected fields opened, an unknown type, a missing field
    FOLD = "fold"      # evolve raised
    DECIDE = "decide"  # decide raised or returned no list of events
    ENCODE = "encode"  # a decided event cannot be stored (written, sealed, read back)


FOLD_STAGES = (Stage.DECODE, Stage.UPCAST, Stage.READ, Stage.FOLD)  # what folding a stored event goes through

# A command refused as a defect: its dead-letter reason (the same since deciding was first dead-lettered).
_DECIDING = {Stage.DECIDE: "decide-error", Stage.FOLD: "evolve-error", Stage.ENCODE: "bad-event"}


def deciding_reason(stage: Stage) -> str:
    """The dead-letter reason of a command that failed in `stage` while deciding it."""
    return _DECIDING[stage]


def folding_reason(stage: Stage) -> str:
    """The dead-letter reason of a stored event parked in `stage` by a fold (on_fold_error = "dead-letter"): an
    upcaster's failure keeps UpcastError's reason, every other is a fold error."""
    return "upcast-failed" if stage is Stage.UPCAST else "fold-error"
