"""Fixtures for snapshot tests: a bank aggregate with real topics, and one SparkSession for the session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kafold.config import KafkaConfig
from tests.snapshots.snaphelpers import Bank, make_bank


@pytest.fixture
def bank(kafka_config: KafkaConfig, unique: str) -> Bank:
    return make_bank(kafka_config, unique)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One SparkSession (local[2]) for every Spark test: starting its JVM is the slow part, so once is enough."""
    pytest.importorskip("pyspark")
    from kafold.spark_jobs.session import session

    s = session("local[2]")
    yield s
    s.stop()
