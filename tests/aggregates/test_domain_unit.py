"""Pure parts of the aggregate runtime: domain loading and conversion, the command envelope, the gate, the store."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from kafold import messages
from kafold.config import AggregateConfig, FoldErrorPolicy
from kafold.daemon.aggregates.gate import LIVE, RECOVERING, PartitionGate
from kafold.daemon.aggregates.processor import handle as _handle
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.daemon.aggregates.window import Window, accepted, rejected, unpack
from kafold.domain import AggregateDomain, InvalidCommand, InvalidEvent
from kafold.envelope import decode, derive_event_id
from kafold.errors import ConfigError, DecodeError
from kafold.messages import Command, decode_command, decode_result
from tests.aggregates.agg_support import BANK, bank_config, bank_domain


def test_domain_loads_functions_and_type_maps() -> None:
    d = bank_domain(bank_config("account"))
    assert d.initial().status == "new" and "Deposit" in d.codec.command_types \
        and "MoneyDeposited" in d.codec.event_types
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
    with pytest.raises(InvalidCommand, match=r"command Deposit: field 'amount': Expected `int`, got `str`$"):
        d.command("Deposit", {"amount": "5"})
    with pytest.raises(InvalidCommand, match="missing required field `amount`"):
        d.command("Deposit", {})
    with pytest.raises(InvalidCommand, match="unknown field 'amuont'"):
        d.command("Deposit", {"amount": 5, "amuont": 5})


def test_codec_payload_round_trip_and_state_json() -> None:
    d = bank_domain(bank_config("account"))
    name, payload = d.codec.payload(d.codec.event_types["MoneyDeposited"](amount=3))
    assert (name, payload) == ("MoneyDeposited", {"amount": 3})
    assert d.event(name, payload) == d.codec.event_types["MoneyDeposited"](amount=3)
    with pytest.raises(InvalidEvent):
        d.codec.payload(object())
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


def _envelope(**fields: Any) -> bytes:
    body = {"command_id": "c-1", "type": "Deposit", "aggregate_id": "a", "data": {"amount": 5}, **fields}
    return orjson.dumps({k: v for k, v in body.items() if v is not _ABSENT})


_ABSENT = object()
_DEEP = b'{"command_id":"c","type":"T","aggregate_id":"a","data":' + b"[" * 1022 + b"]" * 1022 + b"}"


@pytest.mark.parametrize("value", [
    _envelope(), _envelope(expected_version=0), _envelope(expected_version=2**63 - 1),
    _envelope(expected_version=2**64 - 1), _envelope(expected_version=-1), _envelope(expected_version=True),
    _envelope(expected_version=1.0), _envelope(expected_version="1"), _envelope(expected_version=None),
    _envelope(correlation_id=""), _envelope(correlation_id=None), _envelope(correlation_id=0),
    _envelope(correlation_id=False), _envelope(correlation_id="corr"), _envelope(correlation_id=[]),
    _envelope(aggregate_type=None), _envelope(aggregate_type="account"), _envelope(issued_at=None),
    _envelope(issued_at="2026-01-01T00:00:00.000000Z"), _envelope(command_id=""), _envelope(command_id="x" * 256),
    _envelope(command_id="x" * 257), _envelope(command_id="é" * 256), _envelope(command_id="é" * 257),
    _envelope(command_id=5), _envelope(type=None), _envelope(aggregate_id="b"), _envelope(aggregate_id="ä"),
    _envelope(data=_ABSENT), _envelope(data=[]), _envelope(data=None), _envelope(data="x"), _envelope(extra=1),
    _envelope(data={"n": 2**64 - 1, "f": 1.5, "e": 1e300, "s": "\u00e9\n", "l": [1, {"x": None}], "b": True}),
    b'{"command_id":"c","type":"T","aggregate_id":"a","data":{"n":18446744073709551616}}',
    b'{"command_id":"c","type":"T","aggregate_id":"a","data":{"n":1e400}}',
    b'{"command_id":"c","type":"T","aggregate_id":"a","data":{"n":NaN}}',
    b'{"command_id":"\\ud800","type":"T","aggregate_id":"a","data":{}}',
    b'{"command_id":"c\xff","type":"T","aggregate_id":"a","data":{}}',
    b'{"command_id":"c\\u0001","type":"T","aggregate_id":"a","data":{}}',
    b'{"command_id":"c\x01","type":"T","aggregate_id":"a","data":{}}',
    b'{"command_id":"c","command_id":"d","type":"T","aggregate_id":"a","data":{}}',
    b'{"command_id":"c","type":"T","aggregate_id":"a","data":{"k":1,"k":2}}',
    b'\xef\xbb\xbf{"command_id":"c","type":"T","aggregate_id":"a","data":{}}',
    b' {"command_id":"c","type":"T","aggregate_id":"a","data":{}} ',
    b'{"command_id":"c","type":"T","aggregate_id":"a","data":{}} x', b"[]", b"", b"{", b"null", _DEEP,
    _DEEP.replace(b"[" * 1022, b"[" * 1023).replace(b"]" * 1022, b"]" * 1023),
])
def test_command_envelope_fast_path_agrees_with_the_checked_one(value: bytes) -> None:
    """msgspec's decode of the envelope (the common case) accepts only what the checked path accepts, and gives the
    same Command: the same values of the same types (1 == 1.0 == True, so compared as their JSON and types too)."""
    fast = messages._decode_fast(b"a", value)
    try:
        checked: Command | DecodeError = messages._decode_checked(b"a", value, None)
    except DecodeError as e:
        checked = e
    if fast is None:
        return  # the checked path answers, as before
    assert isinstance(checked, Command)
    assert fast == checked and orjson.dumps(fast.data) == orjson.dumps(checked.data)
    assert [type(getattr(fast, f.name)) for f in dataclasses.fields(Command)] == \
        [type(getattr(checked, f.name)) for f in dataclasses.fields(Command)]
    assert repr(fast.data) == repr(checked.data)


def test_command_envelope_fast_path_takes_the_common_case() -> None:
    cmd = Command.new("account", "acc-1", "Deposit", {"amount": 5}, expected_version=3)
    key, value, _ = cmd.encode()
    assert messages._decode_fast(key, value) == cmd == decode_command(key, value)


AT, T0, DAY_MS = "2026-01-01T00:00:00.000000Z", 1_767_225_600_000, 86_400_000


def handle(d: AggregateDomain, cmd: Command, entry: Entry, t: int = T0) -> Any:
    return _handle(d, cmd, entry, AT, t, DAY_MS)


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
    entry = Entry(d.initial(), 4, 0)
    Window(DAY_MS, 100).remember(entry, "a", "c9", accepted(T0, 4, 2), [derive_event_id("c9", 2),
                                                                       derive_event_id("c9", 3)])
    bad = handle(d, Command.new("account", "a", "Teleport", {}), entry)
    assert bad.result.status == "rejected" and bad.error is not None and bad.error.reason == "unknown-type"
    again = handle(d, Command.new("account", "a", "Deposit", {"amount": 1}, command_id="c9"), entry, T0 + 5)
    assert again.result.duplicate and again.events == [] and again.remember is None and again.result.event_ids == (
        derive_event_id("c9", 2), derive_event_id("c9", 3))


def test_event_ids_follow_the_version_so_a_decision_after_the_window_never_reuses_one() -> None:
    d = bank_domain(bank_config("account"))
    entry = Entry(d.initial(), 0, 0)
    opened = handle(d, Command.new("account", "a", "OpenAccount", {"owner": "x"}, command_id="c1"), entry)
    entry.state, entry.version = opened.state, opened.version
    Window(DAY_MS, 100).remember(entry, "a", "c1", opened.remember, opened.result.event_ids)
    dep = handle(d, Command.new("account", "a", "Deposit", {"amount": 5}, command_id="d1"), entry)
    assert dep.result.event_ids == (derive_event_id("d1", 1),)  # the event's version - 1
    late = handle(d, Command.new("account", "a", "OpenAccount", {"owner": "x"}, command_id="c1"), entry,
                  T0 + DAY_MS + 1)
    assert not late.result.duplicate and late.result.status == "rejected"  # decided again: already open


def test_a_retried_rejection_repeats_even_when_the_state_would_now_accept() -> None:
    d = bank_domain(bank_config("account"))
    entry = Entry(d.initial(), 0, 0)
    window = Window(DAY_MS, 100)
    early = handle(d, Command.new("account", "a", "Deposit", {"amount": 5}, command_id="d1"), entry)
    assert early.result.status == "rejected" and early.remember is not None
    window.remember(entry, "a", "d1", early.remember)
    opened = handle(d, Command.new("account", "a", "OpenAccount", {"owner": "x"}, command_id="o1"), entry)
    entry.state, entry.version = opened.state, opened.version
    retry = handle(d, Command.new("account", "a", "Deposit", {"amount": 5}, command_id="d1"), entry, T0 + 60_000)
    assert retry.result.duplicate and retry.result.status == "rejected" and retry.result.reason == "account is new"
    assert retry.result.version == 0 and retry.events == []


def test_the_last_line_of_defence_refuses_an_event_id_already_in_the_window() -> None:
    d = bank_domain(bank_config("account"))
    entry = Entry(d.initial(), 0, 0)
    # an event with the id this command would write is in the window under another command id (a foreign writer)
    Window(DAY_MS, 100).remember(entry, "a", "other", accepted(T0, 1, 1), [derive_event_id("c1", 0)])
    out = handle(d, Command.new("account", "a", "OpenAccount", {"owner": "x"}, command_id="c1"), entry)
    assert out.events == [] and out.refused and out.result.duplicate and out.result.version == 1


def test_window_expires_by_command_time_and_bounds_the_ids_held() -> None:
    window = Window(1000, 3)
    entries = {"a": Entry(None, 0, 0), "b": Entry(None, 0, 0)}
    for i, t in enumerate((0, 500, 900)):
        window.remember(entries["a" if i % 2 == 0 else "b"], "a" if i % 2 == 0 else "b", f"c{i}",
                        rejected(T0 + t, 0, "no"))
    assert window.expire(entries) == 0  # all within 1 s of the latest command time
    window.remember(entries["b"], "b", "c3", rejected(T0 + 1200, 0, "no"))  # c0 is now older than the window
    assert window.expire(entries) == 1 and "c0" not in entries["a"].recent and window.dropped_early == 0
    window.remember(entries["a"], "a", "c4", rejected(T0 + 1300, 0, "no"))
    window.remember(entries["a"], "a", "c5", rejected(T0 + 1400, 0, "no"))  # 5 held > 3: two go early
    assert window.expire(entries) == 2 and window.dropped_early == 2 and window.held(entries) == 3
    window.forget(entries["a"], "c5")
    assert window.held(entries) == 2


def test_window_counts_each_replayed_event_once_per_command() -> None:
    window, entry = Window(DAY_MS, 100), Entry(None, 0, 0)
    for version in (1, 2, 2):  # the second event of c1, then the same event again (a duplicate write)
        window.add_event(entry, "a", "c1", T0, version, derive_event_id("c1", version - 1))
    assert unpack(entry.recent["c1"]) == (T0, 2, 2, None) and len(entry.events) == 2
    window.forget(entry, "c1")
    assert not entry.recent and not entry.events


def test_outcomes_pack_and_unpack() -> None:
    assert unpack(accepted(T0, 123_456, 3)) == (T0, 123_456, 3, None)
    assert unpack(accepted(T0, 2**50, 3)) == (T0, 2**50, 3, None)  # too large to pack: a tuple
    assert unpack(rejected(T0, 7, "no")) == (T0, 7, 0, "no")


def test_gate_opens_only_at_partition_eof_at_or_past_the_captured_end() -> None:
    gate = PartitionGate(0, captured_end=100)
    gate.replayed(100, 100)
    assert gate.phase == RECOVERING  # reached the captured end, but no fetch said "end of partition" yet
    assert not gate.end_of_partition(90) and gate.phase == RECOVERING  # an EOF below the captured end
    gate2 = PartitionGate(0, captured_end=100)
    gate2.replayed(60, 60)
    assert not gate2.end_of_partition(60) and gate2.phase == RECOVERING  # EOF below the captured end
    assert gate.end_of_partition(130) and gate.position == 130
    assert gate.phase == RECOVERING and not gate.may_decide()  # replayed; LIVE only once its commands resume
    assert not gate.end_of_partition(140)  # said once
    gate.open()
    assert gate.phase == LIVE and gate.may_decide()
    assert not gate.end_of_partition(150)  # a new assignment starts a new gate


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


def test_result_round_trip() -> None:
    from kafold.messages import Result

    r = Result("c", "a", "accepted", 3, ("e1",), None, "c")
    assert decode_result(r.encode()[1]) == r


def test_fast_event_id_equals_the_uuid5_derivation() -> None:
    import uuid

    from kafold.envelope import KAFOLD_NAMESPACE, uuid5

    for cid, i in (("c1", 0), ("a/b", 3), ("ünï", 12), ("x" * 256, 0)):
        assert derive_event_id(cid, i) == str(uuid.uuid5(KAFOLD_NAMESPACE, f"{cid}/{i}"))
    # every value of the digit that carries the variant bits, and another namespace than kafold's
    ids = [derive_event_id(f"cmd-{n}", n % 5) for n in range(400)]
    assert ids == [str(uuid.uuid5(KAFOLD_NAMESPACE, f"cmd-{n}/{n % 5}")) for n in range(400)]
    assert {str(uuid.uuid5(KAFOLD_NAMESPACE, f"cmd-{n}/{n % 5}")).replace("-", "")[16] for n in range(400)} == \
        set("89ab")
    other = uuid.UUID("6f1c3b0e-5b8a-4f0e-9a55-6b6166f1d000")
    assert [uuid5(other, f"t/0/{n}") for n in range(100)] == [str(uuid.uuid5(other, f"t/0/{n}")) for n in range(100)]


class _Msg:
    """A consumed record, as the runtime's recovery folds it."""

    def __init__(self, offset: int, key: bytes, value: bytes) -> None:
        self._offset, self._key, self._value = offset, key, value

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def offset(self) -> int:
        return self._offset


def test_an_aggregate_whose_event_types_live_in_the_decide_module_folds_the_same_in_runtime_and_snapshot(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kafold.daemon.aggregates import recovery
    from kafold.envelope import Event, encode
    from kafold.snapshot.fold import Domain
    from kafold.snapshot.fold import folder as snapshot_folder

    (tmp_path / "tally_evolve.py").write_text(
        "def initial():\n    return {'n': 0, 'seen': []}\n\n"
        "def evolve(state, event):\n"
        "    return {'n': state['n'] + event.by, 'seen': [*state['seen'], type(event).__name__]}\n")
    (tmp_path / "tally_decide.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass(frozen=True)\nclass Added:\n    by: int\n\n"
        "EVENT_TYPES = {'Added': Added}\n\ndef decide(state, command):\n    return [Added(command['by'])]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    agg = AggregateConfig(name="tally", initial="tally_evolve:initial", evolve="tally_evolve:evolve",
                          decide="tally_decide:decide")
    events = [Event.new("Added", "tally", f"t{i % 3}", i // 3 + 1, {"by": i}) for i in range(12)]
    values = [encode(e)[1] for e in events]

    runtime = AggregateDomain.load(agg)
    store = StateStore(100)
    keys = [e.aggregate_id.encode() for e in events]
    recovery.folder(runtime, store, 0).fold_records(
        [_Msg(i, k, v) for i, (k, v) in enumerate(zip(keys, values, strict=True))])
    folder = snapshot_folder(Domain.load(agg))
    folder.fold(list(range(12)), keys, values)

    assert folder.bad == 0 and folder.folded == 12
    in_runtime = {aid: (e.state, e.version) for aid, e in store.entries.items()}
    assert folder.held.states() == in_runtime
    assert in_runtime["t1"] == ({"n": 1 + 4 + 7 + 10, "seen": ["Added"] * 4}, 4)


def test_both_folds_read_through_the_envelope_fast_path_and_keep_folding_what_its_decoder_refuses() -> None:
    from kafold import fold
    from kafold.daemon.aggregates import recovery
    from kafold.envelope import COUNT_MAX, Event, decode, encode, peek_body
    from kafold.errors import DecodeError
    from kafold.snapshot.fold import Domain
    from kafold.snapshot.fold import folder as snapshot_folder

    agg = bank_config("bank")
    events = [Event.new("AccountOpened", "bank", "a1", 1, {"owner": "ann", "currency": "EUR"}, causation_id="c1"),
              Event.new("MoneyDeposited", "bank", "a1", 2, {"amount": 500}, causation_id="c2")]
    records = [encode(e) for e in events]
    assert all(fold.fields(value).__class__.__name__ == "Body" for _, value, _ in records)  # read by peek_body
    # the envelope's decoder refuses these (an unknown field; a version beyond its bound) but folds always read them
    extra = records[1][1].replace(b'{"event_id"', b'{"note":"added by hand","event_id"', 1)
    high = encode(Event.new("MoneyDeposited", "bank", "a1", 3, {"amount": 7}))[1].replace(
        b'"version":3', b'"version":%d' % (COUNT_MAX + 1), 1)
    for value in (extra, high):
        assert peek_body(value) is None
        with pytest.raises(DecodeError):
            decode(b"a1", value, None)
    values = [records[0][1], extra, high, b'{"not":"an event"}', b"[]"]
    keys = [b"a1"] * len(values)

    agg = dataclasses.replace(agg, on_fold_error=FoldErrorPolicy.DEAD_LETTER)  # the last two are no events
    runtime = bank_domain(agg)
    store = StateStore(100)
    kernel = recovery.folder(runtime, store, 0)
    kernel.fold_records([_Msg(i, k, v) for i, (k, v) in enumerate(zip(keys, values, strict=True))])
    folder = snapshot_folder(Domain.load(agg, [str(BANK)]))
    folder.fold(list(range(len(values))), keys, values)

    assert (kernel.folded, kernel.bad) == (folder.folded, folder.bad) == (3, 2)
    assert [p.offset for p in kernel.parked] == [p.offset for p in folder.parked] == [3, 4]
    state, version = folder.held.states()["a1"]
    assert version == COUNT_MAX + 1 == store.entries["a1"].version
    assert state == store.entries["a1"].state and state.balance == 507
