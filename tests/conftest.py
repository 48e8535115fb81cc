"""The session's real services come from kafold.testing.fixtures (the broker and PostgreSQL named by the environment,
else a dev stack; `KAFOLD_TEST_BROKER=kafka|tansu` picks its broker); tests using them are marked `integration`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest_plugins = ["kafold.testing.fixtures"]

# Fixtures that reach a real service; tests using them are marked `integration` automatically.
SERVICE_FIXTURES = frozenset({"dev_stack", "kafka_bootstrap", "pg_url", "kafka_config", "pg_config", "registry_url"})

# Under pytest-xdist (`make test` runs the integration stage with `-n 2 --dist loadgroup`) every worker is its own
# pytest process with its own session broker and PostgreSQL, so a test that pauses or kills them disturbs only its
# own worker. Groups keep together on one worker, run one after another:
# - the `slow` tests (kill -9 loops, the chaos runs with their own three-node clusters): two of them never fight for
#   the two cores at once (xdist hands out the groups with the most tests first, so it starts early);
# - the tests of a module sharing a module-scoped fixture (a scenario, a daemon, a Connect worker): set up once;
# - the tests of an expensive session fixture (one Spark JVM, not one per worker).
SERIAL_GROUP = "slow"
SHARED_SESSION_FIXTURES = frozenset({"spark"})


def _xdist_group(item: pytest.Item) -> str | None:
    if item.get_closest_marker("slow") is not None:
        return SERIAL_GROUP
    names = set(getattr(item, "fixturenames", ()))
    shared = sorted(SHARED_SESSION_FIXTURES & names)
    if shared:
        return shared[0]
    # pytest's resolved fixture closure of the item (it has no public accessor)
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(d and d[-1].scope in ("module", "package", "class") for d in defs.values()):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        group = _xdist_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """A test calling `kafold.cli.main` configures logging onto pytest's captured streams, which close after the
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
    from kafold.registry_server import start

    reg = start(tmp_path_factory.mktemp("registry"))
    try:
        yield reg.url
    finally:
        reg.stop()
