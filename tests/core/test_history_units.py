"""The history's pure parts: offsets split into runs, and the HTTP query parameters checked."""

from __future__ import annotations

import pytest

from kafold.daemon.aggregates.history import page_query, version_query
from kafold.history import MAX_LIMIT, runs


def test_offsets_close_together_are_one_run_and_far_apart_are_sought() -> None:
    assert runs([40, 1, 3, 1000, 1010], gap=64) == [[1, 3, 40], [1000, 1010]]
    assert runs([], gap=64) == []


def test_page_and_version_parameters_are_bounded_and_named_when_wrong() -> None:
    assert page_query({}) == (1, 100)
    assert page_query({"from_version": "7", "limit": str(MAX_LIMIT)}) == (7, MAX_LIMIT)
    for bad, name in (({"limit": "0"}, "limit"), ({"limit": str(MAX_LIMIT + 1)}, "limit"),
                      ({"from_version": "x"}, "from_version"), ({"from_version": "0"}, "from_version")):
        with pytest.raises(ValueError, match=name):
            page_query(bad)
    assert version_query({}) is None and version_query({"version": "3"}) == 3
    with pytest.raises(ValueError, match="version"):
        version_query({"version": "-1"})
