"""Config declared once, as frozen dataclasses: validation, secrets and docs all derive from the fields."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
import re
import stat
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_MISSING: Any = dataclasses.MISSING


def setting(
    default: Any = _MISSING,
    *,
    doc: str,
    secret: bool = False,
    choices: tuple[Any, ...] | None = None,
    minimum: float | None = None,
    factory: Any = _MISSING,
) -> Any:
    """Declare one config key: its default (none = required), a one-line doc, and its constraints.

    A `secret` key is never written literally: the file gives `<key>_env` (an environment variable)
    or `<key>_file` (a file, e.g. a systemd credential); the loaded value is a `Secret`.
    """
    meta = {"doc": doc, "secret": secret, "choices": choices, "minimum": minimum}
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if default is _MISSING and secret:
        default = None
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Secret:
    """A secret known by reference; `reveal()` reads it; repr and str never show the value."""

    source: str  # "env:NAME" or "file:/path"

    def reveal(self) -> str:
        kind, _, ref = self.source.partition(":")
        if kind == "env":
            return os.environ[ref]
        return Path(ref).read_text(encoding="utf-8").rstrip("\r\n")

    def __repr__(self) -> str:
        return f"Secret({self.source})"

    __str__ = __repr__


class Problems:
    """Collects every problem found while validating, each naming the file and key path."""

    def __init__(self, file: str, environ: Mapping[str, str] | None = None) -> None:
        self.file = file
        self.environ = os.environ if environ is None else environ  # where `<key>_env` references resolve
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{self.file}: {path}: {message}")

    def mentions(self, path: str) -> bool:
        """True when a problem was already reported for `path` or a key below it (`path_env`, `path.x`)."""
        head = f"{self.file}: {path}"
        return any(p.startswith(head) and p[len(head)] in ":._[" for p in self.items)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def describe(tp: Any) -> str:
    """A reader's name for a field type (used in errors and the generated reference)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return " | ".join(describe(a) for a in args if a is not type(None))
    if origin in (list, tuple):
        item = args[0] if args else Any
        if dataclasses.is_dataclass(item):
            return "array of tables"
        return f"array of {describe(item)}"
    if origin in (dict, Mapping) or tp is dict:
        return "table"
    if tp is Secret:
        return "secret reference"
    if dataclasses.is_dataclass(tp):
        return "table"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "string"
    return {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}.get(tp, str(tp))


def _check_secret_file(path: str, where: str, problems: Problems) -> Secret | None:
    p = Path(path)
    if not p.is_file():
        problems.add(where, f"secret file {path!r} does not exist")
        return None
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO) & ~stat.S_IRGRP:
        problems.add(where, f"secret file {path!r} is readable or writable by others (mode {oct(mode & 0o777)}); "
                     "chmod 600 or 640")
        return None
    return Secret(f"file:{path}")


def _secret(raw: Mapping[str, Any], key: str, path: str, problems: Problems, base: Path) -> Secret | None:
    env_key, file_key = f"{key}_env", f"{key}_file"
    if key in raw:
        problems.add(join(path, key), f"literal secrets are refused; use {env_key} = \"VAR\" or {file_key} = \"/path\"")
        return None
    if env_key in raw and file_key in raw:
        problems.add(join(path, key), f"give only one of {env_key} and {file_key}")
        return None
    if env_key in raw:
        var = raw[env_key]
        if not isinstance(var, str) or not var:
            problems.add(join(path, env_key), "expected the name of an environment variable")
            return None
        if var not in problems.environ:
            problems.add(join(path, env_key), f"environment variable {var} is not set")
            return None
        return Secret(f"env:{var}")
    if file_key in raw:
        ref = raw[file_key]
        if not isinstance(ref, str) or not ref:
            problems.add(join(path, file_key), "expected a file path")
            return None
        return _check_secret_file(str((base / ref) if not Path(ref).is_absolute() else Path(ref)),
                                  join(path, file_key), problems)
    return None


def _coerce(tp: Any, value: Any, where: str, problems: Problems, base: Path) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if value is None:
            return None
        return _coerce(inner[0], value, where, problems, base)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            problems.add(where, f"expected a table, got {type(value).__name__}")
            return _MISSING
        return load(tp, value, where, problems, base)  # type: ignore[arg-type]
    if origin in (list, tuple):
        item_tp = args[0] if args else Any
        if isinstance(value, str) and not dataclasses.is_dataclass(item_tp):
            value = [v.strip() for v in value.split(",") if v.strip()]  # from an environment override
        if not isinstance(value, list):
            problems.add(where, f"expected {describe(tp)}, got {type(value).__name__}")
            return _MISSING
        items = [_coerce(item_tp, v, f"{where}[{i}]", problems, base) for i, v in enumerate(value)]
        return tuple(items)
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            problems.add(where, f"expected a table, got {type(value).__name__}")
            return _MISSING
        return dict(value)
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            problems.add(where, f"{value!r} is not one of {', '.join(repr(m.value) for m in tp)}")
            return _MISSING
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            problems.add(where, f"expected a boolean, got {value!r}")
            return _MISSING
        return value
    if tp in (int, float):
        if isinstance(value, str):
            try:
                value = tp(value)
            except ValueError:
                pass
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if tp is int and isinstance(value, float):
            ok = False
        if not ok:
            problems.add(where, f"expected {describe(tp)}, got {value!r}")
            return _MISSING
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            problems.add(where, f"expected a string, got {value!r}")
            return _MISSING
        return value
    return value


def keys_of(cls: type) -> list[str]:
    """The keys a table may hold: its fields, with secrets spelled as <key>_env / <key>_file."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("secret"):
            out += [f"{f.name}_env", f"{f.name}_file"]
        else:
            out.append(f.name)
    return out


def load(cls: type[T], raw: Mapping[str, Any], path: str, problems: Problems, base: Path) -> T:
    """Validate `raw` against the dataclass `cls`; report every problem into `problems`.

    Returns an instance (with defaults for keys in error, so callers can keep validating)
    or _MISSING when a required key is missing or wrong.
    """
    allowed = keys_of(cls)
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key in allowed:
            continue
        secret_field = any(f.name == key and f.metadata.get("secret") for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        if secret_field:
            continue  # reported by _secret as a literal secret
        hint = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; allowed keys: {', '.join(sorted(allowed))}"
        problems.add(join(path, key), f"unknown key{suggestion}")
    values: dict[str, Any] = {}
    failed = False
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        where = join(path, f.name)
        meta = f.metadata
        if meta.get("secret"):
            values[f.name] = _secret(raw, f.name, path, problems, base)
            continue
        if f.name not in raw:
            if f.default is _MISSING and f.default_factory is _MISSING:
                problems.add(where, f"missing required key ({meta.get('doc', describe(hints[f.name]))})")
                failed = True
            continue
        before = len(problems.items)
        value = _coerce(hints[f.name], raw[f.name], where, problems, base)
        if value is _MISSING or len(problems.items) > before:
            failed = failed or (f.default is _MISSING and f.default_factory is _MISSING)
            continue
        choices = meta.get("choices")
        if choices and value not in choices:
            problems.add(where, f"{value!r} is not one of {', '.join(map(repr, choices))}")
            continue
        minimum = meta.get("minimum")
        if minimum is not None and isinstance(value, int | float) and value < minimum:
            problems.add(where, f"must be >= {minimum}, got {value!r}")
            continue
        values[f.name] = value
    if failed:
        return _MISSING
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        problems.add(path or "(top level)", str(e))
        return _MISSING


def is_missing(value: Any) -> bool:
    return value is _MISSING


def reference(cls: type, heading: str, depth: int = 3, *, shared: type | None = None,
              shared_note: str = "") -> list[str]:
    """Markdown rows documenting `cls` (docs/configuration.md); the keys `cls` inherits from `shared` are left
    out, with `shared_note` (a pointer to where `shared` is documented once) in their place."""
    hints = typing.get_type_hints(cls)
    lines = [f"{'#' * depth} `{heading}`", ""]
    if shared_note:
        lines += [shared_note, ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[type, str]] = []
    inherited = {f.name for f in dataclasses.fields(shared)} if shared is not None else set()
    for f in dataclasses.fields(cls):
        if f.name in inherited:
            continue
        tp = hints[f.name]
        if f.metadata.get("secret"):
            key = f"`{f.name}_env` / `{f.name}_file`"
            default = "—"
        else:
            key = f"`{f.name}`"
            if f.default is not _MISSING:
                default = "—" if f.default is None else f"`{toml_value(f.default)}`"
            elif f.default_factory is not _MISSING and dataclasses.is_dataclass(tp):
                default = "see below"  # a nested table: its keys have their own table
            elif f.default_factory is not _MISSING:
                default = f"`{toml_value(f.default_factory())}`"  # type: ignore[operator]
            else:
                default = "**required**"
        doc = f.metadata.get("doc", "")
        choices = f.metadata.get("choices")
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            choices = tuple(m.value for m in tp)
        if choices:
            doc += " One of " + ", ".join(f"`{c}`" for c in choices) + "."
        doc = doc.replace("|", "\\|")  # a bar inside a table cell (even in backticks) would split the cell
        lines.append(f"| {key} | {describe(tp)} | {default} | {doc} |")
        inner = typing.get_args(tp)[0] if typing.get_args(tp) else None
        if dataclasses.is_dataclass(tp):
            nested.append((tp, f"{heading}.{f.name}"))  # type: ignore[arg-type]
        elif inner is not None and inner is not Secret and dataclasses.is_dataclass(inner):
            nested.append((inner, f"{heading}.{f.name}[]"))  # type: ignore[arg-type]
    lines.append("")
    for sub, name in nested:
        lines += reference(sub, name, depth)
    return lines


def toml_value(value: Any) -> str:
    """A TOML inline value: strings in JSON's escaping (valid TOML basic-string escapes), keys bare when they can be."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)
