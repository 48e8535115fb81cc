"""PostgreSQL settings built from [postgres]: conninfo, SQLAlchemy URL, and both against the real server."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
import sqlalchemy
from psycopg.conninfo import conninfo_to_dict

from kafold.config import PostgresConfig
from kafold.errors import ConfigError
from kafold.pg import conninfo, sqlalchemy_url
from kafold.schema import Secret


@pytest.fixture
def password_file(tmp_path: Path) -> Secret:
    path = tmp_path / "pgpass"
    path.write_text("p@ss word\n")
    path.chmod(0o600)
    return Secret(f"file:{path}")


def test_conninfo_adds_the_revealed_password_and_tls_settings(password_file: Secret) -> None:
    pg = PostgresConfig(url="postgresql://app@db.internal:6432/orders", password=password_file,
                        sslmode="verify-full", sslrootcert="/etc/ssl/pg-ca.pem")
    assert conninfo_to_dict(conninfo(pg)) == {
        "user": "app", "host": "db.internal", "port": "6432", "dbname": "orders",
        "password": "p@ss word", "sslmode": "verify-full", "sslrootcert": "/etc/ssl/pg-ca.pem"}


def test_conninfo_accepts_the_sqlalchemy_scheme_and_socket_dirs() -> None:
    pg = PostgresConfig(url="postgresql+psycopg://postgres@/postgres?host=/run/pg&port=5432")
    assert conninfo_to_dict(conninfo(pg)) == {"user": "postgres", "dbname": "postgres", "host": "/run/pg",
                                              "port": "5432"}


def test_empty_or_invalid_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"postgres\.url"):
        conninfo(PostgresConfig(url=""))
    with pytest.raises(ConfigError, match=r"postgres\.url"):
        conninfo(PostgresConfig(url="postgresql://h/db?nosuchoption=1"))


def test_sqlalchemy_url_masks_the_password_when_printed(password_file: Secret) -> None:
    url = sqlalchemy_url(PostgresConfig(url="postgresql://app@db:5432/orders", password=password_file,
                                        sslmode="require"))
    assert url.drivername == "postgresql+psycopg"
    assert (url.username, url.password, url.host, url.port, url.database) == ("app", "p@ss word", "db", 5432,
                                                                              "orders")
    assert url.query == {"sslmode": "require"}
    assert "p@ss" not in str(url) and "p@ss" not in repr(url)


def test_conninfo_connects_to_the_real_server(pg_config: PostgresConfig) -> None:
    with psycopg.connect(conninfo(pg_config)) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_sqlalchemy_url_connects_to_the_real_server(pg_config: PostgresConfig) -> None:
    engine = sqlalchemy.create_engine(sqlalchemy_url(pg_config), poolclass=sqlalchemy.NullPool)
    with engine.connect() as conn:
        user = conn.execute(sqlalchemy.text("select current_user")).scalar_one()
    assert user == conninfo_to_dict(conninfo(pg_config))["user"]


def test_configured_tls_settings_override_the_url(tmp_path: Path) -> None:
    """A weaker sslmode in the URL loses to [postgres].sslmode; client certificate files pass through."""
    pg = PostgresConfig(url="postgresql://app@db/orders?sslmode=disable", sslmode="verify-full",
                        sslrootcert="/ca.pem", sslcert="/client.crt", sslkey="/client.key")
    params = conninfo_to_dict(conninfo(pg))
    assert (params["sslmode"], params["sslrootcert"], params["sslcert"], params["sslkey"]) == \
        ("verify-full", "/ca.pem", "/client.crt", "/client.key")
    assert sqlalchemy_url(pg).query["sslmode"] == "verify-full"
