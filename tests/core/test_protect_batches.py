"""The key ring's batch paths (kafold.protect): a batch's keys fetched or created at once, and the cache trusted a
TTL at a time on one look at the erasure mark rather than a fetch per entry."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from kafold.protect import Cipher, DecryptError, ErasureWatch, KeyRing, MemoryKeyStore, Protector, Rule

MASTER = os.urandom(32)
RULES = {("customer", "Registered"): Rule((("email",),), "aggregate_id"),
         ("order", "Placed"): Rule((("email",),), "payload.customer_id")}


class Counting(MemoryKeyStore):
    """A MemoryKeyStore counting single and batch round trips."""

    def __init__(self) -> None:
        super().__init__()
        self.singles = self.batches = self.creates = self.create_batches = self.marks = 0

    def get(self, subject: str) -> tuple[bytes, bytes] | None:
        self.singles += 1
        return super().get(subject)

    def get_many(self, subjects: list[str]) -> dict[str, tuple[bytes, bytes]]:
        self.batches += 1
        return {s: row for s in subjects if (row := self.keys.get(s)) is not None}

    def create(self, subject: str, key_id: bytes, wrapped: bytes) -> tuple[bytes, bytes]:
        self.creates += 1
        return super().create(subject, key_id, wrapped)

    def erasure_mark(self) -> Any:
        self.marks += 1
        return super().erasure_mark()

    def create_many(self, rows: list[tuple[str, bytes, bytes]]) -> dict[str, tuple[bytes, bytes]]:
        self.create_batches += 1
        return {s: self.keys.setdefault(s, (i, w)) for s, i, w in rows}


def test_a_batch_creates_its_new_subjects_keys_at_once_and_seals_without_another_round_trip() -> None:
    store = Counting()
    p = Protector(RULES, KeyRing(Cipher(MASTER), store))
    p.prepare_writing("customer", ["c-1", "c-2", "c-3"], ["c-1", "c-2"])  # c-3 is not new: no key made for it
    assert (store.batches, store.create_batches) == (1, 1) and set(store.keys) == {"c-1", "c-2"}
    sealed = [p.seal("customer", "Registered", c, {"email": f"{c}@example.com"}) for c in ("c-1", "c-2")]
    assert (store.singles, store.creates) == (0, 0)
    reader = Protector(RULES, KeyRing(Cipher(MASTER), store))
    assert [reader.unseal("customer", "Registered", c, s)["email"] for c, s in zip(("c-1", "c-2"), sealed,
                                                                                      strict=True)] \
        == ["c-1@example.com", "c-2@example.com"]


def test_a_key_another_writer_created_first_is_the_one_used() -> None:
    store = Counting()
    first = Protector(RULES, KeyRing(Cipher(MASTER), store))
    second = Protector(RULES, KeyRing(Cipher(MASTER), store))
    second.ring.prefetch(["c-1"])  # second saw no key...
    sealed = first.seal("customer", "Registered", "c-1", {"email": "ann@example.com"})  # ...first created one
    second.prepare_writing("customer", ["c-1"], ["c-1"])  # its cached absence is fresh: it tries to create one
    assert store.create_batches == 1
    assert second.unseal("customer", "Registered", "c-1", sealed)["email"] == "ann@example.com"


def test_payload_path_subjects_are_not_prepared_from_record_keys() -> None:
    store = Counting()
    Protector(RULES, KeyRing(Cipher(MASTER), store)).prepare_writing("order", ["o-1"], ["o-1"])
    assert (store.batches, store.create_batches, store.keys) == (0, 0, {})


def test_the_cache_is_trusted_a_ttl_at_a_time_on_one_look_at_the_erasure_mark() -> None:
    store = Counting()
    ring = KeyRing(Cipher(MASTER), store, ttl_s=10.0)
    ring.prefetch(["c-1", "c-2"])  # neither has a key yet
    assert (store.marks, store.batches) == (1, 1)  # the mark read before the keys it covers
    ring.for_writing("c-1")
    aead = ring.cache["c-1"][2]
    ring.prefetch(["c-1", "c-2"])
    ring.lookup("c-2")
    assert (store.marks, store.batches, store.singles) == (1, 1, 0)  # all cached, trusted: no query at all
    ring.trusted_until = time.monotonic() + 4.0  # 4 s of 10 left: a single lookup does not look again...
    ring.lookup("c-1")
    assert store.marks == 1
    ring.prefetch(["c-1"])  # ...a batch does (its trust would lapse while it is read); nothing forgotten: kept
    assert (store.marks, store.batches) == (2, 1) and ring.cache["c-1"][2] is aead
    assert ring.trusted_until > time.monotonic() + 9.0


def test_after_an_erasure_elsewhere_the_cache_is_dropped_at_the_next_look() -> None:
    store = Counting()
    ring = KeyRing(Cipher(MASTER), store, ttl_s=10.0)
    ring.prefetch(["c-1", "c-2"])
    key_id, key = ring.for_writing("c-1")
    KeyRing(Cipher(MASTER), store).forget("c-2", "dpo")  # another process forgets something (here: no key)
    batches = store.batches
    ring.prefetch(["c-1"])
    assert store.batches == batches  # still trusted: the erasure is not seen yet (within the TTL)
    ring.trusted_until = 0.0  # the TTL ran out
    ring.prefetch(["c-1"])
    assert store.batches == batches + 1  # the erasure mark moved: the cache was dropped and fetched again
    assert ring.lookup("c-1") == (key_id, key)
    forgotten_elsewhere = KeyRing(Cipher(MASTER), store)
    forgotten_elsewhere.forget("c-1", "dpo")
    ring.trusted_until = 0.0
    assert ring.lookup("c-1") == (None, None)  # a single lookup after the TTL looks at the mark too


def test_a_key_that_does_not_unwrap_fails_only_its_own_lookup() -> None:
    store = Counting()
    KeyRing(Cipher(os.urandom(32)), store).for_writing("c-1")  # under another master key
    ring = KeyRing(Cipher(MASTER), store)
    ring.for_writing("c-2")
    ring.prefetch(["c-1", "c-2"])  # does not raise: c-2 is cached, c-1 left to its lookup
    assert "c-2" in ring.cache and "c-1" not in ring.cache
    with pytest.raises(DecryptError):
        ring.lookup("c-1")


def test_a_cached_absence_does_not_hide_a_key_created_since() -> None:
    """A projection saw the subject's unprotected events first (no key: cached as absent); the writer then
    created the key for a protected event: reading that event gives the value, not the placeholder."""
    store = Counting()
    reader = Protector(RULES, KeyRing(Cipher(MASTER), store), placeholder="[erased]")
    reader.prefetch([b"c-1"])
    assert reader.ring.cache["c-1"][1] is None  # absent, cached
    sealed = Protector(RULES, KeyRing(Cipher(MASTER), store)).seal("customer", "Registered", "c-1",
                                                                    {"email": "ann@example.com"})
    assert reader.unseal("customer", "Registered", "c-1", sealed)["email"] == "ann@example.com"


def test_a_forgotten_key_reads_as_the_placeholder_and_is_asked_for_once() -> None:
    store = Counting()
    writer = Protector(RULES, KeyRing(Cipher(MASTER), store))
    sealed = writer.seal("customer", "Registered", "c-1", {"email": "ann@example.com"})
    writer.ring.forget("c-1", "dpo")
    reader = Protector(RULES, KeyRing(Cipher(MASTER), store), placeholder="[erased]")
    before = store.singles
    for _ in range(3):
        assert reader.unseal("customer", "Registered", "c-1", sealed)["email"] == "[erased]"
    assert store.singles - before == 2  # the lookup, the check of the key id; then known gone


def test_an_erasure_watch_reports_each_forget_once_and_none_from_before_it() -> None:
    store = Counting()
    ring = KeyRing(Cipher(MASTER), store)
    ring.for_writing("c-0")
    ring.forget("c-0", "dpo")  # before the watch: not news
    watch = ErasureWatch(store)
    assert watch.new() == set()
    ring.for_writing("c-1")
    KeyRing(Cipher(MASTER), store).forget("c-1", "dpo")
    assert watch.new() == {ring.cipher.subject_hash("c-1")}
    assert watch.new() == set()


def test_a_full_cache_drops_its_oldest_tenth_and_reads_those_keys_again_when_needed() -> None:
    """At `key_cache_max` the ring drops the oldest tenth of its subjects (not everything at once); a dropped
    subject's key is read again on use and still opens its values."""
    store = Counting()
    writer = Protector(RULES, KeyRing(Cipher(MASTER), store))
    subjects = [f"c-{i}" for i in range(25)]
    sealed = {c: writer.seal("customer", "Registered", c, {"email": f"{c}@example.com"}) for c in subjects}
    ring = KeyRing(Cipher(MASTER), store, cache_max=20)
    reader = Protector(RULES, ring)
    for c in subjects[:20]:  # one at a time: the cache's order is theirs
        ring.lookup(c)
    assert list(ring.cache) == subjects[:20]
    generation, batches = ring.generation, store.batches
    ring.prefetch(subjects[20:21])  # full: c-0 and c-1 (the oldest tenth) make room
    assert list(ring.cache) == subjects[2:21] and ring.generation > generation
    assert store.batches == batches + 1
    assert reader.unseal("customer", "Registered", "c-0", sealed["c-0"])["email"] == "c-0@example.com"
    assert "c-0" in ring.cache and len(ring.cache) <= 20
