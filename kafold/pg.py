"""PostgreSQL connections from [postgres]: a psycopg 3 conninfo, kafold's session settings, a SQLAlchemy URL."""

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


# Each execution of a prepared statement is planned for the values it is given (PostgreSQL 12+). psycopg prepares a
# statement server-side from its 5th execution, and PostgreSQL then keeps one generic plan when that costs no more
# than the custom ones. Planned while a table was empty (a new effects ledger, subject keys, projection table),
# that plan is a sequential scan, and it is kept as the table grows: the effects ledger's read of a batch's event
# ids took 100 ms at 60k rows instead of 0.3 ms, and the webhook fell behind at 1,000 events/s
# (docs/benchmarks.md, latency). A SET, not a startup `options` parameter, which PgBouncer refuses by default.
CUSTOM_PLANS = "SET plan_cache_mode = force_custom_plan"


def connect(conninfo_text: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """psycopg.connect with kafold's session settings (CUSTOM_PLANS); psycopg's errors as they are."""
    conn = psycopg.connect(conninfo_text, **kwargs)
    try:
        if conn.info.server_version >= 120000:
            conn.execute(CUSTOM_PLANS)
            if not conn.autocommit:
                conn.commit()  # a session setting: it outlives the transaction the SET opened
    except BaseException:
        conn.close()
        raise
    return conn


def sqlalchemy_url(pg: PostgresConfig) -> URL:
    """A `postgresql+psycopg` SQLAlchemy URL; str() masks the password, `render_as_string(False)` shows it."""
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
