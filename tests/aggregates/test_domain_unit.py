"""Pure parts of the aggregate runtime: domain loading and conversion, the command envelope, the gate, the store."""

from __future__ import annotations

import pytest
from agg_support import BANK, bank_config, bank_domain

from kafold.config import AggregateConfig
from kafold.daemon.aggregates.gate import LIVE, RECOVERING, PartitionGate
from kafold.daemon.aggregates.messages import Command, decode_command, decode_result
from kafold.daemon.aggregates.processor import handle
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.domain import AggregateDomain, InvalidCommand, InvalidEvent
from kafold.envelope import decode, derive_event_id
from kafold.errors import ConfigError, DecodeError


def test_domain_loads_functions_and_type_maps() -> None:
    d = bank_domain(bank_config("account"))
    assert d.initial().status == "new" and "Deposit" in d.command_types and "MoneyDeposited" in d.event_types
    assert any(c.__name__ == "Rejected" and c.__module__ == "bank_domain" for c in d.rejections)


def test_domain_load_names_the_missing_function() -> None:
    agg = AggregateConfig(name="a", initial="bank_domain:nope", evolve="bank_domain:evolve",
                          decide="bank_domain:decide")
    with pytest.raises(ConfigError, match="initial: 'bank_domain' has no function 'nope'"):
        AggregateDomain.load(agg, [str(BANK)])


def test_command_conversion_names_the_bad_field() -> None:
    d = bank_domain(bank_config("account"))
    assert d.command("Deposit", {"amount": 5}).amount == 5
    with pytest.raises(InvalidCommand, match="unknown command type 'Nope'"):
        d.command("Nope", {})
    with pytest.raises(InvalidCommand, match="field 'amount' expects int, got str"):
        d.command("Deposit", {"amount": "5"})
    with pytest.raises(InvalidCommand, match="missing field 'amount'"):
        d.command("Deposit", {})


def test_event_payload_round_trip_and_state_json() -> None:
    d = bank_domain(bank_config("account"))
    name, payload = d.event_payload(d.event_types["MoneyDeposited"](amount=3))
    assert (name, payload) == ("MoneyDeposited", {"amount": 3})
    assert d.event(name, payload) == d.event_types["MoneyDeposited"](amount=3)
    with pytest.raises(InvalidEvent):
        d.event_payload(object())
    state = d.initial()
    assert d.state_from_json(d.state_to_json(state)) == state


def test_command_envelope_round_trip_and_defects() -> None:
    cmd = Command.new("account", "acc-1", "Deposit", {"amount": 5}, expected_version=3)
    key, value, _ = cmd.encode()
    assert decode_command(key, value) == cmd
    with pytest.raises(DecodeError, match="key: must be the aggregate id"):
        decode_command(b"other", value)
    with pytest.raises(DecodeError, match="expected_version"):
        decode_command(b"a", b'{"command_id":"c","type":"T","aggregate_id":"a","data":{},"expected_version":"1"}')
    with pytest.raises(DecodeError, match="not valid JSON"):
        decode_command(b"a", b"{")


def test_handle_accepts_with_derived_ids_and_consecutive_versions() -> None:
    d = bank_domain(bank_config("account"))
    entry = Entry(d.initial(), 0, 0)
    cmd = Command.new("account", "a", "OpenAccount", {"owner": "x"}, command_id="c1")
    out = handle(d, cmd, entry)
    assert out.result.accepted and out.version == 1 and out.result.event_ids == (derive_event_id("c1", 0),)
    event = decode(*out.events[0])
    assert (event.version, event.causation_id, event.type) == (1, "c1", "AccountOpened")
    assert entry.version == 0  # the entry is not modified by handle


def test_handle_rejects_version_mismatch_and_business_rule_without_dead_letter() -> None:
    d = bank_domain(bank_config("account"))
    entry = Entry(d.initial(), 0, 0)
    wrong = handle(d, Command.new("account", "a", "OpenAccount", {"owner": "x"}, expected_version=4), entry)
    assert wrong.result.status == "rejected" and "expected version 4" in (wrong.result.reason or "")
    closed = handle(d, Command.new("account", "a", "Deposit", {"amount": 1}), entry)
    assert closed.result.reason == "account is new" and closed.error is None and closed.events == []


def test_handle_dead_letters_invalid_commands_and_repeats_known_command_ids() -> None:
    d = bank_domain(bank_config("account"))
    entry = Entry(d.initial(), 4, 0, {"c9": (4, 2)})
    bad = handle(d, Command.new("account", "a", "Teleport", {}), entry)
    assert bad.result.status == "rejected" and bad.error is not None and bad.error.reason == "unknown-type"
    again = handle(d, Command.new("account", "a", "Deposit", {"amount": 1}, command_id="c9"), entry)
    assert again.result.duplicate and again.events == [] and again.result.event_ids == (
        derive_event_id("c9", 0), derive_event_id("c9", 1))


def test_gate_opens_only_at_partition_eof_at_or_past_the_captured_end() -> None:
    gate = PartitionGate(0, captured_end=100)
    gate.replayed(100, 100)
    assert gate.phase == RECOVERING  # reached the captured end, but no fetch said "end of partition" yet
    assert not gate.end_of_partition(90) and gate.phase == RECOVERING  # an EOF below the captured end
    gate2 = PartitionGate(0, captured_end=100)
    gate2.replayed(60, 60)
    assert not gate2.end_of_partition(60) and gate2.phase == RECOVERING  # EOF below the captured end
    assert gate.end_of_partition(130) and gate.phase == LIVE and gate.position == 130
    assert not gate.end_of_partition(140)  # a new assignment starts a new gate


def test_gate_on_an_under_reported_end_follows_the_fetch_end() -> None:
    gate = PartitionGate(0, captured_end=4)  # ListOffsets said 4, the log really ends at 13
    gate.replayed(13, 13)
    assert gate.end_of_partition(13) and gate.position == 13 and gate.events_replayed == 13


def test_store_evicts_least_recently_used_and_remembers_them() -> None:
    store = StateStore(2)
    for aid in ("a", "b", "c"):
        store.put(aid, Entry(None, 1, 3))
    store.get("a")
    assert store.trim() == 1 and store.is_evicted(3, "b") and set(store.entries) == {"a", "c"}
    store.put("b", Entry(None, 1, 3))
    assert not store.is_evicted(3, "b")
    store.drop_partition(3)
    assert len(store) == 0


def test_entry_remembers_a_bounded_number_of_command_ids() -> None:
    e = Entry(None, 0, 0)
    for i in range(40):
        e.note(f"c{i}", i + 1, 1, keep=32)
    assert len(e.recent) == 32 and "c0" not in e.recent and e.recent["c39"] == (40, 1)
    e.note("c39", 41, 1, keep=32)  # a second event of the same command during a replay
    assert e.recent["c39"] == (41, 2)


def test_result_round_trip() -> None:
    from kafold.daemon.aggregates.messages import Result

    r = Result("c", "a", "accepted", 3, ("e1",), None, "c")
    assert decode_result(r.encode()[1]) == r


def test_fast_event_id_equals_the_uuid5_derivation() -> None:
    import uuid

    from kafold.envelope import KAFOLD_NAMESPACE

    for cid, i in (("c1", 0), ("a/b", 3), ("ünï", 12), ("x" * 256, 0)):
        assert derive_event_id(cid, i) == str(uuid.uuid5(KAFOLD_NAMESPACE, f"{cid}/{i}"))
