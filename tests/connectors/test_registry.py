"""The connector registry: entry points and `module:Class` references, with clear errors otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafold.config import ConnectorConfig
from kafold.connectors.log import LogSinkConnector
from kafold.connectors.registry import available, instantiate, resolve
from kafold.errors import ConfigError


def test_the_builtin_log_connector_is_an_installed_entry_point() -> None:
    assert "log" in available()
    assert resolve("log") is LogSinkConnector


def test_a_module_class_reference_resolves() -> None:
    assert resolve("kafold.connectors.log:LogSinkConnector") is LogSinkConnector


@pytest.mark.parametrize(("ref", "message"), [
    ("nope", "unknown connector 'nope'"),
    ("no_such_module_x:Thing", "cannot import module"),
    ("kafold.connectors.log:Missing", "has no 'Missing'"),
    ("kafold.connectors.log:LogSinkTask", "not a subclass"),
])
def test_unknown_references_raise_lookup_error_saying_why(ref: str, message: str) -> None:
    with pytest.raises(LookupError, match=message):
        resolve(ref)


def test_instantiate_validates_the_connector_config_naming_the_key() -> None:
    settings = ConnectorConfig(name="c", connector_class="log", topics=["t"], config={"level": "loud"})
    with pytest.raises(ConfigError, match=r"connector\.config\.level: 'loud' is not one of"):
        instantiate(settings, Path("."))
