"""What may name a PostgreSQL schema, table or column in kafold's configuration (always quoted when used)."""

from __future__ import annotations

import re

IDENTIFIER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def check_identifier(name: str) -> str | None:
    """None if `name` may name a table, schema or column; else the reason."""
    if not isinstance(name, str) or not IDENTIFIER_RE.match(name):
        return (f"{name!r} is not a valid SQL identifier (letters, digits and '_', not starting with a digit, "
                "at most 63 characters)")
    return None
