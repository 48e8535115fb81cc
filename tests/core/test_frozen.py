"""kafold.frozen.quick_init: the same construction as the dataclass's own __init__, the class still frozen."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from kafold.frozen import quick_init


def _pair() -> tuple[type, type]:
    """The same frozen dataclass twice: as the decorator makes it, and with quick_init."""

    def make() -> type:
        @dataclasses.dataclass(frozen=True, slots=True)
        class Value:
            name: str
            count: int = 3
            tags: list[str] = dataclasses.field(default_factory=list)
            note: str | None = None

            def __post_init__(self) -> None:
                if self.count < 0:
                    raise ValueError(f"count: must be >= 0, got {self.count}")

        return Value

    return make(), quick_init(make())


def test_quick_init_constructs_what_the_dataclass_constructs() -> None:
    plain, quick = _pair()
    assert str(inspect.signature(quick)) == str(inspect.signature(plain))
    for args, kwargs in (((("a",)), {}), (("a", 5), {}), (("a", 5, ["x"], "n"), {}), (("a",), {"note": "n"}),
                         ((), {"name": "b", "tags": ["y"]})):
        a, b = plain(*args, **kwargs), quick(*args, **kwargs)
        assert dataclasses.asdict(a) == dataclasses.asdict(b) and repr(a).split("(", 1)[1] == repr(b).split("(", 1)[1]
    first, second = quick("a"), quick("b")
    assert first.tags == [] and first.tags is not second.tags  # a default_factory called per instance
    with pytest.raises(TypeError):
        quick()  # a field without a default is required, as before
    with pytest.raises(ValueError, match="count"):
        quick("a", -1)  # __post_init__ still runs


def test_a_quick_init_class_stays_frozen() -> None:
    _, quick = _pair()
    value = quick("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.count = 4
    assert value == quick("a") and hash(quick("a", tags=None)) == hash(quick("a", tags=None))  # type: ignore[arg-type]


def test_quick_init_refuses_a_class_it_would_not_build_the_same() -> None:
    @dataclasses.dataclass
    class Mutable:
        name: str

    @dataclasses.dataclass(frozen=True, slots=True)
    class KeywordOnly:
        name: str = dataclasses.field(kw_only=True)

    for cls in (Mutable, KeywordOnly):
        with pytest.raises(TypeError, match="quick_init"):
            quick_init(cls)
