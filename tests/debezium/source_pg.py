"""A source PostgreSQL for Debezium: pgserver's embedded binaries, its own data dir, `wal_level = logical`, listening
on a loopback TCP port (Debezium's JDBC driver and replication stream connect over TCP)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pgserver
import psycopg
from pgserver import utils as pgserver_utils

from kafold import logs
from tests.support import free_port

log = logs.get(__name__)

# What Debezium's pgoutput stream needs, and no Unix socket (its path would outgrow the limit in pytest's tmp dirs).
SETTINGS = {"wal_level": "logical", "max_wal_senders": 10, "max_replication_slots": 10,
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": "''", "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def _bin(name: str) -> str:
    return str(Path(pgserver.__file__).parent / "pginstall" / "bin" / name)


class SourcePostgres:
    """One PostgreSQL server in `pgdata` on a free loopback port."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self.port = free_port()
        # PostgreSQL refuses to run as root: there it runs as the system user pgserver creates for the dev stack's.
        self.user = "pgserver" if os.geteuid() == 0 else None
        self.pid: int | None = None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> SourcePostgres:
        if not (self.pgdata / "PG_VERSION").exists():
            self._init()
            with open(self.pgdata / "postgresql.conf", "a", encoding="utf-8") as conf:
                conf.write("".join(f"{k} = {v}\n" for k, v in SETTINGS.items()))
        self._ctl("start", "-l", str(self.pgdata / "log"), "-o", f"-p {self.port}")
        self.pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        log.info("debezium_source.postgres.started", pgdata=str(self.pgdata), port=self.port)
        return self

    def _init(self) -> None:
        """initdb as pgserver runs it (trust authentication, UTF-8, superuser postgres), owned by the server's user."""
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            entry = pgserver_utils.ensure_user_exists(self.user)
            pgserver_utils.ensure_prefix_permissions(self.pgdata)
            pgserver_utils.ensure_prefix_permissions(Path(_bin("initdb")))
            assert entry is not None
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        self._run(_bin("initdb"), "-D", str(self.pgdata), "--auth=trust", "--encoding=utf8", "-U", "postgres")

    def stop(self) -> None:
        """pg_ctl's immediate stop; SIGKILL to the postmaster if that fails (its data dir gone, say)."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        try:
            self._ctl("stop", "-m", "immediate")
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
        finally:
            log.info("debezium_source.postgres.stopped", port=self.port, pid=pid)

    def _ctl(self, *args: str) -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.pgdata), "-w", "-t", "120", *args)

    def _run(self, *cmd: str) -> None:
        # pg_ctl's server inherits stdout/stderr: files, not pipes, or the call would wait for the server to exit
        with open(self.pgdata.parent / "pg_ctl.out", "ab") as out:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=180,
                                  user=self.user, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with exit {done.returncode}; see "
                               f"{self.pgdata.parent / 'pg_ctl.out'} and {self.pgdata / 'log'}")

    def connect(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.url, autocommit=True)
