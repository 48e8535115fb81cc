"""The session's real services come from kafold.tools.dev.fixtures (the broker and PostgreSQL named by the environment,
else a dev stack; `KAFOLD_TEST_BROKER=kafka|tansu` picks its broker); tests using them are marked `integration`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

# xdist_groups: which tests one pytest-xdist worker runs together (`make test` runs the integration stage in two)
pytest_plugins = ["kafold.tools.dev.fixtures", "tests.support.xdist_groups"]

# No per-example deadline for the property tests (Hypothesis' default is 200 ms): an example's time is the loaded
# machine's, not a property of the code (test_any_config_loads_or_fails_with_config_error failed in a unit stage run
# at load 46, then passed alone replaying its saved examples; most property tests here already said deadline=None).
settings.register_profile("kafold", deadline=None)
settings.load_profile("kafold")

# Fixtures that reach a real service; tests using them are marked `integration` automatically.
SERVICE_FIXTURES = frozenset({"dev_stack", "kafka_bootstrap", "pg_url", "kafka_config", "pg_config", "registry_url"})

def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """A test calling `kafold.tools.cli.main` configures logging onto pytest's captured streams, which close after the
    test: give the next tests (and session teardown) structlog's defaults and no such handler back."""
    import logging

    import structlog

    yield
    if structlog.is_configured():
        structlog.reset_defaults()
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if type(h) is not logging.StreamHandler]


@pytest.fixture(scope="session")
def registry_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Apicurio Registry's Confluent-compatible URL: `$KAFOLD_TEST_REGISTRY_URL` (e.g. from `kafold dev up
    --registry`), else one started for the session (built from Maven Central on first use)."""
    import os

    if os.environ.get("KAFOLD_TEST_REGISTRY_URL"):
        yield os.environ["KAFOLD_TEST_REGISTRY_URL"]
        return
    from kafold.tools.dev.registry_server import start

    reg = start(tmp_path_factory.mktemp("registry"))
    try:
        yield reg.url
    finally:
        reg.stop()
