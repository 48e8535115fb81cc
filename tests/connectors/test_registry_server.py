"""`kafold dev up --registry`'s registry: started once per state dir (a second `up` finds it), reachable on its
Confluent-compatible API, stopped by `down` leaving no process."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from kafold.tools.dev import registry_server

pytestmark = pytest.mark.integration


def test_the_dev_registry_starts_once_serves_and_stops(tmp_path: Path) -> None:
    url = registry_server.dev_up(tmp_path)
    try:
        assert registry_server.dev_up(tmp_path) == url  # idempotent: the running one
        with urllib.request.urlopen(f"{url}/subjects", timeout=10) as r:
            assert json.loads(r.read()) == []
        pid = json.loads((tmp_path / "registry" / registry_server.DEV_FILE).read_text())["pid"]
    finally:
        assert registry_server.dev_down(tmp_path) is True
    assert not registry_server._alive(pid)
    assert registry_server.dev_url(tmp_path) is None
    assert registry_server.dev_down(tmp_path) is False
