"""The object a `module:attr` reference names (connector classes, mappers, effect functions, generators)."""

from __future__ import annotations

import importlib
from typing import Any


def import_ref(ref: str, *, callable_: bool = False) -> Any:
    """The object `ref` (`module:attr`) names; LookupError naming `ref` and what is missing: the module (with the
    import's own error), the attribute, or (`callable_`) a function where it names something else."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise LookupError(f"{ref!r}: cannot import module {module_name!r}: {e}") from e
    except Exception as e:  # the module's own code failed while importing: reported where it is named
        raise LookupError(f"{ref!r}: importing module {module_name!r} raised {type(e).__name__}: {e}") from e
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise LookupError(f"{ref!r}: module {module_name!r} has no {attr!r}") from None
    if callable_ and not callable(found):
        raise LookupError(f"{ref!r}: {attr!r} is not a function")
    return found
