"""Fixtures for the effect connectors: the ledger tables (from the Alembic revision), a receiver, a runner."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kafold import db
from kafold.config import PostgresConfig
from tests.support.receiver import Receiver


@pytest.fixture(scope="session")
def effects_pg(pg_url: str) -> PostgresConfig:
    """A PostgresConfig whose schema (private to this session) holds kafold's tables, made by the migrations."""
    pg = PostgresConfig(url=pg_url, schema=f"kt_effects_{uuid.uuid4().hex[:8]}")
    db.upgrade(pg)
    return pg


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.url = r.start()  # type: ignore[attr-defined]
    try:
        yield r
    finally:
        r.stop()
