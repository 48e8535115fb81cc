"""Where a `kafold dev` stack runs, as its state file records it, and a configuration's empty addresses filled from
it (`effective`): what the daemon and the CLI read. Starting and stopping the stack is the tools'
(kafold.tools.dev.stack)."""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kafold.config import KafoldConfig, with_overrides
from kafold.errors import KafoldError

STATE_FILE = "stack.json"
BROKERS = ("tansu", "kafka")


class DevStackError(KafoldError):
    """The local stack could not be started, found or stopped."""


class NotRunningError(DevStackError):
    """A configuration leaves an address empty and no `kafold dev` stack is running to fill it."""


@dataclass(frozen=True)
class Proc:
    """A process we started, known by pid and create time (so a recycled pid is never mistaken for it)."""

    pid: int
    create_time: float

    def handle(self) -> psutil.Process | None:
        """The live process, or None when it has exited (a zombie counts as exited)."""
        try:
            p = psutil.Process(self.pid)
            if abs(p.create_time() - self.create_time) > 1.0 or p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self.handle() is not None

    @classmethod
    def of(cls, pid: int) -> Proc:
        return cls(pid, psutil.Process(pid).create_time())


@dataclass(frozen=True)
class DevStack:
    """A running local stack: where to reach it and the processes behind it."""

    state_dir: Path
    bootstrap_servers: str
    postgres_url: str
    brokers: tuple[Proc, ...]
    postgres: Proc
    kind: str = "tansu"
    nodes: int = 1

    @property
    def broker(self) -> Proc:
        """The (first) broker process."""
        return self.brokers[0]

    @property
    def replication_factor(self) -> int:
        """What topics on this stack replicate to: 3 on a three-node Apache Kafka (min ISR 2), else 1."""
        return replication(self.nodes)[0] if self.kind == "kafka" else 1

    def env(self) -> dict[str, str]:
        """Environment overrides that point any kafold configuration at this stack."""
        return {"KAFOLD_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap_servers,
                "KAFOLD_POSTGRES__URL": self.postgres_url}


def replication(nodes: int) -> tuple[int, int]:
    """Replication factor and min.insync.replicas of a cluster of `nodes`: 3 and 2 on three nodes (one node may
    fail without stopping acks=all writes), 1 and 1 on one."""
    return (3, 2) if nodes >= 3 else (1, 1)


def default_state_dir() -> Path:
    """`$KAFOLD_DEV_DIR`, else `$XDG_STATE_HOME/kafold/dev` (default `~/.local/state/kafold/dev`)."""
    if os.environ.get("KAFOLD_DEV_DIR"):
        return Path(os.environ["KAFOLD_DEV_DIR"]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser() / "kafold" / "dev"


def read_json(path: Path, remedy: str) -> dict[str, Any]:
    """A JSON object kept in the state dir; {} when the file does not exist."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise DevStackError(f"{path}: unreadable ({e}); {remedy}") from e
    return data if isinstance(data, dict) else {}


def read_state(state_dir: Path) -> dict[str, Any]:
    return read_json(state_dir / STATE_FILE, "stop leftover processes and delete the file")


def proc_in(state: dict[str, Any], key: str) -> Proc | None:
    entry = state.get(key)
    if not isinstance(entry, dict) or "pid" not in entry:
        return None
    return Proc(int(entry["pid"]), float(entry["create_time"]))


def brokers_in(state: dict[str, Any]) -> list[Proc]:
    entries = state.get("brokers")
    if isinstance(entries, list):
        return [Proc(int(e["pid"]), float(e["create_time"])) for e in entries if isinstance(e, dict)]
    one = proc_in(state, "broker")  # a state file written before the broker kinds
    return [one] if one else []


def stack_in(state_dir: Path, state: dict[str, Any], brokers: list[Proc], pg: Proc) -> DevStack:
    return DevStack(state_dir, state["bootstrap_servers"], state["postgres_url"], tuple(brokers), pg,
                    state.get("kind", "tansu"), int(state.get("nodes", 1)))


def status(state_dir: Path | None = None) -> DevStack | None:
    """The running stack, or None unless every broker node and PostgreSQL are alive."""
    state_dir = (state_dir or default_state_dir()).expanduser().resolve()
    state = read_state(state_dir)
    brokers, pg = brokers_in(state), proc_in(state, "postgres")
    if not brokers or pg is None or not all(b.alive() for b in brokers) or not pg.alive():
        return None
    return stack_in(state_dir, state, brokers, pg)


def _missing(section: str) -> str:
    what, key = ("broker", "[kafka].bootstrap_servers") if section == "kafka" else \
        ("PostgreSQL", "[postgres].url")
    return f"no {what} configured and no `kafold dev` stack running — run `kafold dev up` or set {key}"


def effective(cfg: KafoldConfig, *, state_dir: Path | None = None,
              need: Collection[str] = ("kafka", "postgres")) -> KafoldConfig:
    """`cfg` with empty broker / PostgreSQL addresses (of the sections in `need`) taken from the dev stack."""
    empty = [s for s in need if not (cfg.kafka.bootstrap_servers if s == "kafka" else cfg.postgres.url)]
    if not empty:
        return cfg
    stack = status(state_dir)
    if stack is None:
        raise NotRunningError("\n".join(_missing(s) for s in empty))
    fills: dict[str, dict[str, Any]] = {}
    if "kafka" in empty:  # the stack's cluster also decides how far its topics can replicate
        fills["kafka"] = {"bootstrap_servers": stack.bootstrap_servers,
                          "replication_factor": stack.replication_factor}
    if "postgres" in empty:
        fills["postgres"] = {"url": stack.postgres_url}
    return with_overrides(cfg, **fills)
