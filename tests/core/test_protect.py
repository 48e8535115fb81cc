"""Crypto-shredding of protected fields (kafold.protect): the cipher, forgetting, and the configuration checks."""

from __future__ import annotations

import base64
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kafold import protect
from kafold.config import ProtectConfig, parse
from kafold.connectors.intake import Intake
from kafold.envelope import Event, decode, encode
from kafold.errors import ConfigError, FatalError, RecordError
from kafold.fold import domain_event, fields
from kafold.protect import Cipher, DecryptError, KeyRing, KeyStore, MemoryKeyStore, Protector, Rule

MASTER = os.urandom(32)
RULES = {("customer", "Registered"): Rule((("email",), ("address", "street")), "aggregate_id"),
         ("order", "Placed"): Rule((("email",),), "payload.customer_id")}


def protector(master: bytes = MASTER, store: KeyStore | None = None, placeholder: Any = None) -> Protector:
    return Protector(RULES, KeyRing(Cipher(master), store or MemoryKeyStore()), placeholder)


def test_round_trip_seals_only_the_protected_paths() -> None:
    p = protector()
    payload = {"email": "ann@example.com", "address": {"street": "1 Main St", "city": "Oslo"}, "name": "Ann"}
    sealed = p.seal("customer", "Registered", "c-1", payload)
    assert sealed["email"].startswith(protect.PREFIX) and sealed["address"]["street"].startswith(protect.PREFIX)
    assert sealed["address"]["city"] == "Oslo" and sealed["name"] == "Ann"
    assert "ann@example.com" not in str(sealed) and "Main St" not in str(sealed)
    assert payload["email"] == "ann@example.com"  # the caller's payload is not changed
    assert p.unseal("customer", "Registered", "c-1", sealed) == payload


def test_nonces_are_never_handed_out_twice_across_threads_and_blocks() -> None:
    """Nonces come from a block of os.urandom (kafold.protect._nonce); each must be used once, whatever the threads
    drawing them and the blocks refilled meanwhile: a nonce repeated under one key breaks AES-GCM."""
    drawn: list[list[bytes]] = [[] for _ in range(8)]

    def draw(out: list[bytes]) -> None:
        for _ in range(3 * protect.NONCE_BLOCK):
            out.append(protect._nonce())

    threads = [threading.Thread(target=draw, args=(out,)) for out in drawn]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [n for out in drawn for n in out]
    assert len(every) == 24 * protect.NONCE_BLOCK and len(set(every)) == len(every)
    assert {len(n) for n in every} == {protect.NONCE_BYTES}
    sealed = {protector().seal("customer", "Registered", "c-1", {"email": "a@b"})["email"] for _ in range(50)}
    assert len(sealed) == 50  # the same value sealed again is never the same bytes


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_never_reuses_the_parents_pooled_nonces() -> None:
    protect._nonce()  # the parent's pool holds a block
    ahead = list(protect._NONCES)
    assert ahead
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what it has pooled at once, then what it draws
        try:
            os.write(write, len(protect._NONCES).to_bytes(4, "big") + b"".join(protect._nonce() for _ in range(64)))
        finally:
            os._exit(0)
    os.close(write)
    got = b""
    while chunk := os.read(read, 1 << 16):
        got += chunk
    os.close(read)
    os.waitpid(pid, 0)
    assert int.from_bytes(got[:4], "big") == 0
    child = {got[i:i + protect.NONCE_BYTES] for i in range(4, len(got), protect.NONCE_BYTES)}
    assert len(child) == 64 and not child & set(ahead)


def test_a_value_moved_to_another_subject_type_or_field_fails_authentication() -> None:
    p = protector()
    sealed = p.seal("customer", "Registered", "c-1", {"email": "ann@example.com", "address": {"street": "x"}})
    with pytest.raises(DecryptError):
        p.unseal("customer", "Registered", "c-1", {"email": sealed["address"]["street"]})  # another field
    key = p.ring.lookup("c-1")[1]
    assert key is not None
    with pytest.raises(DecryptError):
        Cipher.open(key, sealed["email"], b"c-1\0Other\0email")  # another type
    # another subject with the same key id cannot happen by accident; forge it: copy c-1's key under c-2
    store = MemoryKeyStore()
    q = protector(store=store)
    moved = q.seal("customer", "Registered", "c-1", {"email": "ann@example.com"})
    store.keys["c-2"] = store.keys["c-1"]
    with pytest.raises(DecryptError):
        q.unseal("customer", "Registered", "c-2", moved)


def test_a_tampered_value_fails_authentication() -> None:
    p = protector()
    token = p.seal("customer", "Registered", "c-1", {"email": "ann@example.com"})["email"]
    blob = bytearray(base64.urlsafe_b64decode(token[len(protect.PREFIX):]))
    blob[-1] ^= 1
    tampered = protect.PREFIX + base64.urlsafe_b64encode(bytes(blob)).decode()
    with pytest.raises(DecryptError):
        p.unseal("customer", "Registered", "c-1", {"email": tampered})


def test_a_wrong_master_key_never_yields_plaintext() -> None:
    store = MemoryKeyStore()
    sealed = protector(store=store).seal("customer", "Registered", "c-1", {"email": "ann@example.com"})
    with pytest.raises(DecryptError):
        protector(master=os.urandom(32), store=store).unseal("customer", "Registered", "c-1", sealed)


def test_a_decryption_failure_other_than_authentication_is_raised_as_it_is() -> None:
    class Broken:
        def decrypt(self, nonce: bytes, data: bytes, aad: bytes) -> bytes:
            raise RuntimeError("broken cipher")

    with pytest.raises(RuntimeError, match="broken cipher"):
        Cipher.open_blob(Broken(), bytes(40), b"")


def test_absent_and_null_values_and_parents_that_are_not_objects_are_left_as_they_are() -> None:
    p = protector()
    for payload in ({}, {"email": None}, {"address": None}, {"address": "1 Main St"}, {"address": {"city": "Oslo"}}):
        sealed = p.seal("customer", "Registered", "c-1", payload)
        assert sealed == payload and p.unseal("customer", "Registered", "c-1", sealed) == payload
    nested = {"address": {"street": "1 Main St"}}
    sealed = p.seal("customer", "Registered", "c-1", nested)
    assert nested == {"address": {"street": "1 Main St"}}  # the caller's nested object is copied, not changed
    assert p.unseal("customer", "Registered", "c-1", sealed) == nested


def test_a_plain_value_in_a_protected_field_is_refused() -> None:
    with pytest.raises(DecryptError, match="not a sealed value"):
        protector().unseal("customer", "Registered", "c-1", {"email": "ann@example.com"})


def test_forgotten_subject_reads_as_the_placeholder_and_others_are_unchanged() -> None:
    store = MemoryKeyStore()
    p = protector(store=store, placeholder="[erased]")
    ann = p.seal("customer", "Registered", "c-1", {"email": "ann@example.com", "name": "Ann"})
    bob = p.seal("customer", "Registered", "c-2", {"email": "bob@example.com", "name": "Bob"})
    assert p.ring.forget("c-1", "test") is True
    assert p.unseal("customer", "Registered", "c-1", ann) == {"email": "[erased]", "name": "Ann"}
    assert p.unseal("customer", "Registered", "c-2", bob)["email"] == "bob@example.com"
    assert p.ring.forget("c-1", "test") is False  # twice: harmless
    assert [actor for _, actor in store.erasures] == ["test", "test"]
    assert all("c-1" not in h for h, _ in store.erasures)  # the record holds a keyed hash, not the subject


def test_a_new_key_after_forget_does_not_open_the_old_values() -> None:
    p = protector(placeholder=None)
    old = p.seal("customer", "Registered", "c-1", {"email": "ann@example.com"})
    p.ring.forget("c-1", "test")
    new = p.seal("customer", "Registered", "c-1", {"email": "ann2@example.com"})
    assert p.unseal("customer", "Registered", "c-1", old) == {"email": None}
    assert p.unseal("customer", "Registered", "c-1", new) == {"email": "ann2@example.com"}


def test_subject_from_a_payload_path() -> None:
    p = protector()
    sealed = p.seal("order", "Placed", "o-1", {"customer_id": "c-9", "email": "z@example.com"})
    assert p.ring.lookup("c-9")[0] is not None and p.ring.lookup("o-1")[0] is None
    p.ring.forget("c-9", "test")
    assert p.unseal("order", "Placed", "o-1", sealed) == {"customer_id": "c-9", "email": None}
    with pytest.raises(ValueError, match="subject"):
        p.seal("order", "Placed", "o-2", {"email": "z@example.com"})


def _event(p: Protector) -> tuple[bytes, Any]:
    payload = p.seal("customer", "Registered", "c-1", {"email": "ann@example.com"})
    _, value, headers = encode(Event.new("Registered", "customer", "c-1", 1, payload))
    return value, headers


class _Kernel:
    def __init__(self, p: Protector) -> None:
        self.unseal = p.for_aggregate("customer")
        self.event = lambda type_name, payload, version: {"type": type_name, **payload}


def test_the_fold_reads_protected_fields_in_clear() -> None:
    p = protector()
    value, _ = _event(p)
    assert b"ann@example.com" not in value
    assert domain_event(_Kernel(p), fields(value))["email"] == "ann@example.com"  # type: ignore[arg-type]


def test_the_sink_intake_opens_fields_and_dead_letters_what_does_not_authenticate() -> None:
    p = protector()
    value, headers = _event(p)
    intake = Intake("c", lambda t: True, "skip", decrypt=p.event)
    got = intake.event(b"c-1", value, headers)
    assert got is not None and got.payload["email"] == "ann@example.com"
    wrong = Intake("c", lambda t: True, "skip", decrypt=protector(master=os.urandom(32), store=p.ring.store).event)
    with pytest.raises(RecordError) as info:
        wrong.event(b"c-1", value, headers, raw="the record")
    assert info.value.reason == "decrypt-failed" and info.value.raw == "the record"
    assert "ann@example.com" not in str(info.value)
    assert decode(b"c-1", value, headers).payload["email"].startswith(protect.PREFIX)


TOML = """
[[aggregates]]
name = "customer"
initial = "m:initial"
evolve = "m:evolve"
decide = "m:decide"
[[aggregates.protect]]
type = "Registered"
fields = ["email", "address.street"]
subject = "{subject}"
{privacy}
"""


def _load(subject: str = "aggregate_id", privacy: str = '[privacy]\nmaster_key_env = "KF_TEST_MASTER"',
          env: dict[str, str] | None = None) -> Any:
    env = {"KF_TEST_MASTER": base64.b64encode(MASTER).decode()} if env is None else env
    return parse(TOML.format(subject=subject, privacy=privacy), Path("kafold.toml"), env).config


def test_config_rule_without_a_master_key_reference_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"privacy\.master_key"):
        _load(privacy="")


def test_config_literal_master_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="literal"):
        _load(privacy='[privacy]\nmaster_key = "abc"')


def test_config_bad_subject_and_encrypted_subject_are_errors() -> None:
    with pytest.raises(ConfigError, match="subject"):
        _load(subject="customer_id")
    with pytest.raises(ConfigError, match="one of the encrypted fields"):
        _load(subject="payload.email")


def test_config_protect_with_payload_subject_snapshots_is_refused_spark_and_task_processes_are_not() -> None:
    key = '[privacy]\nmaster_key_env = "KF_TEST_MASTER"\n[snapshots]\nenabled = true'
    for engine in ("auto", "spark", "local"):
        with pytest.raises(ConfigError, match="every rule's subject is `aggregate_id`"):
            _load(subject="payload.customer_id", privacy=key + f'\nengine = "{engine}"')
        # snapshots of an aggregate-id subject: supported in process and in Spark (tasks open their own key rings)
        cfg = _load(privacy=key + f'\nengine = "{engine}"')
        assert cfg.snapshots.enabled and cfg.snapshots.engine == engine and cfg.aggregates[0].protect
    assert _load(privacy='[privacy]\nmaster_key_env = "KF_TEST_MASTER"\n[daemon]\ntask_processes = true'
                 ).daemon.task_processes  # task processes build their own key ring (daemon.task_process)


def test_missing_master_key_at_load_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KF_TEST_MASTER is not set"):
        _load(env={})


def test_missing_master_key_at_start_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _load()
    monkeypatch.delenv("KF_TEST_MASTER", raising=False)
    with pytest.raises(ConfigError, match="KF_TEST_MASTER is not set"):
        protect.build(cfg, MemoryKeyStore())


def test_master_key_that_is_not_256_bits_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KF_TEST_MASTER", base64.b64encode(b"short").decode())
    with pytest.raises(ConfigError, match="256-bit"):
        protect.build(_load(), MemoryKeyStore())


def test_build_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KF_TEST_MASTER", base64.b64encode(MASTER).decode())
    p = protect.build(_load(), MemoryKeyStore())
    assert p is not None and p.placeholder is None
    sealed = p.seal("customer", "Registered", "c-1", {"email": "e", "address": {"street": "s"}})
    assert p.unseal("customer", "Registered", "c-1", sealed) == {"email": "e", "address": {"street": "s"}}


# ---- snapshots: a protected aggregate's state sealed whole under its id's key -------------------------------------

def _snapshot_record(p: Protector, aid: str, state: Any, version: int = 2, offset: int = 5) -> tuple[bytes, bytes]:
    from kafold.snapshot.record import Snapshot

    sealed = p.seal_state("customer", aid, state)
    key, value, _ = Snapshot("customer", aid, sealed, version, 0, offset, "fp", 1).encode()
    return key, value


def _selector(p: Protector | None) -> Any:
    from kafold.snapshot.select import Identity, Selector

    return Selector(Identity("customer", "fp", 1, protect.state_sealer(p, "customer")), 0, 0, 10)


def test_state_sealing_is_only_for_aggregate_id_subjects() -> None:
    p = protector()
    assert p.seals_states("customer") and not p.seals_states("order") and not p.seals_states("nobody")
    assert protect.state_sealer(p, "customer") is p and protect.state_sealer(p, "order") is None
    assert protect.state_sealer(None, "customer") is None


def test_a_sealed_state_opens_only_as_its_aggregates_snapshot() -> None:
    p = protector()
    state = {"email": "ann@example.com", "balance": 10}
    token = p.seal_state("customer", "c-1", state)
    assert token.startswith(protect.PREFIX) and "ann@example.com" not in token
    assert p.open_state("customer", "c-1", token) == state
    with pytest.raises(DecryptError):
        p.open_state("other", "c-1", token)  # another aggregate type: another associated data
    with pytest.raises(DecryptError, match="not sealed"):
        p.open_state("customer", "c-1", state)  # a clear state (written before protect) is not used
    with pytest.raises(DecryptError):  # a wrong master key: the data key does not unwrap
        protector(master=os.urandom(32), store=p.ring.store).open_state("customer", "c-1", token)


def test_a_forgotten_subjects_sealed_state_does_not_open() -> None:
    p = protector()
    token = p.seal_state("customer", "c-1", {"email": "ann@example.com"})
    p.ring.forget("c-1", "test")
    with pytest.raises(protect.Forgotten):
        p.open_state("customer", "c-1", token)
    p.seal_state("customer", "c-1", {"email": None})  # a later life's key does not open the old state either
    with pytest.raises(protect.Forgotten):
        p.open_state("customer", "c-1", token)


def test_restore_selection_opens_sealed_states_and_falls_back_for_a_forgotten_subject() -> None:
    p = protector()
    ann, bob = _snapshot_record(p, "c-1", {"email": "ann@example.com"}), _snapshot_record(p, "c-2", {"email": "b"})
    assert b"ann@example.com" not in ann[1]
    selector = _selector(p)
    for key, value in (ann, bob):
        selector.feed(key, value, 0)
    sel = selector.result()
    assert sel.bases[b"c-1"].state == {"email": "ann@example.com"} and sel.bases[b"c-2"].state == {"email": "b"}
    p.ring.forget("c-1", "test")
    selector = _selector(p)
    for key, value in (ann, bob):
        selector.feed(key, value, 0)
    sel = selector.result()
    # like a fingerprint mismatch: not used, the aggregate replays from the partition's first offset
    assert b"c-1" not in sel.bases and sel.orphans == {b"c-1"} and sel.rejected == {"forgotten": 1}
    assert sel.start == 0 and sel.bases[b"c-2"].state == {"email": "b"}


def test_restore_selection_never_uses_a_clear_state_of_a_protected_aggregate() -> None:
    from kafold.snapshot.record import Snapshot

    key, value, _ = Snapshot("customer", "c-1", {"email": "ann@example.com"}, 2, 0, 5, "fp", 1).encode()
    selector = _selector(protector())
    selector.feed(key, value, 0)
    sel = selector.result()
    assert not sel.bases and sel.rejected == {"sealed": 1}


def test_a_spark_snapshot_run_of_a_protected_aggregate_without_its_privacy_settings_is_refused_before_it_starts(
        ) -> None:
    from kafold.spark_jobs import runs

    cfg = _load(privacy='[privacy]\nmaster_key_env = "KF_TEST_MASTER"\n[snapshots]\nenabled = true\nengine = "local"')
    for engine in ("spark", "auto"):  # a caller that did not pass its protector: its tasks would have no keys
        with pytest.raises(ConfigError, match="privacy settings"):
            runs.run(cfg.kafka, cfg.aggregates[0], [], lambda: None, engine=engine)


def test_a_snapshot_run_of_an_aggregate_with_a_payload_subject_is_refused_on_every_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kafold.spark_jobs import runs

    monkeypatch.setenv("KF_TEST_MASTER", base64.b64encode(MASTER).decode())
    cfg = _load(subject="payload.customer_id")  # snapshots not enabled: only `kafold snapshot run` would write one
    for engine in ("spark", "auto", "local"):  # its states would be written in clear: refused, naming the rule
        with pytest.raises(ConfigError, match="subject is `aggregate_id`"):
            runs.run(cfg.kafka, cfg.aggregates[0], [], lambda: None, engine=engine,
                     protector=protect.build(cfg, MemoryKeyStore()))


def test_a_spark_snapshot_spec_carries_secret_references_never_the_master_key() -> None:
    import json

    from kafold.spark_jobs import source

    cfg = _load(privacy='[privacy]\nmaster_key_env = "KF_TEST_MASTER"\n[snapshots]\nenabled = true\nengine = "spark"')
    spec = source.spec_json(cfg.kafka, cfg.aggregates[0], [], [0], 10, protect.setup(cfg))
    assert json.loads(spec)["keys"]["privacy"]["master_key"] == {"source": "env:KF_TEST_MASTER"}
    for text in (base64.b64encode(MASTER).decode(), MASTER.hex()):
        assert text not in spec
    agg = source.load_spec(spec)[1]
    def rules(a: Any) -> list[tuple[str, tuple[str, ...], str]]:
        return [(r.type, tuple(r.fields), r.subject) for r in a.protect]

    assert all(isinstance(r, ProtectConfig) for r in agg.protect)  # the protect rules come back as ProtectConfig
    assert rules(agg) == rules(cfg.aggregates[0])
    assert dataclasses.replace(agg, protect=cfg.aggregates[0].protect) == cfg.aggregates[0]


class _Counting(MemoryKeyStore):
    """A key store that counts its round trips."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = self.batches = 0

    def get(self, subject: str) -> tuple[bytes, bytes] | None:
        self.gets += 1
        return super().get(subject)

    def get_many(self, subjects: list[str]) -> dict[str, tuple[bytes, bytes]]:
        self.batches += 1
        return {s: row for s in subjects if (row := self.keys.get(s)) is not None}


def test_a_batch_of_records_looks_its_subjects_keys_up_in_one_round_trip() -> None:
    store = _Counting()
    writer = protector(store=store)
    sealed = {aid: writer.seal("customer", "Registered", aid, {"email": f"{aid}@example.com"})
              for aid in ("c-1", "c-2")}
    reader = protector(store=store)  # a fresh ring: nothing cached
    store.gets = 0
    reader.prefetch([b"c-1", b"c-2", b"c-3", None, b"c-1"])
    assert store.batches == 1
    for aid, payload in sealed.items():
        assert reader.unseal("customer", "Registered", aid, payload) == {"email": f"{aid}@example.com"}
    assert reader.unseal("customer", "Registered", "c-3", {"email": sealed["c-1"]["email"]}) == {"email": None}
    # every lookup was answered by the prefetch; c-3 has no key, so the key id its value names is checked once
    # against the store (a key created since the prefetch would be found), then known gone
    assert store.gets == 1
    assert reader.unseal("customer", "Registered", "c-3", {"email": sealed["c-1"]["email"]}) == {"email": None}
    assert store.gets == 1
    reader.prefetch([b"c-1", b"c-2"])
    assert store.batches == 1  # still cached: no round trip
    order_only = Protector({("order", "Placed"): RULES[("order", "Placed")]}, KeyRing(Cipher(MASTER), store))
    order_only.prefetch([b"o-1"])  # its subject is a payload field, not the record key: nothing to look up early
    assert store.batches == 1


def test_each_build_is_its_callers_own_and_what_another_process_builds_one_from(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KF_TEST_MASTER", base64.b64encode(MASTER).decode())
    cfg = _load()
    first, second = protect.build(cfg, MemoryKeyStore()), protect.build(cfg, MemoryKeyStore())
    assert first is not None and second is not None and first is not second and first.ring is not second.ring
    assert protect.build(parse("", Path("kafold.toml"), {}).config) is None  # and the others are left as they are
    sealed = first.seal("customer", "Registered", "c-1", {"email": "ann@example.com"})
    assert first.unseal("customer", "Registered", "c-1", sealed) == {"email": "ann@example.com"}
    assert protect.sent(first) == protect.setup(cfg) and protect.sent(None) is None
    by_hand = Protector(RULES, KeyRing(Cipher(MASTER), MemoryKeyStore()))
    with pytest.raises(FatalError, match="built by hand"):  # no Setup: no other process could build it again
        protect.sent(by_hand)


def test_a_prefetch_leaves_record_keys_postgresql_cannot_hold_to_their_own_lookup() -> None:
    store = _Counting()
    reader = protector(store=store)
    reader.prefetch([b"c-\x001", b"c-2"])
    assert store.batches == 1 and "c-2" in reader.ring.cache and "c-\x001" not in reader.ring.cache
