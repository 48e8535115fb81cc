"""A subject key store in a directory (`[privacy] key_store = "directory"`): one fsync'd file per subject, outside
PostgreSQL and its backups.

Layout under `key_store_dir`: `keys/<sha256(subject)>` holds one subject's key as JSON (subject, key id, wrapped
key); `erasures.log` appends one JSON line per erasure (the subject's keyed hash, who, when: never the subject);
`lock` serialises the writers of every process (flock). Readers take no lock: a key file is only ever created
whole (written, fsync'd, then linked in place) or replaced whole (rename).

Durability: a key is on disk (file and directory fsync'd) before `create` returns it, so no value is sealed under
a key a crash could lose. Deletion: a key file's bytes are overwritten with zeros and fsync'd before it is
unlinked, and a replaced file (a rotation's rewrap) is zeroed through a handle kept open across the rename; a
reader that meets a zeroed file reads the path again. On a copy-on-write file system (btrfs, ZFS) or behind an
SSD's wear levelling the zeros may go to new blocks and leave the old ones until reused: put the directory on an
encrypted volume there (docs/security.md#where-keys-live).
"""

from __future__ import annotations

import base64
import bisect
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from kafold import logs
from kafold.errors import ConfigError, FatalError
from kafold.protect import RECENT_ERASURES_S, KeyStore, Setup

log = logs.get(__name__)


def _name(subject: str) -> str:
    """A subject's file name: any subject (slashes, dots, any length) maps to a safe, fixed-length name."""
    return hashlib.sha256(subject.encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _zero(fd: int) -> None:
    """Overwrite an open file's bytes with zeros, durably."""
    size = os.fstat(fd).st_size
    os.pwrite(fd, b"\0" * size, 0)
    os.fsync(fd)


class DirectoryKeyStore(KeyStore):
    """Keys as files in a directory (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.keys = root / "keys"
        self.erasures = root / "erasures.log"
        try:
            self.keys.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.erasures.touch(mode=0o600, exist_ok=True)
        except OSError as e:
            raise ConfigError([f"privacy.key_store_dir: cannot use {root}: {e.strerror}"]) from None

    @classmethod
    def open(cls, setup: Setup) -> KeyStore:
        if not setup.privacy.key_store_dir:
            raise ConfigError(["privacy.key_store_dir: the `directory` key store needs a directory"])
        return cls(Path(setup.privacy.key_store_dir))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _read(self, name: str) -> tuple[str, bytes, bytes] | None:
        """(subject, key id, wrapped) of a key file, None when there is none (or it is being deleted)."""
        for _ in range(3):  # a zeroed file is one being replaced or deleted: the path is read again
            try:
                raw = (self.keys / name).read_bytes()
            except FileNotFoundError:
                return None
            except OSError as e:
                raise FatalError(f"subject keys unavailable: {self.keys / name}: {e.strerror}") from e
            if raw.strip(b"\0"):
                doc = orjson.loads(raw)
                return str(doc["subject"]), bytes.fromhex(doc["key_id"]), base64.b64decode(doc["wrapped"])
            time.sleep(0.001)
        return None

    def _write_new(self, name: str, subject: str, key_id: bytes, wrapped: bytes) -> str:
        """A fsync'd temporary file holding the entry; its path (the caller links or renames it in place)."""
        tmp = self.keys / f".{name}.{os.getpid()}.{time.monotonic_ns()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, orjson.dumps({"subject": subject, "key_id": key_id.hex(),
                                       "wrapped": base64.b64encode(wrapped).decode()}))
            os.fsync(fd)
        finally:
            os.close(fd)
        return str(tmp)

    def get(self, subject: str) -> tuple[bytes, bytes] | None:
        row = self._read(_name(subject))
        return None if row is None else (row[1], row[2])

    def create(self, subject: str, key_id: bytes, wrapped: bytes) -> tuple[bytes, bytes]:
        name = _name(subject)
        tmp = self._write_new(name, subject, key_id, wrapped)
        try:
            os.link(tmp, self.keys / name)  # atomic create-if-absent: another writer's key wins
            _fsync_dir(self.keys)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        row = self.get(subject)
        if row is None:  # forgotten between the two: what this writer made is gone with it
            raise FatalError(f"a subject's key was deleted while it was created ({name[:16]}…); retry the write")
        return row

    def _delete(self, name: str) -> None:
        """Zero, then unlink, a key file (the caller holds the lock)."""
        path = self.keys / name
        fd = os.open(path, os.O_WRONLY)
        try:
            _zero(fd)
        finally:
            os.close(fd)
        path.unlink()
        _fsync_dir(self.keys)

    def _record(self, entries: list[tuple[str, str, bool]]) -> None:
        """Append (subject hash, actor, key existed) erasures to the log, durably (the caller holds the lock)."""
        lines = b"".join(orjson.dumps({"subject_hash": h, "actor": a, "key_existed": e, "erased_at": time.time()})
                         + b"\n" for h, a, e in entries)
        fd = os.open(self.erasures, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, lines)
            os.fsync(fd)
        finally:
            os.close(fd)

    def forget(self, subject: str, subject_hash: str, actor: str, key_id: bytes | None) -> bool:
        name = _name(subject)
        with self._locked():
            row = self._read(name)
            deleted = row is not None and key_id is not None and row[1] == key_id
            if deleted:
                self._delete(name)
            self._record([(subject_hash, actor, deleted)])
        return deleted

    def reapply(self, erasures: list[tuple[bytes, str, str]]) -> list[str]:
        by_id = {key_id: (h, actor) for key_id, h, actor in erasures}
        gone: list[tuple[str, str, str]] = []
        with self._locked():
            for name in self._names():
                row = self._read(name)
                if row is not None and row[1] in by_id:
                    self._delete(name)
                    gone.append((row[0], *by_id[row[1]]))
            if gone:
                self._record([(h, a, True) for _, h, a in gone])
        return [s for s, _, _ in gone]

    def _names(self) -> list[str]:
        """The key files' names, sorted (the store's order: `scan` walks it)."""
        return sorted(n for n in os.listdir(self.keys) if not n.startswith("."))

    def erasure_mark(self) -> Any:
        return self.erasures.stat().st_size  # the log is append-only: it grows with every erasure

    def recent_erasures(self) -> list[tuple[int, str]]:
        since = time.time() - RECENT_ERASURES_S
        out, at = [], 0
        with self.erasures.open("rb") as f:
            for line in f:
                if line.endswith(b"\n"):  # a line being appended is read at the next look
                    doc = orjson.loads(line)
                    if doc["erased_at"] > since:
                        out.append((at, str(doc["subject_hash"])))
                at += len(line)
        return out

    def scan(self, after: str, limit: int) -> list[tuple[str, bytes, bytes]]:
        """In file-name order (sha256 of the subject), after `after`'s place in it."""
        names = self._names()
        start = bisect.bisect_right(names, _name(after)) if after else 0
        out = []
        for name in names[start:]:
            row = self._read(name)
            if row is not None:
                out.append(row)
                if len(out) >= limit:
                    break
        return out

    def rewrap(self, rows: list[tuple[str, bytes, bytes, bytes]]) -> int:
        done = 0
        with self._locked():
            for subject, key_id, old, new in rows:
                name = _name(subject)
                path = self.keys / name
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    continue  # forgotten meanwhile
                try:
                    if self._read(name) != (subject, key_id, old):
                        continue
                    os.replace(self._write_new(name, subject, key_id, new), path)
                    _fsync_dir(self.keys)
                    _zero(fd)  # the replaced file, still open: its old wrapping does not stay on disk
                    done += 1
                finally:
                    os.close(fd)
        return done

    def count(self) -> int:
        return len(self._names())
