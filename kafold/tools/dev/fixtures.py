"""Pytest fixtures for tests against real services: a broker and PostgreSQL named by the environment, else a private
`kafold dev` stack started on first use and stopped at the end of the session.

`KAFOLD_TEST_BOOTSTRAP` names a Kafka API broker and `KAFOLD_TEST_PG_URL` a PostgreSQL database to use instead of the
dev stack; `KAFOLD_TEST_BROKER=kafka|tansu` (default tansu) selects the dev stack's broker (Apache Kafka needs Java 17
and Maven) or, with `KAFOLD_TEST_BOOTSTRAP`, says which kind that broker is. Tests that allow for a broker quirk ask
the `broker_kind` fixture and allow for it only there. Load with `pytest_plugins = ["kafold.tools.dev.fixtures"]`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from kafold.config import KafkaConfig, PostgresConfig
from kafold.tools.dev import stack as devstack

TEST_BROKER = os.environ.get("KAFOLD_TEST_BROKER") or "tansu"


def pytest_configure(config: pytest.Config) -> None:
    if TEST_BROKER not in devstack.BROKERS:
        raise pytest.UsageError(f"KAFOLD_TEST_BROKER={TEST_BROKER!r}: choose one of {', '.join(devstack.BROKERS)}")


# Stops the stack when its pipe closes, i.e. when the pytest process ends in any way (also SIGKILL,
# pytest-timeout's os._exit or a `timeout` wrapper's SIGTERM, none of which run fixture teardown).
_REAPER = "import os, sys; from pathlib import Path; from kafold.tools.dev import stack as devstack; " \
          "os.read(0, 1); devstack.down(Path(sys.argv[1]), graceful=False)"


@pytest.fixture(scope="session")
def dev_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devstack.DevStack]:
    """A private `kafold dev` stack, started on first use (unit-only runs never start it), stopped at the end.

    Teardown stops it when tests fail or on Ctrl-C; a reaper process stops it if pytest dies without teardown.
    """
    state_dir = tmp_path_factory.mktemp("kafold-dev")
    read_end, write_end = os.pipe()
    reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(state_dir)], stdin=read_end,
                              start_new_session=True)
    os.close(read_end)
    # With an external broker the stack serves PostgreSQL only: its broker is the cheap embedded one.
    broker = "tansu" if os.environ.get("KAFOLD_TEST_BOOTSTRAP") else TEST_BROKER
    try:
        yield devstack.up(state_dir, broker=broker)
    finally:
        try:  # its data goes with the session: no clean shutdown (a broker's grows with the session's partitions)
            devstack.down(state_dir, graceful=False)
        except BaseException:
            os.close(write_end)  # the reaper tries again, on its own, and the error is the session's
            raise
        reaper.kill()  # nothing left for it to stop
        reaper.wait()
        os.close(write_end)


@pytest.fixture(scope="session")
def broker_kind() -> str:
    """"kafka" (Apache Kafka: real semantics, no allowance) or "tansu" (the embedded broker and its quirks)."""
    return TEST_BROKER


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """`KAFOLD_TEST_BOOTSTRAP` if set (any Kafka API broker), else the session's dev stack."""
    external = os.environ.get("KAFOLD_TEST_BOOTSTRAP")
    if external:
        return external
    stack: devstack.DevStack = request.getfixturevalue("dev_stack")
    return stack.bootstrap_servers


@pytest.fixture(scope="session")
def pg_url(request: pytest.FixtureRequest) -> str:
    """`KAFOLD_TEST_PG_URL` if set (postgresql://root@127.0.0.1:5432/test), else the session's dev stack."""
    external = os.environ.get("KAFOLD_TEST_PG_URL")
    if external:
        return external
    stack: devstack.DevStack = request.getfixturevalue("dev_stack")
    return stack.postgres_url


@pytest.fixture(scope="session")
def kafka_config(kafka_bootstrap: str) -> KafkaConfig:
    # Short group timeouts: a JoinGroup waits for the members' rebalance timeout on tansu (librdkafka's
    # defaults made a first join take >20 s), and short ones also speed up rebalances on real Kafka.
    return KafkaConfig(bootstrap_servers=kafka_bootstrap, session_timeout_ms=6000, rebalance_timeout_ms=6000,
                       heartbeat_interval_ms=1000)


@pytest.fixture(scope="session")
def pg_config(pg_url: str) -> PostgresConfig:
    return PostgresConfig(url=pg_url)


@pytest.fixture
def unique(request: pytest.FixtureRequest) -> str:
    """A prefix for topic and group names that no other test (or earlier run on the same broker) uses."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:40]
    return f"kt.{name}.{uuid.uuid4().hex[:8]}"
