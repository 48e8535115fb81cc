"""PostgreSQL connection settings derived from [postgres]: a psycopg 3 conninfo and a SQLAlchemy URL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kafold.config import PostgresConfig
from kafold.errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL


def _libpq_url(url: str) -> str:
    """libpq knows postgresql:// and postgres://; the SQLAlchemy spelling is accepted in the config too."""
    if url.startswith("postgresql+psycopg://"):
        return "postgresql://" + url[len("postgresql+psycopg://"):]
    return url


def _extras(pg: PostgresConfig) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if pg.password is not None:
        extras["password"] = pg.password.reveal()
    if pg.sslmode:
        extras["sslmode"] = pg.sslmode
    for key in ("sslrootcert", "sslcert", "sslkey"):  # given, they override the same parameters in the URL
        if getattr(pg, key):
            extras[key] = getattr(pg, key)
    return extras


def conninfo(pg: PostgresConfig) -> str:
    """A libpq conninfo string with the revealed password; hand it to psycopg, never log it."""
    if not pg.url:
        raise ConfigError(["postgres.url: empty (run `kafold dev up` or set [postgres].url)"])
    try:
        return make_conninfo(_libpq_url(pg.url), **_extras(pg))
    except psycopg.ProgrammingError as e:  # the URL does not parse
        raise ConfigError([f"postgres.url: not a valid PostgreSQL URL ({type(e).__name__})"]) from e


def sqlalchemy_url(pg: PostgresConfig) -> URL:
    """A `postgresql+psycopg` SQLAlchemy URL; str() masks the password, `render_as_string(False)` shows it."""
    # sqlalchemy/alembic: kafold[daemon], not in the core install
    from sqlalchemy.engine import URL

    params = {k: str(v) for k, v in conninfo_to_dict(conninfo(pg)).items() if v is not None}
    host, port = str(params.get("host", "")), str(params.get("port", ""))
    simple = host and not host.startswith("/") and "," not in host and "," not in port
    return URL.create(
        "postgresql+psycopg",
        username=params.pop("user", None),
        password=params.pop("password", None),
        # a socket directory or a multi-host list stays a query parameter, as the psycopg dialect expects
        host=params.pop("host") if simple else None,
        port=int(params.pop("port")) if simple and port else None,
        database=params.pop("dbname", None),
        query=params,
    )
