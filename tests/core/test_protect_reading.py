"""The sink intake's read of protected fields (Protector.event, Protector.prefetch): the fast path that opens
top-level fields in place under a cached key, and the general path it leaves everything else to."""

from __future__ import annotations

import os

import pytest

from kafold.envelope import Event, decode, encode
from kafold.errors import RecordError
from kafold.protect import PREFIX, Cipher, KeyRing, Protector, Rule
from tests.core.test_protect_batches import Counting

MASTER = os.urandom(32)
RULES = {("customer", "Registered"): Rule((("email",), ("phone",)), "aggregate_id")}
PAYLOAD = {"email": "ann@example.com", "phone": "+44 20 7946 0000", "plan": "gold"}


def _record(protector: Protector, payload: dict[str, object], aid: str = "c-1") -> tuple[bytes, bytes, object]:
    sealed = protector.seal("customer", "Registered", aid, payload)
    key, value, headers = encode(Event.new("Registered", "customer", aid, 1, sealed))
    return key, value, headers


def _pair(placeholder: object = None) -> tuple[Counting, Protector, Protector]:
    store = Counting()
    writer = Protector(RULES, KeyRing(Cipher(MASTER), store))
    return store, writer, Protector(RULES, KeyRing(Cipher(MASTER), store), placeholder=placeholder)


def _tampered(token: str) -> str:
    """`token` with one character of its ciphertext changed (still valid base64url)."""
    i = len(token) - 6
    return token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1:]


def test_fields_under_a_cached_key_are_opened_in_the_decoded_payload_itself() -> None:
    store, writer, reader = _pair()
    record = _record(writer, PAYLOAD)
    singles = store.singles
    reader.prefetch([b"c-1"])
    event = decode(*record)
    own = event.payload
    assert own["email"].startswith(PREFIX) and own["phone"].startswith(PREFIX)
    assert reader.event(event) is event
    assert event.payload is own and own == PAYLOAD  # opened in place: no copy of the payload or the event
    assert store.singles == singles  # the batch's prefetch was the only lookup


def test_a_value_that_does_not_authenticate_fails_its_record_and_opens_nothing_in_place() -> None:
    _, writer, reader = _pair()
    key, value, headers = _record(writer, PAYLOAD)
    event = decode(key, value, headers)
    sealed_email = event.payload["email"]
    event.payload["phone"] = _tampered(event.payload["phone"])  # the second field: the first would open
    reader.prefetch([b"c-1"])
    with pytest.raises(RecordError) as e:
        reader.event(event, raw="the record")
    assert e.value.reason == "decrypt-failed" and "does not authenticate" in str(e.value)
    assert event.payload["email"] == sealed_email  # left as it was, not half opened


def test_a_value_sealed_under_an_earlier_key_of_the_subject_reads_as_the_placeholder() -> None:
    _, writer, reader = _pair(placeholder="[erased]")
    old = _record(writer, PAYLOAD)
    writer.ring.forget("c-1", "dpo")
    new = _record(writer, PAYLOAD)  # the subject written again: a new key, which the reader caches
    reader.prefetch([b"c-1"])
    assert reader.event(decode(*new)).payload == PAYLOAD
    assert reader.event(decode(*old)).payload == {"email": "[erased]", "phone": "[erased]", "plan": "gold"}


def test_a_cache_whose_trust_lapsed_is_not_read_before_the_erasure_mark_is_looked_at() -> None:
    store, writer, reader = _pair(placeholder="[erased]")
    record = _record(writer, PAYLOAD)
    reader.prefetch([b"c-1"])
    # forgotten by another process: this one's cache still holds it
    store.forget("c-1", "h", "dpo", store.get("c-1")[0])
    assert reader.event(decode(*record)).payload == PAYLOAD  # within the trust: as documented (seen within a TTL)
    marks = store.marks
    reader.ring.trusted_until = 0.0  # the TTL has passed
    assert reader.event(decode(*record)).payload["email"] == "[erased]"
    assert store.marks == marks + 1


def test_a_batch_looks_up_again_the_subjects_the_ring_dropped() -> None:
    store, writer, reader = _pair()
    for aid in ("c-1", "c-2"):
        _record(writer, PAYLOAD, aid)
    reader.prefetch([b"c-1", b"c-2", None])
    reader.prefetch([b"c-1", b"c-2"])
    assert store.batches == 1  # the second batch's keys were all looked up already
    reader.ring.drop(["c-2"])
    reader.prefetch([b"c-1", b"c-2"])
    assert store.batches == 2 and set(reader.ring.cache) == {"c-1", "c-2"}
    writer.ring.forget("c-1", "dpo")  # drops c-1 from every ring of this process, the reader's too
    reader.prefetch([b"c-1", b"c-2"])
    assert store.batches == 3 and reader.ring.cache["c-1"] == (None, None, None)
