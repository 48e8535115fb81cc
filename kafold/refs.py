"""The object a `module:attr` reference names (connector classes, mappers, effect functions, generators)."""

from __future__ import annotations

import importlib
from typing import Any


def import_ref(ref: str) -> Any:
    """The object `ref` (`module:attr`) names; LookupError naming `ref` and what is missing: the module (with the
    import's own error) or the attribute."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise LookupError(f"{ref!r}: cannot import module {module_name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise LookupError(f"{ref!r}: module {module_name!r} has no {attr!r}") from None
