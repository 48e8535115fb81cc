"""`kafold bench privacy`'s pure pieces: the daemon configurations of its protected pair load as kafold's own
(the same rules on one side, none on the other), and its OTLP sink accepts an export."""

from __future__ import annotations

import argparse
import base64
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kafold import protect
from kafold.config import KafoldConfig, load_file
from kafold.tools.bench.daemons import DaemonStack
from kafold.tools.bench.privacy import AGGREGATE, MASTER_VAR, otlp_sink, protect_toml, rules
from kafold.tools.bench.projection import daemon_toml


def _load(tmp_path: Path, extra: dict[str, Any]) -> KafoldConfig:
    stack = DaemonStack({"bootstrap_servers": "localhost:9092"}, {"url": "postgresql://localhost/kafold"}, {},
                        None, None, tmp_path)
    args = argparse.Namespace(batch=100, task_processes=True, tasks=1)
    path = tmp_path / "kafold.toml"
    path.write_text(daemon_toml(stack, "bench", "bench.events", "bench_t", args, None, extra))
    return load_file(str(path)).config


def test_protected_side_loads_the_bench_rules_with_task_processes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MASTER_VAR, base64.b64encode(os.urandom(32)).decode())
    cfg = _load(tmp_path, {**protect_toml(AGGREGATE, "bench.agg", True, True), "tracing": {"enabled": True}})
    assert protect.rules(cfg) == rules(AGGREGATE)
    assert cfg.daemon.task_processes is True
    assert cfg.privacy.master_key is not None and cfg.privacy.master_key.source == f"env:{MASTER_VAR}"
    assert cfg.tracing.enabled
    assert list(cfg.connectors[0].topics) == ["bench.events"]


def test_unprotected_side_is_the_same_daemon_without_rules(tmp_path: Path) -> None:
    cfg = _load(tmp_path, protect_toml(AGGREGATE, "bench.agg", False, False))
    assert protect.rules(cfg) == {}
    assert [a.name for a in cfg.aggregates] == [AGGREGATE]
    assert cfg.daemon.task_processes is False


def test_otlp_sink_accepts_and_counts() -> None:
    with otlp_sink() as sink:
        req = urllib.request.Request(f"{sink.url}/v1/traces", data=b"\x0a\x00", method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200
    assert (sink.requests, sink.bytes) == (1, 2)
