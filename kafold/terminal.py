"""Producer-chosen text made safe for a terminal: every control character shown escaped, never acted on."""

from __future__ import annotations

import re

# C0 controls (ESC among them), DEL, C1 controls, the line and paragraph separators and the bidirectional overrides
# and isolates (what a terminal acts on: titles, screen clears, cursor moves; or what reorders the text a reader
# sees), and lone surrogates (which a UTF-8 terminal stream cannot even encode).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNSAFE_KEEPING_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: object, *, lines: bool = False) -> str:
    """`text` (str() of it) with each control character as a visible escape (ESC as `\\x1b`); `lines=True` keeps
    newlines and tabs (a multi-line error message), otherwise they are escaped too (one field, one line)."""
    s = text if isinstance(text, str) else str(text)
    return (_UNSAFE_KEEPING_LINES if lines else _UNSAFE).sub(_escaped, s)
