"""The aggregate runtime: catch-up gate, exactly-once command processing and request/reply results."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kafold import protect
from kafold.config import AggregateConfig, KafoldConfig
from kafold.daemon.aggregates.recovery import Base, FullReplay, Restorer
from kafold.daemon.aggregates.restorer import SnapshotRestorer
from kafold.daemon.aggregates.runtime import AggregateRuntime, dlq_topic
from kafold.domain import AggregateDomain
from kafold.messages import ACCEPTED, REJECTED, Command, Result

__all__ = ["ACCEPTED", "REJECTED", "AggregateRuntime", "Base", "Command", "FullReplay", "Restorer", "Result",
           "build_runtime", "dlq_topic", "instance_id"]


def instance_id(cfg: KafoldConfig) -> str:
    """This process's stable identity in transactional ids: `$KAFOLD_INSTANCE_ID`, else host name and HTTP port.

    A restarted instance must reuse it, so that its first `init_transactions` aborts what a crash left open.
    """
    return os.environ.get("KAFOLD_INSTANCE_ID") or f"{socket.gethostname()}-{cfg.daemon.http_port}"


def build_runtime(cfg: KafoldConfig, agg: AggregateConfig, base: Path) -> AggregateRuntime:
    """The runtime the daemon hosts for one `[[aggregates]]` entry."""
    domain = AggregateDomain.load(agg, cfg.daemon.python_path, base).protected(protect.active() or protect.build(cfg))
    return AggregateRuntime(cfg.kafka, cfg.daemon, agg, domain, instance_id=instance_id(cfg),
                            restorer=_restorer(cfg, agg, domain))


def _restorer(cfg: KafoldConfig, agg: AggregateConfig, domain: AggregateDomain) -> Restorer:
    """Latest usable snapshots + tail (kafold.snapshot)."""
    return SnapshotRestorer(cfg.kafka, agg, domain)
