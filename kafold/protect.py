"""Crypto-shredding of protected event fields: AES-GCM under per-subject data keys wrapped by a master key.

A protected field's value is written as `kfenc1:` + base64url(key id (8) | nonce (12) | ciphertext+tag), under its
subject's data key (256 bits, AES-GCM), with associated data `subject \\0 event type \\0 path`: a value copied to
another field, type or subject fails authentication. The data keys live in a key store (`[privacy] key_store`, a
`kafold.key_stores` entry point: `<schema>.subject_keys` by default, kafold.keystore_dir for files), wrapped by the
master key (AES-GCM, associated data = the subject; each wrapped key names the id of the master key that wrapped
it, for kafold.key_rotation); `forget` records the key's id on the erasure topic (kafold.erasure_log: a restored
backup gets the forget back), then deletes the key and records the erasure in `<schema>.erasures` as a keyed hash
of the subject (who, when; never the subject itself).

Snapshots: when every rule of an aggregate names the aggregate id as subject, a snapshot's whole state is sealed
under that key (associated data: aggregate type and id); a restore that cannot open it (Forgotten) does not use it
and folds the aggregate from its events, whose protected fields then read as the placeholder.

Reading: a value whose key is gone (forgotten, or a key of an earlier life of the subject: the key id differs)
reads as the placeholder, and nothing fails. A value that does not authenticate (a wrong master key, a tampered
value) raises DecryptError: never plaintext, never garbage; the fold makes it a fold error, a sink connector's
intake dead-letters it (reason `decrypt-failed`).

Caching: unwrapped keys (and known absences) are kept in process, trusted for `CACHE_TTL_S` seconds at a time:
once a TTL the ring reads the store's erasure mark (one small query, however many keys it holds), and while it is
unchanged no key was deleted, so everything cached stays; after any erasure the whole cache is dropped and fetched
again. `forget` through this process (the daemon's HTTP endpoint) drops the subject from every cache of the process
at once; a `forget` by the CLI (another process) is seen by a running daemon within the TTL. A value whose key id
the cache does not hold (a cached absence, another key) is checked against the store before it reads as forgotten,
so a key created since it was cached is found. Batches look their keys up at once (`prefetch`, `prepare_writing`),
and look at the mark first when less than half a TTL is left, so that it does not lapse while the batch is read.
A ring holds at most `[privacy] key_cache_max` subjects (each key's AES-GCM object is ~2.5 KB); a full ring drops
its oldest tenth.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from itertools import islice
from typing import TYPE_CHECKING, Any

import orjson

from kafold import logs
from kafold.envelope import Event, adopt_payload, reshaped
from kafold.erasure_log import ErasureLog
from kafold.errors import ConfigError, FatalError, KafoldError, RecordError, RetriableError
from kafold.retry import retrying

if TYPE_CHECKING:
    from kafold.config import KafkaConfig, KafoldConfig, PostgresConfig, PrivacyConfig
    from kafold.schema import Secret

PREFIX = "kfenc1:"
KEY_ID_BYTES = 8
NONCE_BYTES = 12
MASTER_ID_BYTES = 8
# A wrapped data key: WRAP_V2 | master key id (8) | nonce (12) | ciphertext+tag (48), so that each key records which
# master key wrapped it (`kafold keys rotate` resumes by it). Keys wrapped before it are nonce | ciphertext+tag
# (60 bytes) and open under any configured master key.
WRAP_V2 = b"\x02"
LEGACY_WRAPPED_BYTES = NONCE_BYTES + 32 + 16
CACHE_TTL_S = 5.0
CACHE_MAX = 100_000
STORE_RETRY_S = 30.0
AGGREGATE_ID = "aggregate_id"
REAPPLY_BATCH = 10_000  # key ids per statement when erasures are re-applied after a restore
KEY_STORES = "kafold.key_stores"  # the entry point group of KeyStore implementations ([privacy] key_store)
RECENT_ERASURES_S = 600  # how far back an ErasureWatch looks for erasures it has not seen (out-of-order commits)
log = logs.get(__name__)
_AESGCM: Any = None  # cryptography's AESGCM class, once imported (_aesgcm)


class DecryptError(FatalError):
    """A protected value that does not authenticate under its subject's key (wrong master key, tampered value)."""


class Forgotten(KafoldError):
    """A sealed snapshot state whose subject's key is gone (forgotten, or an earlier life of the subject)."""


# Nonces are drawn from os.urandom a block at a time: os.urandom gives up the interpreter lock, and taking it back
# beside a busy thread (the daemon's connectors) waits out a switch interval (docs/benchmarks.md, privacy). A nonce
# need only be unique, not secret (it is written beside the ciphertext); each is handed out once (deque.popleft is
# atomic), and a forked child drops the parent's block, which the parent goes on using.
NONCE_BLOCK = 1024
_NONCES: deque[bytes] = deque()
os.register_at_fork(after_in_child=_NONCES.clear)


def _nonce() -> bytes:
    """A fresh random 96-bit nonce."""
    while True:
        try:
            return _NONCES.popleft()
        except IndexError:
            block = os.urandom(NONCE_BYTES * NONCE_BLOCK)
            _NONCES.extend(block[i:i + NONCE_BYTES] for i in range(0, len(block), NONCE_BYTES))


def _aesgcm(key: bytes) -> Any:
    global _AESGCM
    if _AESGCM is None:  # imported on first use: only protected setups pay (and once: an import statement costs
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # as much as building the object)

        _AESGCM = AESGCM
    return _AESGCM(key)


def master_key(privacy: PrivacyConfig) -> bytes:
    """The master key (32 bytes, given base64 or hex) the [privacy] reference names; ConfigError naming the
    variable or file when it is missing or not a 256-bit key."""
    if privacy.master_key is None:
        raise ConfigError(["privacy.master_key: protected fields need privacy.master_key_env or "
                           "privacy.master_key_file"])
    return _read_key(privacy.master_key, "privacy.master_key")


def previous_master_key(privacy: PrivacyConfig) -> bytes | None:
    """The master key being rotated away from ([privacy] previous_master_key), None when none is named."""
    if privacy.previous_master_key is None:
        return None
    return _read_key(privacy.previous_master_key, "privacy.previous_master_key")


def _read_key(secret: Secret, key: str) -> bytes:
    """A 256-bit key from its reference; ConfigError naming the variable or file, never the value."""
    where = secret.source.replace("env:", "environment variable ", 1).replace("file:", "file ", 1)
    try:
        text = secret.reveal().strip()
    except KeyError:
        raise ConfigError([f"{key}: {where} is not set (a master key of protected fields)"]) from None
    except OSError as e:
        raise ConfigError([f"{key}: cannot read {where}: {e.strerror}"]) from None
    raw: bytes | None = None
    try:
        raw = bytes.fromhex(text) if len(text) == 64 else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raw = None
    if raw is None or len(raw) != 32:
        raise ConfigError([f"{key}: {where} does not hold a 256-bit key (32 bytes, base64 or hex; "
                           "e.g. `openssl rand -base64 32`)"])
    return raw


def master_key_id(master: bytes) -> bytes:
    """A master key's id: a keyed digest that names it (in wrapped keys, logs, `kafold keys status`) and reveals
    nothing of it."""
    return hmac.new(master, b"kafold master key id", hashlib.sha256).digest()[:MASTER_ID_BYTES]


class Cipher:
    """Seals and opens single values under data keys; wraps data keys under the master key (and opens those a
    previous master key wrapped, during a rotation). Pure (no I/O)."""

    def __init__(self, master: bytes, previous: bytes | None = None) -> None:
        self.master = _aesgcm(master)
        self.master_id = master_key_id(master)
        # every master key that can open a wrapped key, by id; the current one first
        self.masters = {self.master_id: self.master}
        if previous is not None and master_key_id(previous) != self.master_id:
            self.masters[master_key_id(previous)] = _aesgcm(previous)
        self.hash_key = hashlib.sha256(b"kafold erasure hash\0" + master).digest()

    def new_key(self) -> tuple[bytes, bytes]:
        """(key id, data key): a fresh random 256-bit data key."""
        raw = os.urandom(KEY_ID_BYTES + 32)
        return raw[:KEY_ID_BYTES], raw[KEY_ID_BYTES:]

    def wrap(self, subject: str, key_id: bytes, key: bytes) -> bytes:
        nonce = _nonce()
        return (WRAP_V2 + self.master_id + nonce
                + self.master.encrypt(nonce, key, b"kafold key\0" + subject.encode() + b"\0" + key_id))

    @staticmethod
    def wrapped_by(wrapped: bytes) -> bytes | None:
        """The id of the master key that wrapped `wrapped`; None for a key wrapped before ids were recorded."""
        if len(wrapped) == LEGACY_WRAPPED_BYTES:
            return None
        return wrapped[len(WRAP_V2):len(WRAP_V2) + MASTER_ID_BYTES]

    def current(self, wrapped: bytes) -> bool:
        """Whether `wrapped` is wrapped under the current master key (`kafold keys rotate` skips it)."""
        return self.wrapped_by(wrapped) == self.master_id

    def unwrap(self, subject: str, key_id: bytes, wrapped: bytes) -> bytes:
        aad = b"kafold key\0" + subject.encode() + b"\0" + key_id
        by = self.wrapped_by(wrapped)
        if by is None:
            candidates, body = list(self.masters.values()), wrapped
        else:
            found = self.masters.get(by)
            if found is None or not wrapped.startswith(WRAP_V2):
                raise DecryptError(f"a subject's data key is wrapped under master key {by.hex()}, which is not "
                                   "configured (privacy.master_key, or privacy.previous_master_key during a "
                                   "rotation)")
            candidates, body = [found], wrapped[len(WRAP_V2) + MASTER_ID_BYTES:]
        failed: Exception = KeyError("no master key")
        for master in candidates:  # one, but every configured one for a key wrapped before ids were recorded
            try:
                return bytes(master.decrypt(body[:NONCE_BYTES], body[NONCE_BYTES:], aad))
            except Exception as e:
                failed = e
        raise _not_authentic(failed, "a subject's data key does not unwrap: wrong master key, or a tampered key "
                                     "store entry") from None

    def subject_hash(self, subject: str) -> str:
        """The keyed hash recorded for an erasure: proves a given subject was forgotten, names none."""
        return hmac.new(self.hash_key, subject.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def seal(key_id: bytes, key: bytes, value: Any, aad: bytes) -> str:
        return Cipher.seal_with(_aesgcm(key), key_id, value, aad)

    @staticmethod
    def seal_with(aead: Any, key_id: bytes, value: Any, aad: bytes) -> str:
        """`seal` under a data key's AESGCM object (the KeyRing keeps one per key)."""
        nonce = _nonce()
        sealed = aead.encrypt(nonce, orjson.dumps(value), aad)
        # base64.urlsafe_b64encode without its Python-level steps
        return PREFIX + binascii.b2a_base64(key_id + nonce + sealed, newline=False).decode().replace(
            "+", "-").replace("/", "_")

    @staticmethod
    def blob(token: str) -> bytes:
        """A sealed value's bytes: key id | nonce | ciphertext+tag; DecryptError when it is not a sealed value."""
        try:  # base64.urlsafe_b64decode, without its Python-level steps (a third of opening a value)
            blob = binascii.a2b_base64(token[len(PREFIX):].replace("-", "+").replace("_", "/"), strict_mode=True)
        except (ValueError, binascii.Error):
            raise DecryptError("a protected value is not valid base64") from None
        if len(blob) < KEY_ID_BYTES + NONCE_BYTES + 16:
            raise DecryptError("a protected value is too short")
        return blob

    @staticmethod
    def key_id(token: str) -> bytes:
        """The key id a sealed value names; DecryptError when it is not a sealed value."""
        return Cipher.blob(token)[:KEY_ID_BYTES]

    @staticmethod
    def open(key: bytes, token: str, aad: bytes) -> Any:
        return Cipher.open_blob(_aesgcm(key), Cipher.blob(token), aad)

    @staticmethod
    def open_blob(aead: Any, blob: bytes, aad: bytes) -> Any:
        """The value of a sealed blob (`blob`) under a data key's AESGCM object (kept by the KeyRing: building one
        per value cost as much as the decryption)."""
        try:
            return orjson.loads(aead.decrypt(blob[KEY_ID_BYTES:KEY_ID_BYTES + NONCE_BYTES],
                                             blob[KEY_ID_BYTES + NONCE_BYTES:], aad))
        except Exception as e:
            raise _not_authentic(e, "a protected value does not authenticate (tampered, moved to another field or "
                                    "subject, or sealed under another master key)") from None


def _not_authentic(e: Exception, what: str) -> DecryptError:
    """DecryptError(`what`) for cryptography's InvalidTag (a failed authentication); any other error raised again.
    InvalidTag is imported here, when a decryption has failed: an import statement per decryption cost ~5 %."""
    # cryptography: kafold[daemon], not in the core install
    from cryptography.exceptions import InvalidTag

    if not isinstance(e, InvalidTag):
        raise e
    return DecryptError(what)


def _aad_tail(type_name: str, path: str) -> bytes:
    """A protected field's associated data after its subject: `\\0 event type \\0 path` (the one definition)."""
    return f"\0{type_name}\0{path}".encode()


def state_aad(aggregate: str, aggregate_id: str) -> bytes:
    """A sealed snapshot state's associated data: it opens only as the snapshot of that aggregate."""
    return f"kafold snapshot\0{aggregate}\0{aggregate_id}".encode()


class KeyStore:
    """Where wrapped data keys live: get, create on first use, forget; a `kafold.key_stores` entry point
    (`[privacy] key_store`), built by `open`. PostgreSQL's (`<schema>.subject_keys`, PgKeyStore) is the default;
    kafold.keystore_dir keeps them in files outside the database."""

    @classmethod
    def open(cls, setup: Setup) -> KeyStore:
        """The store a configuration's protection names (its [privacy] and [postgres] settings)."""
        raise NotImplementedError

    def get(self, subject: str) -> tuple[bytes, bytes] | None:
        """(key id, wrapped key), or None when the subject has none."""
        raise NotImplementedError

    def get_many(self, subjects: list[str]) -> dict[str, tuple[bytes, bytes]]:
        """The keys of those of `subjects` that have one (one round trip where the store can)."""
        return {s: row for s in subjects if (row := self.get(s)) is not None}

    def create(self, subject: str, key_id: bytes, wrapped: bytes) -> tuple[bytes, bytes]:
        """Insert unless present (INSERT ... ON CONFLICT DO NOTHING); the subject's (key id, wrapped key) after."""
        raise NotImplementedError

    def create_many(self, rows: list[tuple[str, bytes, bytes]]) -> dict[str, tuple[bytes, bytes]]:
        """`create` for each (subject, key id, wrapped key) (one round trip where the store can)."""
        return {subject: self.create(subject, key_id, wrapped) for subject, key_id, wrapped in rows}

    def forget(self, subject: str, subject_hash: str, actor: str, key_id: bytes | None) -> bool:
        """Delete the subject's key `key_id` (the one the erasure log recorded; None: delete none) and record the
        erasure; True when a key was deleted."""
        raise NotImplementedError

    def reapply(self, erasures: list[tuple[bytes, str, str]]) -> list[str]:
        """Delete the keys whose ids are among (key id, subject hash, actor) `erasures` (the erasure log's, after a
        restore), each recorded as an erasure again; the subjects whose keys were deleted."""
        raise NotImplementedError

    def erasure_mark(self) -> Any:
        """A value that changes whenever an erasure is recorded (the erasures table is append-only): an unchanged
        mark tells a cache that no key it holds was deleted meanwhile."""
        raise NotImplementedError

    def recent_erasures(self) -> list[tuple[int, str]]:
        """(id, subject hash) of the erasures of the last RECENT_ERASURES_S seconds."""
        raise NotImplementedError

    def scan(self, after: str, limit: int) -> list[tuple[str, bytes, bytes]]:
        """Up to `limit` (subject, key id, wrapped key) after subject `after` ("": from the start) in the store's
        own order (PostgreSQL: subject order): a rotation's walk."""
        raise NotImplementedError

    def rewrap(self, rows: list[tuple[str, bytes, bytes, bytes]]) -> int:
        """Replace each (subject, key id, old wrapped, new wrapped) unless the entry changed meanwhile (forgotten,
        or rewrapped by another run); how many were replaced."""
        raise NotImplementedError

    def count(self) -> int:
        """How many subjects hold a key."""
        raise NotImplementedError

    def purge(self, force: bool = False) -> bool:
        """Remove the bytes of deleted (and replaced) wrapped keys from the store's files, when erasures or rewraps
        happened since the last purge (or `force`); True when it purged. Nothing to do where deletion already
        removes them."""
        return False

    def close(self) -> None:
        """Release connections and files."""


class MemoryKeyStore(KeyStore):
    """Keys in a dict: for tests and tools that never share keys."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[bytes, bytes]] = {}
        self.erasures: list[tuple[str, str]] = []

    @classmethod
    def open(cls, setup: Setup) -> KeyStore:
        return cls()

    def get(self, subject: str) -> tuple[bytes, bytes] | None:
        return self.keys.get(subject)

    def create(self, subject: str, key_id: bytes, wrapped: bytes) -> tuple[bytes, bytes]:
        return self.keys.setdefault(subject, (key_id, wrapped))

    def erasure_mark(self) -> Any:
        return len(self.erasures)

    def recent_erasures(self) -> list[tuple[int, str]]:
        return [(i, h) for i, (h, _) in enumerate(self.erasures)]

    def forget(self, subject: str, subject_hash: str, actor: str, key_id: bytes | None) -> bool:
        self.erasures.append((subject_hash, actor))
        row = self.keys.get(subject)
        if row is None or row[0] != key_id:
            return False
        del self.keys[subject]
        return True

    def reapply(self, erasures: list[tuple[bytes, str, str]]) -> list[str]:
        by_id = {key_id: (h, actor) for key_id, h, actor in erasures}
        gone = [s for s, (key_id, _) in self.keys.items() if key_id in by_id]
        for subject in gone:
            self.erasures.append(by_id[self.keys.pop(subject)[0]])
        return gone

    def scan(self, after: str, limit: int) -> list[tuple[str, bytes, bytes]]:
        return [(s, *self.keys[s]) for s in sorted(s for s in self.keys if s > after)[:limit]]

    def rewrap(self, rows: list[tuple[str, bytes, bytes, bytes]]) -> int:
        done = 0
        for subject, key_id, old, new in rows:
            if self.keys.get(subject) == (key_id, old):
                self.keys[subject] = (key_id, new)
                done += 1
        return done

    def count(self) -> int:
        return len(self.keys)


class PgKeyStore(KeyStore):
    """Keys in PostgreSQL, one autocommit connection per store (opened on first use, guarded by a lock)."""

    def __init__(self, pgc: PostgresConfig) -> None:
        # psycopg: kafold[daemon], not in the core install
        from psycopg import sql

        self.pgc = pgc
        schema = sql.Identifier(pgc.schema)
        self.q_get = sql.SQL("SELECT key_id, wrapped_key FROM {}.subject_keys WHERE subject = %s").format(schema)
        self.q_get_many = sql.SQL("SELECT subject, key_id, wrapped_key FROM {}.subject_keys WHERE subject = ANY(%s)"
                                  ).format(schema)
        self.q_create = sql.SQL(
            "INSERT INTO {}.subject_keys (subject, key_id, wrapped_key) VALUES (%s, %s, %s) "
            "ON CONFLICT (subject) DO NOTHING").format(schema)
        self.q_create_many = sql.SQL(
            "INSERT INTO {}.subject_keys (subject, key_id, wrapped_key) "
            "SELECT * FROM unnest(%s::text[], %s::bytea[], %s::bytea[]) ON CONFLICT (subject) DO NOTHING"
        ).format(schema)
        # count and newest id: an identity's ids may commit out of order, the count of rows only grows
        self.q_mark = sql.SQL("SELECT count(*), coalesce(max(id), 0) FROM {}.erasures").format(schema)
        self.q_recent = sql.SQL("SELECT id, subject_hash FROM {}.erasures WHERE erased_at > now() - %s * interval "
                                "'1 second'").format(schema)
        self.q_delete = sql.SQL("DELETE FROM {}.subject_keys WHERE subject = %s AND key_id = %s").format(schema)
        self.q_record = sql.SQL("INSERT INTO {}.erasures (subject_hash, actor, key_existed) VALUES (%s, %s, %s)"
                                ).format(schema)
        self.q_reapply = sql.SQL("DELETE FROM {}.subject_keys WHERE key_id = ANY(%s) RETURNING subject, key_id"
                                 ).format(schema)
        self.q_record_many = sql.SQL("INSERT INTO {}.erasures (subject_hash, actor, key_existed) "
                                     "SELECT h, a, true FROM unnest(%s::text[], %s::text[]) AS t(h, a)"
                                     ).format(schema)
        self.q_scan = sql.SQL("SELECT subject, key_id, wrapped_key FROM {}.subject_keys WHERE subject > %s "
                              "ORDER BY subject LIMIT %s").format(schema)
        self.q_rewrap = sql.SQL(
            "UPDATE {0}.subject_keys AS k SET wrapped_key = t.new FROM unnest(%s::text[], %s::bytea[], %s::bytea[], "
            "%s::bytea[]) AS t(subject, key_id, old, new) WHERE k.subject = t.subject AND k.key_id = t.key_id "
            "AND k.wrapped_key = t.old").format(schema)
        self.q_count = sql.SQL("SELECT count(*) FROM {}.subject_keys").format(schema)
        self.q_purged = sql.SQL("SELECT value FROM {}.key_store_state WHERE name = 'purged_at_change'").format(schema)
        self.q_changed = sql.SQL("SELECT value FROM {}.key_store_state WHERE name = 'changes'").format(schema)
        self.q_bump = sql.SQL("UPDATE {}.key_store_state SET value = value + %s WHERE name = 'changes'"
                              ).format(schema)
        self.q_mark_purged = sql.SQL("UPDATE {}.key_store_state SET value = %s WHERE name = 'purged_at_change'"
                                     ).format(schema)
        self.q_vacuum = sql.SQL("VACUUM FULL {}.subject_keys").format(schema)
        self.q_owner = sql.SQL("SELECT pg_has_role(c.relowner, 'USAGE') FROM pg_class c JOIN pg_namespace n ON "
                               "n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = 'subject_keys'")
        self.conn: Any = None
        self.lock = threading.Lock()

    @classmethod
    def open(cls, setup: Setup) -> KeyStore:
        return cls(setup.postgres)

    def _conn(self) -> Any:
        if self.conn is None or self.conn.closed:
            from kafold import db  # it imports psycopg (kafold[daemon]): this module loads without it

            self.conn = db.connect(self.pgc)
        return self.conn

    def _run(self, step: Callable[[Any], Any]) -> Any:
        """`step(connection)` under the lock; PostgreSQL unreachable is retried with backoff (kafold.retry) for
        STORE_RETRY_S, then a FatalError naming it (a sealing write is then refused, not written in clear)."""
        # psycopg: kafold[daemon], not in the core install
        import psycopg

        def once() -> Any:
            with self.lock:
                try:
                    return step(self._conn())
                except psycopg.OperationalError as e:
                    if self.conn is not None:
                        self.conn.close()
                    raise RetriableError(f"PostgreSQL unreachable: {str(e).splitlines()[0] if str(e) else e}"
                                         ) from e

        def warn(e: RetriableError, delay: float) -> None:
            log.warning("protect.keys_unavailable", error=str(e), retry_in_s=delay)

        try:
            return retrying(once, within_s=STORE_RETRY_S, on_retry=warn)
        except RetriableError as e:
            raise FatalError(f"subject keys unavailable: {e}") from e

    def get(self, subject: str) -> tuple[bytes, bytes] | None:
        row = self._run(lambda conn: conn.execute(self.q_get, (subject,)).fetchone())
        return None if row is None else (bytes(row[0]), bytes(row[1]))

    def get_many(self, subjects: list[str]) -> dict[str, tuple[bytes, bytes]]:
        # planned for its values each time (kafold.db.BY_KEYS; not imported: this module loads without psycopg)
        rows = self._run(lambda conn: conn.execute(self.q_get_many, (subjects,), prepare=False).fetchall())
        return {subject: (bytes(key_id), bytes(wrapped)) for subject, key_id, wrapped in rows}

    def create(self, subject: str, key_id: bytes, wrapped: bytes) -> tuple[bytes, bytes]:
        def step(conn: Any) -> Any:
            conn.execute(self.q_create, (subject, key_id, wrapped))
            return conn.execute(self.q_get, (subject,)).fetchone()

        row = self._run(step)
        return bytes(row[0]), bytes(row[1])

    def erasure_mark(self) -> Any:
        return self._run(lambda conn: tuple(conn.execute(self.q_mark).fetchone()))

    def recent_erasures(self) -> list[tuple[int, str]]:
        rows = self._run(lambda conn: conn.execute(self.q_recent, (RECENT_ERASURES_S,)).fetchall())
        return [(int(i), str(h)) for i, h in rows]

    def create_many(self, rows: list[tuple[str, bytes, bytes]]) -> dict[str, tuple[bytes, bytes]]:
        subjects = [r[0] for r in rows]

        def step(conn: Any) -> Any:
            conn.execute(self.q_create_many, (subjects, [r[1] for r in rows], [r[2] for r in rows]))
            return conn.execute(self.q_get_many, (subjects,), prepare=False).fetchall()  # see get_many

        return {subject: (bytes(key_id), bytes(wrapped)) for subject, key_id, wrapped in self._run(step)}

    def forget(self, subject: str, subject_hash: str, actor: str, key_id: bytes | None) -> bool:
        def step(conn: Any) -> bool:
            with conn.transaction():
                deleted = key_id is not None and conn.execute(self.q_delete, (subject, key_id)).rowcount > 0
                conn.execute(self.q_record, (subject_hash, actor, deleted))
                if deleted:
                    conn.execute(self.q_bump, (1,))
            return deleted

        return bool(self._run(step))

    def reapply(self, erasures: list[tuple[bytes, str, str]]) -> list[str]:
        by_id = {key_id: (h, actor) for key_id, h, actor in erasures}
        ids = list(by_id)
        gone: list[str] = []
        for i in range(0, len(ids), REAPPLY_BATCH):  # a bounded statement per batch; the index on key_id finds them
            batch = {k: by_id[k] for k in ids[i:i + REAPPLY_BATCH]}
            gone += self._run(functools.partial(self._reapply_batch, by_id=batch))
        return gone

    def _reapply_batch(self, conn: Any, by_id: dict[bytes, tuple[str, str]]) -> list[str]:
        """One batch of `reapply`, in one transaction: the keys deleted and their erasures recorded again."""
        with conn.transaction():
            rows = conn.execute(self.q_reapply, (list(by_id),), prepare=False).fetchall()
            if rows:
                found = [by_id[bytes(key_id)] for _, key_id in rows]
                conn.execute(self.q_record_many, ([h for h, _ in found], [a for _, a in found]))
                conn.execute(self.q_bump, (len(rows),))
        return [str(subject) for subject, _ in rows]

    def scan(self, after: str, limit: int) -> list[tuple[str, bytes, bytes]]:
        rows = self._run(lambda conn: conn.execute(self.q_scan, (after, limit)).fetchall())
        return [(str(s), bytes(k), bytes(w)) for s, k, w in rows]

    def rewrap(self, rows: list[tuple[str, bytes, bytes, bytes]]) -> int:
        def step(conn: Any) -> int:
            with conn.transaction():
                done = int(conn.execute(self.q_rewrap, tuple(list(c) for c in zip(*rows, strict=True))).rowcount)
                conn.execute(self.q_bump, (done,))  # the old wrapped keys stay in dead row versions: purge them
            return done

        return int(self._run(step)) if rows else 0

    def count(self) -> int:
        return int(self._run(lambda conn: conn.execute(self.q_count).fetchone()[0]))

    def purge(self, force: bool = False) -> bool:
        """`VACUUM FULL` of the keys table when keys were deleted or rewrapped since the last purge: it writes the
        live rows to a new file and unlinks the old one. A plain VACUUM would not do: it marks a dead row's space
        free but leaves its bytes in the page until a new row overwrites them. The table is locked while it is
        copied (key lookups wait: ~1 s per 100,000 keys); a purge that cannot get the lock within 5 s (a long
        transaction holds it) gives up and is tried again at the next interval."""
        # psycopg is imported where it is used: this module loads without it (Spark's driver, pure tools)
        from psycopg.errors import LockNotAvailable

        def step(conn: Any) -> bool:
            changes = int(conn.execute(self.q_changed).fetchone()[0])
            if not force and changes == int(conn.execute(self.q_purged).fetchone()[0]):
                return False
            if not conn.execute(self.q_owner, (self.pgc.schema,)).fetchone()[0]:
                # VACUUM skips a table its role does not own with a mere warning: the bytes would stay, unsaid
                raise FatalError(f"cannot purge deleted keys: this role does not own {self.pgc.schema}.subject_keys "
                                 "(the role that ran kafold's migrations does; run `kafold keys purge` as it)")
            conn.execute("SET lock_timeout = '5s'")
            try:
                conn.execute(self.q_vacuum)
            except LockNotAvailable:  # an OperationalError, which `_run` would take for PostgreSQL unreachable
                log.info("protect.keys_purge_deferred", reason="the keys table is locked by another transaction")
                return False
            finally:
                conn.execute("RESET lock_timeout")
            conn.execute(self.q_mark_purged, (changes,))
            return True

        return bool(self._run(step))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()



_RINGS: weakref.WeakSet[KeyRing] = weakref.WeakSet()  # every ring of this process: forget drops from all
_Entry = tuple[bytes | None, bytes | None, Any]  # a KeyRing's (key id, key, the key's AESGCM object) of a subject


class KeyRing:
    """Unwrapped data keys by subject, trusted a TTL at a time (see the module docstring)."""

    def __init__(self, cipher: Cipher, store: KeyStore, ttl_s: float = CACHE_TTL_S,
                 cache_max: int = CACHE_MAX, erasure_log: ErasureLog | None = None) -> None:
        self.cipher, self.store, self.ttl_s, self.cache_max = cipher, store, ttl_s, cache_max
        self.erasure_log = erasure_log  # where deleted keys are recorded outside the store (kafold.erasure_log)
        self.cache: dict[str, _Entry] = {}  # by subject; (None, None, None): the subject has no key
        self.gone: set[tuple[str, bytes]] = set()  # (subject, key id) of keys confirmed deleted
        self.mark: Any = None  # the store's erasure mark at the last look
        self.trusted_until = 0.0  # CLOCK_MONOTONIC: until then the cache is used without another look at the mark
        # Bumped whenever cached keys are dropped: a holder of "these subjects are cached" (Protector.prefetch's
        # record keys) starts over when it moves.
        self.generation = 0
        self.store_reads = 0  # key lookups that went to the store (cache misses, batch prefetches): /metrics
        _RINGS.add(self)

    def trust(self, margin: float = 0.0) -> None:
        """Look at the store's erasure mark when the cache's trust lapses within `margin` seconds: unchanged, what is
        cached is trusted for another TTL; moved, the cache is dropped (every key is fetched again). The mark is
        read before any key it covers is fetched, so an erasure after that read shows at the next look."""
        now = time.monotonic()
        if now + margin < self.trusted_until:
            return
        mark = self.store.erasure_mark()
        if mark != self.mark:
            self.mark = mark
            self.drop()
        self.trusted_until = now + self.ttl_s

    def drop(self, subjects: Iterable[str] | None = None) -> None:
        """Drop the cached keys of `subjects` (default: all): they are fetched again when next needed."""
        if subjects is None:
            self.cache.clear()
        else:
            for subject in subjects:
                self.cache.pop(subject, None)
        self.generation += 1

    def _keep(self, subject: str, key_id: bytes | None, key: bytes | None) -> _Entry:
        if len(self.cache) >= self.cache_max:  # the oldest cached tenth, not all: no cliff of lookups after it
            self.drop(list(islice(self.cache, max(1, self.cache_max // 10))))
        entry = self.cache[subject] = (key_id, key, None if key is None else _aesgcm(key))
        return entry

    def _fetch(self, subject: str) -> _Entry:
        """The subject's entry read from the store, and cached (the caller has called `trust`)."""
        self.store_reads += 1
        row = self.store.get(subject)
        if row is None:
            return self._keep(subject, None, None)
        return self._keep(subject, row[0], self.cipher.unwrap(subject, row[0], row[1]))

    def lookup(self, subject: str) -> tuple[bytes | None, bytes | None]:
        """(key id, key) of the subject, (None, None) when it has none (forgotten or never written)."""
        self.trust()
        key_id, key, _ = self.cache.get(subject) or self._fetch(subject)
        return key_id, key

    def opener(self, subject: str, key_id: bytes) -> Any:
        """The AESGCM object of the subject's key `key_id` (the one a sealed value names), None when that key is
        gone (forgotten). Before a value reads as forgotten, a cached absence or another cached key id is checked
        against the store: a key created since it was cached (by the writer of a newer event of a subject whose
        earlier events were not protected) is found, not taken for an erasure. Key ids are random and a subject's
        key is only ever deleted or replaced by a new id, so a key id once seen gone stays gone."""
        self.trust()
        hit = self.cache.get(subject) or self._fetch(subject)
        if hit[0] == key_id:
            return hit[2]
        if (subject, key_id) in self.gone:
            return None
        self.store_reads += 1
        row = self.store.get(subject)
        if row is not None and row[0] == key_id:
            return self._keep(subject, row[0], self.cipher.unwrap(subject, row[0], row[1]))[2]
        if len(self.gone) >= CACHE_MAX:
            self.gone.clear()
        self.gone.add((subject, key_id))
        return None

    def current(self, subject: str) -> Any:
        """The AESGCM object of the subject's current key, None when it has none (forgotten or never written)."""
        self.trust()
        return (self.cache.get(subject) or self._fetch(subject))[2]

    def prefetch(self, subjects: Iterable[str]) -> None:
        """Look up the keys of `subjects` not cached, in one round trip (a batch's subjects before its records are
        opened one by one); the erasure mark first if the cache's trust would lapse while the batch is read (an
        expiry per entry once cost a round trip per subject: ~3 % of lookups, a fifth of a protected projection's
        time)."""
        self.trust(self.ttl_s / 2)
        cache = self.cache
        missing = {s for s in subjects if s not in cache}
        if not missing:
            return
        self.store_reads += 1
        found = self.store.get_many(list(missing))
        for subject in missing:
            row = found.get(subject)
            if row is None:
                self._keep(subject, None, None)
            else:
                try:
                    self._keep(subject, row[0], self.cipher.unwrap(subject, row[0], row[1]))
                except DecryptError:  # left to the record's own lookup, which fails that record alone
                    self.cache.pop(subject, None)

    def prepare_writing(self, subjects: Iterable[str], create: Iterable[str] = ()) -> None:
        """Before a batch seals values: the keys of `subjects` cached, and those of `create` that have none
        created, in two round trips for the batch instead of two for each new subject and one for each expired
        entry. Only the caller knows which subjects are new (an aggregate without events): a subject forgotten
        gets no key back until a protected value of it is written again."""
        wanted = set(subjects)
        self.prefetch(wanted)
        new = []
        for subject in set(create) & wanted:
            hit = self.cache.get(subject)  # absent: dropped by a full cache's reset; sealing looks it up alone
            if hit is not None and hit[1] is None:
                key_id, key = self.cipher.new_key()
                new.append((subject, key_id, key))
        if not new:
            return
        stored = self.store.create_many([(s, i, self.cipher.wrap(s, i, k)) for s, i, k in new])
        for subject, key_id, key in new:
            got = stored.get(subject)
            if got is None:  # forgotten again between the two statements: the next seal creates it
                self.cache.pop(subject, None)
            elif got[0] == key_id:
                self._keep(subject, key_id, key)
            else:  # another writer created it first
                self._keep(subject, got[0], self.cipher.unwrap(subject, got[0], got[1]))

    def sealer(self, subject: str) -> tuple[bytes, Any]:
        """(key id, the key's AESGCM object) to seal the subject's values with (its key created on first use)."""
        self.trust()
        hit = self.cache.get(subject)
        if hit is not None and hit[0] is not None:  # the common case, without `_writable`'s calls
            return hit[0], hit[2]
        key_id, _, aead = self._writable(subject)
        return key_id, aead

    def for_writing(self, subject: str) -> tuple[bytes, bytes]:
        self.trust()
        key_id, key, _ = self._writable(subject)
        return key_id, key

    def _writable(self, subject: str) -> tuple[bytes, bytes, Any]:
        """The subject's cache entry, its key created when it has none (the caller has called `trust`)."""
        key_id, key, aead = self.cache.get(subject) or self._fetch(subject)
        if key_id is not None and key is not None:
            return key_id, key, aead
        new_id, new_key = self.cipher.new_key()
        key_id, wrapped = self.store.create(subject, new_id, self.cipher.wrap(subject, new_id, new_key))
        key = new_key if key_id == new_id else self.cipher.unwrap(subject, key_id, wrapped)
        return key_id, key, self._keep(subject, key_id, key)[2]

    def forget(self, subject: str, actor: str) -> bool:
        """Delete the subject's key, record the erasure, and drop it from every ring of this process.

        Ordering: the key's id goes to the erasure log (acknowledged by the brokers) before the key is deleted. A
        crash between the two leaves a key that the log names, which the next re-apply (daemon start, `kafold db
        upgrade`, `kafold keys reapply`) deletes; the other order could leave a deleted key that no log names, and
        a restored backup would bring it back unnoticed. A key created after the lookup below (a write racing the
        forget) is not deleted: it is that of a new life of the subject, as if written just after the forget."""
        row = self.store.get(subject)
        digest = self.cipher.subject_hash(subject)
        if row is not None and self.erasure_log is not None:
            self.erasure_log.record(row[0], digest, actor)
        existed = self.store.forget(subject, digest, actor, None if row is None else row[0])
        _drop_everywhere([subject])
        return existed

    def reapply(self, erasures: list[tuple[bytes, str, str]]) -> list[str]:
        """Delete the keys the erasure log names that the store still holds (a restored backup's), and drop their
        subjects from every ring of this process; the subjects whose keys were deleted. Other processes see the
        erasures within their TTL (the store's erasure mark moves)."""
        gone = self.store.reapply(erasures) if erasures else []
        if gone:
            _drop_everywhere(gone)
        return gone


def _drop_everywhere(subjects: list[str]) -> None:
    for ring in list(_RINGS):
        ring.drop(subjects)


@dataclass(frozen=True)
class Rule:
    """One event type's protected paths and where its subject is."""

    paths: tuple[tuple[str, ...], ...]
    subject: str  # AGGREGATE_ID or "payload.<path>"

    @functools.cached_property
    def steps(self) -> tuple[tuple[tuple[str, ...], str, str], ...]:
        """Each path as (its parents, its field, its dotted name): split once, not per payload."""
        return tuple((p[:-1], p[-1], ".".join(p)) for p in self.paths)

    def subject_of(self, aggregate_id: str, payload: Mapping[str, Any]) -> str:
        if self.subject == AGGREGATE_ID:
            return aggregate_id
        node: Any = payload
        for part in self.subject.split(".")[1:]:
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is None or isinstance(node, dict | list):
            raise ValueError(f"protected event: subject {self.subject!r} is missing or not a scalar")
        return str(node)


class Protector:
    """Seals the protected fields of payloads on write and opens them on read, for rules keyed by
    (aggregate type, event type)."""

    def __init__(self, rules: Mapping[tuple[str, str], Rule], ring: KeyRing, placeholder: Any = None,
                 setup: Setup | None = None) -> None:
        self.rules, self.ring, self.placeholder = dict(rules), ring, placeholder
        # What it was built from (`build_setup`), for the processes it hands work to (a task or aggregate worker
        # process, a copy worker, a Spark task), which build their own from it; None for one built by hand.
        self.setup = setup
        # Some rule's subject is the aggregate id, which is a kafold record's key: a batch's keys can be looked up
        # before its records are decoded (`prefetch`).
        self.keyed_by_record = any(rule.subject == AGGREGATE_ID for rule in self.rules.values())
        # Record keys whose subjects the ring has cached since its generation `_cached_at` (prefetch skips them)
        self._cached: set[bytes | None] = set()
        self._cached_at = ring.generation
        # Types whose protected fields are all top-level and whose subject is the aggregate id (the common case):
        # (field, the tail of its associated data after the subject) each, for `event`'s fast path.
        self._flat = {(a, t): tuple((p[0], _aad_tail(t, p[0])) for p in rule.paths)
                      for (a, t), rule in self.rules.items()
                      if rule.subject == AGGREGATE_ID and all(len(p) == 1 for p in rule.paths)}

    def prefetch(self, record_keys: Iterable[bytes | None]) -> None:
        """Look up the subject keys a batch of kafold records will need, in one round trip (see keyed_by_record).
        Record keys already looked up since the ring last dropped keys are skipped by a set difference, not
        decoded and checked one by one (docs/benchmarks.md, privacy). Shared by the runner threads of a process:
        a race can only leave a key marked looked up that is not cached, which its record's own lookup fetches."""
        if not self.keyed_by_record:
            return
        ring = self.ring
        ring.trust(ring.ttl_s / 2)  # the trust first: it may drop the cache, and with it what `_cached` says
        if self._cached_at != ring.generation or len(self._cached) >= CACHE_MAX:
            self._cached, self._cached_at = set(), ring.generation
        keys = set(record_keys)
        keys -= self._cached
        if not keys:
            return
        generation = ring.generation
        # keys PostgreSQL cannot hold (a NUL) are left to the record's own lookup
        ring.prefetch(k.decode("utf-8", "replace") for k in keys if k and b"\0" not in k)
        if ring.generation == generation:
            self._cached |= keys

    def seal(self, aggregate: str, type_name: str, aggregate_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        """`payload` with its protected values sealed (a copy; unchanged when the type has no rule)."""
        rule = self.rules.get((aggregate, type_name))
        if rule is None:
            return payload
        subject = rule.subject_of(aggregate_id, payload)
        return self._each(payload, rule, subject, type_name, self.ring.sealer(subject))

    def resealed(self, event: Event) -> Event:
        """`event` (as a reader opened it) with its protected values sealed again under the subject's key: what
        kafold keeps of an opened event (a parked effect) or writes on (a `kafka` effect's derived events) holds
        no clear value. A forgotten subject's values are the placeholder by then; sealing them creates a new key
        of the subject, as any new write of it does, which opens none of the old values."""
        rule = self.rules.get((event.aggregate_type, event.type))
        if rule is None:
            return event
        return reshaped(event, event.type, event.schema_version,
                        self.seal(event.aggregate_type, event.type, event.aggregate_id, event.payload))

    def _of(self, aggregate: str) -> list[Rule]:
        """The rules of `aggregate`'s event types."""
        return [r for (a, _), r in self.rules.items() if a == aggregate]

    def prepare_writing(self, aggregate: str, aggregate_ids: Iterable[str], new: Iterable[str]) -> None:
        """Before a batch of `aggregate`'s commands is decided: the keys of subjects that are the aggregate id
        fetched, and those of `new` aggregates (no events yet) created, for the batch at once
        (KeyRing.prepare_writing). Ids PostgreSQL cannot hold (a NUL) are left to their own lookup."""
        if any(r.subject == AGGREGATE_ID for r in self._of(aggregate)):
            self.ring.prepare_writing((i for i in aggregate_ids if "\0" not in i), (i for i in new if "\0" not in i))

    def unseal(self, aggregate: str, type_name: str, aggregate_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        """`payload` with its sealed values opened (placeholder when the key is gone); DecryptError when one
        does not authenticate."""
        rule = self.rules.get((aggregate, type_name))
        if rule is None:
            return payload
        return self._each(payload, rule, rule.subject_of(aggregate_id, payload), type_name, None)

    def _each(self, payload: dict[str, Any], rule: Rule, subject: str, type_name: str,
              sealer: tuple[bytes, Any] | None) -> dict[str, Any]:
        """A copy of `payload` (and of the dicts on the way) with each present, non-null value at the rule's paths
        sealed with `sealer` (`KeyRing.sealer`), or opened when there is none, under its associated data
        (`subject \\0 event type \\0 path`, its tail from `_aad_tail`). Sealing and opening share this walk and pick
        their step here, not in a closure: making and calling one per payload cost ~10 % of either."""
        out = dict(payload)
        for parents, name, path in rule.steps:
            node = out
            for part in parents:  # none for a top-level field, the common case
                child = node.get(part)
                if not isinstance(child, dict):
                    break
                node[part] = node = dict(child)
            else:
                value = node.get(name)
                if value is not None:
                    aad = subject.encode() + _aad_tail(type_name, path)
                    node[name] = (self._open(subject, type_name, path, value, aad) if sealer is None else
                                  Cipher.seal_with(sealer[1], sealer[0], value, aad))
        return out

    def _open(self, subject: str, type_name: str, path: str, value: Any, aad: bytes) -> Any:
        """One sealed value opened (the placeholder when its key is gone)."""
        if type(value) is not str or not value.startswith(PREFIX):
            # written before the field was protected, or by hand: refused rather than passed on as data
            raise DecryptError(f"protected field {path!r} of {type_name!r} is not a sealed value")
        blob = Cipher.blob(value)
        aead = self.ring.opener(subject, blob[:KEY_ID_BYTES])
        if aead is None:
            self._not_relabelled(subject, blob, aad, f"protected field {path!r} of {type_name!r}")
            return self.placeholder
        return Cipher.open_blob(aead, blob, aad)

    def _not_relabelled(self, subject: str, blob: bytes, aad: bytes, what: str) -> None:
        """Before a value whose key id names no key of the subject reads as forgotten: DecryptError when it opens
        under the subject's current key. The key id is not authenticated (it is not in the associated data), so a
        value of a live subject with its key id altered would otherwise read as an erasure, silently; a value of
        an earlier life of the subject (forgotten, then written again) does not open under the new key."""
        current = self.ring.current(subject)
        if current is None:
            return
        try:
            Cipher.open_blob(current, blob, aad)
        except DecryptError:
            return
        raise DecryptError(f"{what}: the key id it names was altered (it opens under the subject's current key)")

    def for_aggregate(self, aggregate: str) -> Callable[[str, str, dict[str, Any]], dict[str, Any]] | None:
        """`unseal` bound to one aggregate type (the fold's hook), or None when it protects nothing."""
        if not self._of(aggregate):
            return None
        return lambda type_name, aid, payload: self.unseal(aggregate, type_name, aid, payload)

    def subjects_in_payloads(self, aggregate: str) -> bool:
        """Whether some rule of `aggregate` takes its subject from a payload path (a state may then hold several
        subjects' data)."""
        return any(r.subject != AGGREGATE_ID for r in self._of(aggregate))

    def seals_states(self, aggregate: str) -> bool:
        """Whether snapshots of `aggregate` are sealed whole: it has rules, and every rule's subject is the
        aggregate id (so the state holds one subject's data only; payload-path subjects are refused at load)."""
        found = self._of(aggregate)
        return bool(found) and all(r.subject == AGGREGATE_ID for r in found)

    def seal_state(self, aggregate: str, aggregate_id: str, state: Any) -> str:
        """A snapshot's state JSON sealed under the aggregate's (subject's) key, bound to the aggregate."""
        key_id, key = self.ring.for_writing(aggregate_id)
        return Cipher.seal(key_id, key, state, state_aad(aggregate, aggregate_id))

    def open_state(self, aggregate: str, aggregate_id: str, sealed: Any) -> Any:
        """A sealed snapshot state's JSON; Forgotten when its key is gone, DecryptError when it is not a sealed
        state or does not authenticate."""
        if not isinstance(sealed, str) or not sealed.startswith(PREFIX):
            raise DecryptError("the snapshot state is not sealed (written before the aggregate had protect rules)")
        blob = Cipher.blob(sealed)
        aead = self.ring.opener(aggregate_id, blob[:KEY_ID_BYTES])
        if aead is None:
            self._not_relabelled(aggregate_id, blob, state_aad(aggregate, aggregate_id), "the snapshot state")
            raise Forgotten(f"the key of {aggregate}/{aggregate_id} is gone (forgotten)")
        return Cipher.open_blob(aead, blob, state_aad(aggregate, aggregate_id))

    def event(self, event: Event, raw: Any = None) -> Event:
        """A decoded event with its protected fields opened (the sink intake's hook, on the event it has just
        decoded: the opened payload replaces the event's own in place); RecordError with reason `decrypt-failed`
        when one does not authenticate."""
        at = (event.aggregate_type, event.type)
        flat = self._flat.get(at)
        if flat is not None and self._opened_in_place(event.payload, event.aggregate_id, flat):
            return event
        rule = self.rules.get(at)
        if rule is None:
            return event
        try:
            subject = rule.subject_of(event.aggregate_id, event.payload)
            payload = self._each(event.payload, rule, subject, event.type, None)
        except (DecryptError, ValueError) as e:
            raise RecordError(f"event {event.event_id}: {e}", raw=raw, reason="decrypt-failed") from e
        return adopt_payload(event, payload)  # the intake's own, just decoded (see Intake.event)

    def _opened_in_place(self, payload: dict[str, Any], subject: str, fields: tuple[tuple[str, bytes], ...]) -> bool:
        """`event`'s fast path: the protected top-level `fields` of `payload` (the intake's own, just decoded)
        opened in place when the subject's key is cached and trusted and every value is sealed under it. False,
        the payload untouched, for anything else (a key not cached or gone, a value not sealed or not
        authentic): the general path (`_each`, `_open`) then reads it and names any failure. The general path's
        steps (Cipher.blob, KeyRing.opener, Cipher.open_blob) are inlined here: their calls cost as much as the
        decryption (docs/benchmarks.md, privacy)."""
        ring = self.ring
        hit = ring.cache.get(subject)
        if hit is None or hit[2] is None or time.monotonic() >= ring.trusted_until:
            return False
        key_id, _, aead = hit
        head = subject.encode()
        opened = []
        try:
            for name, tail in fields:
                value = payload.get(name)
                if value is None:
                    continue
                if type(value) is not str or not value.startswith(PREFIX):
                    return False
                blob = binascii.a2b_base64(value[len(PREFIX):].replace("-", "+").replace("_", "/"), strict_mode=True)
                if blob[:KEY_ID_BYTES] != key_id:
                    return False
                opened.append((name, orjson.loads(aead.decrypt(blob[KEY_ID_BYTES:KEY_ID_BYTES + NONCE_BYTES],
                                                               blob[KEY_ID_BYTES + NONCE_BYTES:], head + tail))))
        except Exception:
            return False
        for name, value in opened:
            payload[name] = value
        return True


class ErasureWatch:
    """Erasures recorded by any process (a `kafold subjects forget` beside a running daemon) since the last look,
    as the keyed hashes the erasures table holds; the holder of decrypted data (the aggregate runtime's states)
    matches them against the subjects it holds (`Cipher.subject_hash`)."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self.mark = store.erasure_mark()
        self.seen = {i for i, _ in store.recent_erasures()}  # erasures before the watch began are not news

    def new(self) -> set[str]:
        """Hashes of the subjects forgotten since the last call (one small query when nothing was)."""
        mark = self.store.erasure_mark()
        if mark == self.mark:
            return set()
        self.mark = mark
        rows = self.store.recent_erasures()
        fresh = {h for i, h in rows if i not in self.seen}
        self.seen = {i for i, _ in rows}
        return fresh


def state_sealer(protector: Protector | None, aggregate: str) -> Protector | None:
    """The protector that seals and opens `aggregate`'s snapshot states, or None when they are stored in clear."""
    return protector if protector is not None and protector.seals_states(aggregate) else None


def rules(cfg: KafoldConfig) -> dict[tuple[str, str], Rule]:
    return {(a.name, p.type): Rule(tuple(tuple(f.split(".")) for f in p.fields), p.subject)
            for a in cfg.aggregates for p in a.protect}


@dataclass(frozen=True)
class Setup:
    """What a process needs to build its Protector; picklable, so a task process gets it from the daemon (the
    master key is read where it is built, from the reference: never sent)."""

    rules: dict[tuple[str, str], Rule]
    privacy: PrivacyConfig
    postgres: PostgresConfig
    kafka: KafkaConfig | None = None  # where the erasure log is; None: forgets are not logged (tests, tools)


def setup(cfg: KafoldConfig) -> Setup | None:
    """The configuration's protection (None when it protects nothing)."""
    found = rules(cfg)
    return Setup(found, cfg.privacy, cfg.postgres, cfg.kafka) if found else None


def build(cfg: KafoldConfig, store: KeyStore | None = None) -> Protector | None:
    """A new Protector of a configuration (None when it protects nothing); a missing master key is a ConfigError
    naming the variable or file. Its builder owns it (the daemon host, a command) and hands it to the readers that
    open or seal protected fields: nothing in this module keeps it, so two configurations in one process (two
    daemons, a daemon and a command) each use their own."""
    found = setup(cfg)
    return None if found is None else build_setup(found, store)


def build_setup(found: Setup, store: KeyStore | None = None) -> Protector:
    """`build` from a Setup (what a task, aggregate worker or copy worker process is sent: it builds its own)."""
    ring = KeyRing(cipher(found.privacy), store or open_store(found), cache_max=found.privacy.key_cache_max,
                   erasure_log=erasure_log(found))
    return Protector(found.rules, ring, found.privacy.placeholder, found)


def sent(protector: Protector | None) -> Setup | None:
    """What another process builds its own Protector from (a task, aggregate worker or copy worker process, a
    Spark task): `protector`'s Setup, None when nothing is protected; FatalError for one built by hand (no Setup),
    which no other process could rebuild."""
    if protector is None:
        return None
    if protector.setup is None:
        raise FatalError("a Protector built by hand (no kafold.protect.Setup) cannot be handed to another process: "
                         "build it with kafold.protect.build")
    return protector.setup


def cipher(privacy: PrivacyConfig) -> Cipher:
    """The Cipher of the configured master key (and the previous one, during a rotation)."""
    return Cipher(master_key(privacy), previous_master_key(privacy))


def erasure_log(found: Setup) -> ErasureLog | None:
    """The erasure log of a Setup (opened on first use), None without Kafka settings."""
    if found.kafka is None:
        return None
    return ErasureLog(found.kafka, found.privacy.erasure_topic)


def open_store(found: Setup) -> KeyStore:
    """The `[privacy] key_store` named by a Setup, from the `kafold.key_stores` entry points."""
    matches = entry_points(group=KEY_STORES, name=found.privacy.key_store)
    if not matches:
        raise ConfigError([f"privacy.key_store: no key store {found.privacy.key_store!r} is installed "
                           f"(entry point group {KEY_STORES})"])
    cls = next(iter(matches)).load()
    if not (isinstance(cls, type) and issubclass(cls, KeyStore)):
        raise ConfigError([f"privacy.key_store: {found.privacy.key_store!r} is not a kafold.protect.KeyStore"])
    return cls.open(found)
