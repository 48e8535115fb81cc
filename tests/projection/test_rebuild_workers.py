"""Unit: what the rebuild's copy workers are given — the plan travels to a fresh interpreter without its mapping and
builds it again there (a mapper from `daemon.python_path` included); rows folding several aggregates get one worker."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig, KafoldConfig, PostgresConfig
from kafold.connectors.projection import rebuild as rb


def _plan(base: Path, **extra: object) -> rb.Plan:
    connector = ConnectorConfig(name="accounts", connector_class="postgres-projection", topics=["bank.events"],
                                config={"table": "accounts", "key_columns": ["account_id"],
                                        "columns": {"account_id": "text", "n": "int"}, **extra})
    cfg = KafoldConfig(kafka=KafkaConfig(bootstrap_servers="127.0.0.1:1"), postgres=PostgresConfig(),
                       daemon=DaemonConfig(python_path=["lib"]), connectors=[connector])
    return rb.plan(cfg, base, "accounts")


def test_a_copy_worker_builds_the_mapper_again_from_the_configured_python_path(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "kafold_test_worker_mapper.py").write_text(
        "def fold(row, event):\n    return {'account_id': event.aggregate_id, 'n': (row or {}).get('n', 0) + 41}\n")
    plan = _plan(tmp_path, mapper="kafold_test_worker_mapper:fold")
    assert plan.python_path == (str((tmp_path / "lib").resolve()),)
    script = ("import pickle, sys\n"
              "from kafold.envelope import Event\n"
              "plan = pickle.loads(sys.stdin.buffer.read())\n"
              "event = Event.new('Opened', 'account', 'acc-7', 1, {})\n"
              "print(plan.name, plan.key, plan.mapping.apply({'n': 1}, event, plan.mapping.key(event)))\n")
    # A fresh interpreter, started elsewhere, as a spawned worker is: it only has what was pickled.
    done = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(plan), capture_output=True,
                          cwd="/", timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split(maxsplit=2) == ["accounts", "accounts:rebuild",
                                                      "{'account_id': 'acc-7', 'n': 42, '_kafold_version': 1}\n"]


def test_rows_folding_several_aggregates_are_copied_by_one_process(tmp_path: Path) -> None:
    on = [{"type": "Opened", "set": {"n": "version"}}]
    assert rb.Rebuild(_plan(tmp_path, on=on), workers=4).workers == 4
    assert rb.Rebuild(_plan(tmp_path, on=on, version_guard=False), workers=4).workers == 1
    assert 1 <= rb.Rebuild(_plan(tmp_path, on=on)).workers == rb.default_workers() <= rb.MAX_DEFAULT_WORKERS
