"""The root exception of kafold and its two kinds that matter to a runtime: retriable and fatal."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

# A quoted literal in an error's text: 'single' (Python's own messages) or "double" (PostgreSQL's), doubled quotes
# inside allowed.
QUOTED = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"")


def redact_quoted(text: str, keep: Collection[str] = ()) -> str:
    """`text` with every quoted literal replaced by `"…"` but the names in `keep`: an error's message may quote the
    value it refused, which may be personal data (a protected field opened for the fold or the row)."""
    return QUOTED.sub(lambda m: m.group() if m.group()[1:-1] in keep else '"…"', text)


class KafoldError(Exception):
    """Root of every error kafold raises on purpose."""


class RetriableError(KafoldError):
    """A transient failure: back off and try the same work again (broker down, DB restarting)."""


class FatalError(KafoldError):
    """A failure retrying cannot fix: stop the task (or dead-letter the record, see RecordError)."""


class ConfigError(KafoldError):
    """The configuration is invalid; carries every problem found, each naming its key path and file."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class RecordError(FatalError):
    """A single record cannot be processed; carries the raw record so it can be dead-lettered.

    `raw` is the consumer message (or an equivalent object with topic/partition/offset/key/value/headers).
    """

    def __init__(self, message: str, *, raw: Any = None, reason: str = "invalid") -> None:
        super().__init__(message)
        self.raw = raw
        self.reason = reason


class DecodeError(RecordError):
    """The bytes of a record are not a valid kafold envelope (malformed, too large, too deep, wrong types)."""


class UnknownTypeError(RecordError):
    """A consumer does not handle this event type and its connector says to dead-letter it (`unknown-type`)."""
