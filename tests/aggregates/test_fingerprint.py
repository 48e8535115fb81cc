"""The fold's fingerprint, derived when the configuration leaves it empty: stable for the same code, different when
evolve's module, an event class, the upcasters or the state change; an explicit one is used as given; the snapshot
runs' identity and the runtime's restorer carry the same one, so a snapshot of another fold is refused."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kafold.config import AggregateConfig
from kafold.daemon.aggregates.restorer import SnapshotRestorer
from kafold.domain import AggregateDomain
from kafold.snapshot.fold import Domain
from kafold.snapshot.record import Snapshot
from kafold.snapshot.select import Selector
from kafold.upcast import UpcasterConfig

DOMAIN_SOURCE = '''
from dataclasses import dataclass, replace

@dataclass(frozen=True)
class Added:
    n: int

EVENT_TYPES = {"Added": Added}

@dataclass(frozen=True)
class Total:
    total: int = 0

def initial():
    return Total()

def evolve(state, event):
    return replace(state, total=state.total + event.n)

def decide(command, state):
    return [Added(command["n"])]
'''


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    name = f"fp_domain_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text(DOMAIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # each rewrite is read again, never a stale .pyc
    yield path
    sys.modules.pop(name, None)


def _load(path: Path, **extra: object) -> AggregateDomain:
    m = path.stem
    importlib.invalidate_caches()
    if m in sys.modules:
        importlib.reload(sys.modules[m])
    return AggregateDomain.load(AggregateConfig(name="fp", initial=f"{m}:initial", evolve=f"{m}:evolve",
                                                decide=f"{m}:decide", **extra))  # type: ignore[arg-type]


def test_the_same_code_gives_the_same_fingerprint_and_a_change_another(module: Path) -> None:
    first = _load(module).fingerprint
    assert first.startswith("auto-") and _load(module).fingerprint == first
    module.write_text(DOMAIN_SOURCE.replace("state.total + event.n", "state.total + 2 * event.n"))
    changed_evolve = _load(module).fingerprint
    module.write_text(DOMAIN_SOURCE.replace("    n: int\n", "    n: int\n    by: str = ''\n", 1))
    changed_event = _load(module).fingerprint
    module.write_text(DOMAIN_SOURCE.replace("total: int = 0", "total: int = 0\n    count: int = 0"))
    changed_state = _load(module).fingerprint
    module.write_text(DOMAIN_SOURCE)
    with_upcaster = _load(module, upcasters=[UpcasterConfig(type="Added", add_fields={"n": 1})]).fingerprint
    assert len({first, changed_evolve, changed_event, changed_state, with_upcaster}) == 5
    assert _load(module, fingerprint="v7").fingerprint == "v7"  # declared compatible: used as given


def test_snapshot_runs_and_the_restorer_carry_the_derived_fingerprint(module: Path) -> None:
    domain = _load(module)
    agg = AggregateConfig(name="fp", initial=f"{module.stem}:initial", evolve=f"{module.stem}:evolve",
                          decide=f"{module.stem}:decide")
    run_identity = Domain.load(agg).identity
    assert run_identity.fingerprint == domain.fingerprint
    assert SnapshotRestorer(None, agg, domain).identity == run_identity  # type: ignore[arg-type]
    module.write_text(DOMAIN_SOURCE.replace("state.total + event.n", "state.total - event.n"))
    now = Domain.load(agg).identity
    assert now != run_identity
    old = Snapshot("fp", "a1", {"total": 1}, 1, 0, 5, run_identity.fingerprint, run_identity.state_schema_version)
    assert Selector(now, 0, 0, 10)._check(old) == "fingerprint"  # a snapshot of the old fold is refused
    assert Selector(run_identity, 0, 0, 10)._check(old) is None
