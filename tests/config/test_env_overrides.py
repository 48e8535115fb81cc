"""Every `KAFOLD_<SECTION>__<KEY>` reaches its key: the cases are generated from the configuration's own schema."""

from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any

import pytest

from kafold import config
from kafold.errors import ConfigError
from kafold.schema import Secret

MISSING = object()


def _override(tp: Any, default: Any, choices: Any) -> tuple[str, Any] | None:
    """A value differing from the default, as an environment string and as the loaded value; None for a type an
    environment string cannot carry (a table)."""
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if choices:
        pick = next(c for c in choices if c != default)
        return str(pick), pick
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        member = next(m for m in tp if m != default)
        return str(member.value), member
    if tp is bool:
        return ("false", False) if default else ("true", True)
    if tp is int:
        n = (default or 0) + 7
        return str(n), n
    if tp is float:
        x = (default or 0.0) + 0.5
        return str(x), x
    if typing.get_origin(tp) in (list, tuple):
        item = typing.get_args(tp)[0] if typing.get_args(tp) else str
        if dataclasses.is_dataclass(item):
            return None
        return "alpha,beta", ("alpha", "beta")
    if tp is str:
        return "env-override", "env-override"
    return None


def cases() -> list[tuple[str, str, Any, str, Any]]:
    out = []
    for section, cls in config.env_sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = f"KAFOLD_{section.upper()}__{f.name.upper()}"
            if f.metadata.get("secret"):
                out.append((section, f.name, name, "s3cret", Secret(f"env:{name}")))
                continue
            default = f.default if f.default is not dataclasses.MISSING else MISSING
            got = _override(hints[f.name], default, f.metadata.get("choices"))
            if got is not None:
                out.append((section, f.name, name, got[0], got[1]))
    return out


CASES = cases()


def test_every_section_that_is_a_table_is_reachable() -> None:
    """Not a hand-kept list: registry, privacy and tracing (once silently ignored) are among them."""
    assert {"kafka", "postgres", "daemon", "snapshots", "registry", "privacy", "tracing"} <= set(config.env_sections())
    assert len(CASES) > 50


@pytest.mark.parametrize(("section", "key", "var", "text", "expected"), CASES,
                         ids=[c[2] for c in CASES])
def test_override_reaches_its_key(section: str, key: str, var: str, text: str, expected: Any) -> None:
    try:
        loaded = config.parse("", Path("kafold.toml"), {var: text}).config
    except ConfigError as e:
        # the value reached its section and a check there refused it (a URL, a path, or a cross-check naming a
        # sibling key: a password without a user name), not the variable as unknown
        assert any(f"{section}." in p for p in e.problems), e.problems
        assert not any("environment" in p for p in e.problems), e.problems
        return
    assert getattr(getattr(loaded, section), key) == expected


def test_unknown_variables_are_reported_like_unknown_keys() -> None:
    env = {"KAFOLD_REGISTY__URL": "http://r", "KAFOLD_KAFKA__BOOTSTRAP": "k:9092", "KAFOLD_TEST_BROKER": "kafka"}
    with pytest.raises(ConfigError) as e:
        config.parse("", Path("kafold.toml"), env)
    problems = "\n".join(e.value.problems)
    assert "KAFOLD_REGISTY__URL: no section 'registy'; did you mean KAFOLD_REGISTRY__" in problems
    assert "KAFOLD_KAFKA__BOOTSTRAP: no key 'bootstrap' in [kafka]; did you mean KAFOLD_KAFKA__BOOTSTRAP_SERVERS?" \
        in problems
    assert "KAFOLD_TEST_BROKER" not in problems  # no `__`: not a configuration override


def test_a_secret_override_is_read_from_its_variable_not_copied() -> None:
    var = "KAFOLD_POSTGRES__PASSWORD"
    loaded = config.parse("", Path("kafold.toml"), {var: "hunter2"}).config
    assert loaded.postgres.password == Secret(f"env:{var}")
    assert "hunter2" not in repr(loaded)
