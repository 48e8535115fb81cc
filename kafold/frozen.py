"""Frozen dataclasses with slots built at the cost of plain ones: an __init__ that sets each field through its slot."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

C = TypeVar("C", bound=type)


class _Factory:
    """A field's default that stands for "call its default_factory" (shown as dataclasses shows it)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def quick_init(cls: C) -> C:
    """`cls` (a `@dataclass(frozen=True, slots=True)`) with its __init__ replaced by one of the same signature that
    sets each field through its slot's own setter. The dataclass's own calls `object.__setattr__` per field (the
    frozen class refuses its plain one): ~0.1 µs a field, twice the whole cost of a small value's construction, for
    values the aggregates' runtime makes per command (commands, decisions, results). The frozen class still refuses
    any later assignment; `__post_init__` runs as before. Applied under the dataclass decorator."""
    fields = dataclasses.fields(cls)
    if not cls.__dataclass_params__.frozen or "__slots__" not in cls.__dict__ or any(  # type: ignore[attr-defined]
            not f.init or f.kw_only for f in fields):
        raise TypeError(f"quick_init wants a frozen dataclass with slots and positional fields only: {cls.__name__}")
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    params, lines = [], []
    for i, f in enumerate(fields):
        namespace[f"set{i}"] = cls.__dict__[f.name].__set__
        if f.default is not dataclasses.MISSING:
            namespace[f"default{i}"] = f.default
            params.append(f"{f.name}=default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"factory{i}"] = f.default_factory
            params.append(f"{f.name}=_FACTORY")
            lines.append(f"    if {f.name} is _FACTORY:\n        {f.name} = factory{i}()\n")
        else:
            params.append(f.name)
        lines.append(f"    set{i}(self, {f.name})\n")
    if hasattr(cls, "__post_init__"):
        lines.append("    self.__post_init__()\n")
    # generated as dataclasses generates the __init__ it replaces: the fields spelled once, in the class
    exec(f"def __init__(self, {', '.join(params)}):\n{''.join(lines)}", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(cls.__dict__["__init__"].__annotations__)  # the signature the dataclass's own shows
    cls.__init__ = init  # type: ignore[misc]
    return cls
