"""Fixtures for snapshot tests: a bank aggregate with real topics, and one SparkSession for the session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from snaphelpers import Bank, bank_aggregate

from kafold import topics
from kafold.config import KafkaConfig, TopicSpec


@pytest.fixture
def bank(kafka_config: KafkaConfig, unique: str) -> Bank:
    agg = bank_aggregate(unique)
    topics.ensure(kafka_config, [TopicSpec(agg.topic("events"), agg.partitions, 1, {}),
                                 TopicSpec(agg.topic("snapshot"), agg.partitions, 1, {"cleanup.policy": "compact"})])
    return Bank(kafka_config, agg)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One SparkSession (local[2]) for every Spark test: start-up costs ~7 s."""
    pytest.importorskip("pyspark")
    from kafold.spark_jobs.session import session

    s = session("local[2]")
    yield s
    s.stop()
