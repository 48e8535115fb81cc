"""CLI subcommands, one module per concern; each exposes register(subparsers)."""

from __future__ import annotations

from kafold import devstack, protect
from kafold.config import KafoldConfig


def effective(cfg: KafoldConfig, need: tuple[str, ...]) -> KafoldConfig:
    """`devstack.effective` for a command that reads events: PostgreSQL too when the configuration protects
    fields, whose subjects' keys live there (kafold.protect): on the dev stack it is taken from the stack like
    Kafka, not left empty."""
    if protect.setup(cfg) is not None and "postgres" not in need:
        need = (*need, "postgres")
    return devstack.effective(cfg, need=need)
