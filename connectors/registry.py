"""Finds connector classes: entry points in group `kafold.connectors`, or a `module:Class` reference."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kafold.connectors.api import Connector
from kafold.errors import ConfigError
from kafold.refs import import_ref
from kafold.schema import Problems, is_missing, load

if TYPE_CHECKING:
    from kafold.config import ConnectorConfig

GROUP = "kafold.connectors"


def available() -> list[str]:
    """Names of the installed connectors (entry points in group `kafold.connectors`), sorted."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def resolve(name: str) -> type[Connector[Any]]:
    """The Connector class for an entry point name or `module:Class`; LookupError when there is none."""
    if ":" in name:
        try:
            obj = import_ref(name)
        except LookupError as e:
            raise LookupError(f"connector class {e}") from e
    else:
        matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
        if not matches:
            raise LookupError(f"unknown connector {name!r} (no entry point {name!r} in group {GROUP!r} "
                              "and not a `module:Class` reference)")
        try:
            obj = matches[0].load()
        except Exception as e:  # a broken plugin must not take down validation of the others
            ref = matches[0].value
            raise LookupError(f"connector {name!r}: entry point {ref!r} failed to load: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, Connector)):
        raise LookupError(f"connector class {name!r} is not a subclass of kafold.connectors.api.Connector")
    if not hasattr(obj, "config_class") or not hasattr(obj, "task_class"):
        raise LookupError(f"connector class {name!r} must define config_class and task_class")
    return obj


def instantiate(settings: ConnectorConfig, base: Path, where: str = "connector") -> Connector[Any]:
    """Resolve and construct the connector of `settings`, validating its config (ConfigError lists all)."""
    problems = Problems(str(base))
    try:
        cls = resolve(settings.connector_class)
    except LookupError as e:
        raise ConfigError([f"{where}.class: {e}"]) from e
    config = load(cls.config_class, settings.config, f"{where}.config", problems, base)
    if problems.items or is_missing(config):
        raise ConfigError(problems.items or [f"{where}.config: invalid"])
    return cls(settings, config)
