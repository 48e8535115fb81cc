"""A source PostgreSQL for Debezium: pgserver's embedded binaries, its own data dir, `wal_level = logical`, listening
on a loopback TCP port (Debezium's JDBC driver and replication stream connect over TCP)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg

from kafold import logs
from tests.support import free_port

log = logs.get(__name__)

# pgserver initialises the data dir (as its own system user when run as root, as PostgreSQL requires) and starts
# it on a Unix socket only; the helper runs in its own process, as kafold.devstack drives pgserver.
_INIT = "import sys, pgserver; pgserver.get_server(sys.argv[1], cleanup_mode=None)"
# What Debezium's pgoutput stream needs, and no Unix socket (its path would outgrow the limit in pytest's tmp dirs).
SETTINGS = {"wal_level": "logical", "max_wal_senders": 4, "max_replication_slots": 4, "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": "''", "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def _bin(name: str) -> str:
    import pgserver  # the embedded extra; imported here so the module loads where it is missing

    return str(Path(pgserver.__file__).parent / "pginstall" / "bin" / name)


class SourcePostgres:
    """One PostgreSQL server in `pgdata` on a free loopback port."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self.port = free_port()
        self.user = "pgserver" if os.geteuid() == 0 else None  # the system user pgserver runs PostgreSQL as

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> SourcePostgres:
        if not (self.pgdata / "PG_VERSION").exists():
            subprocess.run([sys.executable, "-c", _INIT, str(self.pgdata)], check=True, timeout=120,
                           stdin=subprocess.DEVNULL, capture_output=True)
            self._ctl("stop", "-m", "fast")
            with open(self.pgdata / "postgresql.conf", "a", encoding="utf-8") as conf:
                conf.write("".join(f"{k} = {v}\n" for k, v in SETTINGS.items()))
        self._ctl("start", "-l", str(self.pgdata / "log"), "-o", f"-p {self.port}")
        log.info("debezium_source.postgres.started", pgdata=str(self.pgdata), port=self.port)
        return self

    def stop(self) -> None:
        if (self.pgdata / "postmaster.pid").exists():
            self._ctl("stop", "-m", "immediate")
            log.info("debezium_source.postgres.stopped", port=self.port)

    def _ctl(self, *args: str) -> None:
        subprocess.run([_bin("pg_ctl"), "-D", str(self.pgdata), "-w", "-t", "60", *args], check=True, timeout=90,
                       stdin=subprocess.DEVNULL, capture_output=True, user=self.user)

    def connect(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.url, autocommit=True)
