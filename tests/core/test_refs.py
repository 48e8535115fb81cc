"""kafold.refs: a `module:attr` reference resolves, or fails naming the reference and the missing part."""

from __future__ import annotations

import pytest

from kafold.connectors.projection.mapping import load_mapper
from kafold.errors import ConfigError
from kafold.refs import import_ref
from kafold.retry import retrying


def test_a_reference_names_the_object() -> None:
    assert import_ref("kafold.retry:retrying") is retrying


@pytest.mark.parametrize(("ref", "message"), [
    ("no_such_module_x:f", r"'no_such_module_x:f': cannot import module 'no_such_module_x': No module named"),
    ("kafold.retry:missing", r"'kafold.retry:missing': module 'kafold.retry' has no 'missing'"),
])
def test_a_missing_module_or_attribute_is_named(ref: str, message: str) -> None:
    with pytest.raises(LookupError, match=message):
        import_ref(ref)
    with pytest.raises(ConfigError, match=f"mapper: cannot load {message}"):
        load_mapper(ref)
