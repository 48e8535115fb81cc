"""The subject key store's contract (kafold.protect.KeyStore) on each store, master-key ids in wrapped keys, the
erasure log written before a key is deleted, and a rotation that resumes where it was interrupted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kafold import key_rotation
from kafold.erasure_log import Erasure
from kafold.errors import FatalError
from kafold.keystore_dir import DirectoryKeyStore
from kafold.protect import (
    LEGACY_WRAPPED_BYTES,
    NONCE_BYTES,
    Cipher,
    DecryptError,
    KeyRing,
    KeyStore,
    MemoryKeyStore,
    _aesgcm,
    master_key_id,
)

OLD, NEW = os.urandom(32), os.urandom(32)


class KeyStoreContract:
    """What every KeyStore does; subclassed per store (tests/security/test_key_store_pg.py runs it on PostgreSQL)."""

    def make(self) -> KeyStore:
        raise NotImplementedError

    @pytest.fixture
    def store(self) -> KeyStore:
        return self.make()

    def test_create_keeps_the_first_key_of_a_subject(self, store: KeyStore) -> None:
        assert store.create("s-1", b"k" * 8, b"w1") == (b"k" * 8, b"w1")
        assert store.create("s-1", b"j" * 8, b"w2") == (b"k" * 8, b"w1")
        assert store.get("s-1") == (b"k" * 8, b"w1") and store.get("s-2") is None
        assert store.get_many(["s-1", "s-2"]) == {"s-1": (b"k" * 8, b"w1")}

    def test_forget_deletes_only_the_named_key_and_moves_the_erasure_mark(self, store: KeyStore) -> None:
        store.create("s-1", b"k" * 8, b"w1")
        mark = store.erasure_mark()
        assert store.forget("s-1", "h1", "dpo", b"x" * 8) is False  # another key id: a later life, kept
        assert store.get("s-1") == (b"k" * 8, b"w1")
        assert store.forget("s-1", "h1", "dpo", b"k" * 8) is True
        assert store.get("s-1") is None
        assert store.erasure_mark() != mark
        assert "h1" in {h for _, h in store.recent_erasures()}

    def test_reapply_deletes_the_keys_the_log_names_and_no_other(self, store: KeyStore) -> None:
        store.create("gone", b"g" * 8, b"w1")
        store.create("kept", b"k" * 8, b"w2")
        mark = store.erasure_mark()
        assert store.reapply([(b"g" * 8, "hg", "reapply:dpo"), (b"z" * 8, "hz", "reapply:dpo")]) == ["gone"]
        assert store.get("gone") is None and store.get("kept") == (b"k" * 8, b"w2")
        assert store.erasure_mark() != mark
        assert store.reapply([(b"g" * 8, "hg", "reapply:dpo")]) == []

    def test_scan_walks_every_key_once_in_batches_and_rewrap_is_compare_and_set(self, store: KeyStore) -> None:
        for i in range(7):
            store.create(f"s-{i}", bytes([i]) * 8, b"old")
        seen, after = [], ""
        while rows := store.scan(after, 3):
            seen += [s for s, _, _ in rows]
            after = rows[-1][0]
        assert sorted(seen) == [f"s-{i}" for i in range(7)] and store.count() == 7
        assert store.rewrap([("s-0", b"\0" * 8, b"old", b"new"), ("s-1", b"\1" * 8, b"stale", b"new")]) == 1
        assert store.get("s-0") == (b"\0" * 8, b"new") and store.get("s-1") == (b"\1" * 8, b"old")


class TestMemoryKeyStore(KeyStoreContract):
    def make(self) -> KeyStore:
        return MemoryKeyStore()


class TestDirectoryKeyStore(KeyStoreContract):
    @pytest.fixture(autouse=True)
    def _dir(self, tmp_path: Path) -> None:
        self.root = tmp_path / "keys"

    def make(self) -> KeyStore:
        return DirectoryKeyStore(self.root)

    def test_a_deleted_key_file_is_zeroed_before_it_is_unlinked(self, store: KeyStore,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
        store.create("s-1", b"k" * 8, b"secret-wrapping")
        path = next((self.root / "keys").iterdir())
        seen: list[bytes] = []
        unlink = Path.unlink
        monkeypatch.setattr(Path, "unlink", lambda p, *a, **k: (seen.append(p.read_bytes()), unlink(p, *a, **k)))
        store.forget("s-1", "h", "dpo", b"k" * 8)
        assert seen and not seen[0].strip(b"\0")
        assert not path.exists()

    def test_another_process_store_on_the_same_directory_sees_the_keys(self, store: KeyStore) -> None:
        store.create("s-1", b"k" * 8, b"w")
        other = self.make()
        assert other.get("s-1") == (b"k" * 8, b"w")
        other.forget("s-1", "h", "dpo", b"k" * 8)
        assert store.get("s-1") is None


def test_a_wrapped_key_names_its_master_key_and_a_previous_key_still_opens_it() -> None:
    old = Cipher(OLD)
    wrapped = old.wrap("s", b"k" * 8, b"K" * 32)
    assert Cipher.wrapped_by(wrapped) == master_key_id(OLD) and old.current(wrapped)
    rotating = Cipher(NEW, previous=OLD)
    assert not rotating.current(wrapped)
    assert rotating.unwrap("s", b"k" * 8, wrapped) == b"K" * 32
    with pytest.raises(DecryptError, match=master_key_id(OLD).hex()):
        Cipher(NEW).unwrap("s", b"k" * 8, wrapped)


def test_a_key_wrapped_before_master_key_ids_opens_under_either_configured_key() -> None:
    nonce = os.urandom(NONCE_BYTES)
    legacy = nonce + _aesgcm(OLD).encrypt(nonce, b"K" * 32, b"kafold key\0s\0" + b"k" * 8)
    assert len(legacy) == LEGACY_WRAPPED_BYTES and Cipher.wrapped_by(legacy) is None
    assert Cipher(NEW, previous=OLD).unwrap("s", b"k" * 8, legacy) == b"K" * 32
    with pytest.raises(DecryptError):
        Cipher(NEW).unwrap("s", b"k" * 8, legacy)


class RecordingLog:
    """An erasure log in memory that can refuse, remembering what the store held when it was written."""

    def __init__(self, store: KeyStore, fail: bool = False) -> None:
        self.store, self.fail, self.records = store, fail, []  # type: list

    def record(self, key_id: bytes, subject_hash: str, actor: str) -> None:
        if self.fail:
            raise FatalError("not acknowledged")
        self.records.append((key_id, subject_hash, actor, self.store.get("s-1")))


def test_the_erasure_is_logged_before_the_key_is_deleted_and_a_refused_log_deletes_nothing() -> None:
    store = MemoryKeyStore()
    ring = KeyRing(Cipher(OLD), store, erasure_log=RecordingLog(store))  # type: ignore[arg-type]
    key_id, _ = ring.for_writing("s-1")
    assert ring.forget("s-1", "dpo") is True
    [(logged_id, digest, actor, held_then)] = ring.erasure_log.records  # type: ignore[union-attr]
    assert (logged_id, digest, actor) == (key_id, ring.cipher.subject_hash("s-1"), "dpo")
    assert held_then is not None  # the key was still there when its erasure was written
    refused = KeyRing(Cipher(OLD), store, erasure_log=RecordingLog(store, fail=True))  # type: ignore[arg-type]
    refused.for_writing("s-1")
    with pytest.raises(FatalError):
        refused.forget("s-1", "dpo")
    assert store.get("s-1") is not None


def test_reapply_drops_the_deleted_keys_from_every_ring_of_the_process() -> None:
    store = MemoryKeyStore()
    ring = KeyRing(Cipher(OLD), store)
    key_id, _ = ring.for_writing("gone")
    ring.for_writing("kept")
    assert ring.reapply([(key_id, "h", "reapply:dpo")]) == ["gone"]
    assert "gone" not in ring.cache and ring.lookup("gone") == (None, None)
    assert ring.lookup("kept")[0] is not None


def test_an_erasure_record_round_trips_and_names_no_subject() -> None:
    erasure = Erasure(b"k" * 8, "ab" * 32, "cli:dpo", 1.5)
    key, value = erasure.encode()
    assert key == (b"k" * 8).hex().encode() and Erasure.decode(value) == erasure
    with pytest.raises(ValueError):
        Erasure.decode(b"{}")


def test_an_interrupted_rotation_resumes_and_leaves_every_key_readable_under_the_new_master_key() -> None:
    store = MemoryKeyStore()
    old_ring = KeyRing(Cipher(OLD), store)
    keys = {f"s-{i:02}": old_ring.for_writing(f"s-{i:02}") for i in range(25)}
    rotating = Cipher(NEW, previous=OLD)
    seen: list[key_rotation.RotationProgress] = []

    def interrupt(p: key_rotation.RotationProgress) -> None:
        seen.append(p)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        key_rotation.rotate(store, rotating, batch=10, progress=interrupt)
    assert key_rotation.pending(store, rotating) == 5 and seen[-1] == key_rotation.RotationProgress(20, 20, 0, 25)
    done = key_rotation.rotate(store, rotating, batch=10)
    assert (done.rewrapped, done.current) == (5, 20) and key_rotation.pending(store, rotating) == 0
    new_only = KeyRing(Cipher(NEW), store)
    assert all(new_only.lookup(s) == k for s, k in keys.items())
