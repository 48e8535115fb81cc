"""Sealing a snapshot run's states (kafold.protect) looks their subjects' keys up a batch at a time, in one round
trip per batch, as the sink intake does; the states come out sealed, never in clear. Pure: an in-memory key store."""

from __future__ import annotations

from typing import Any

import orjson

from kafold.snapshot.fold import SEAL_BATCH, Domain, Held, Tail
from kafold.snapshot.select import Identity
from tests.core.test_protect import _Counting, protector


def _tail(p: Any) -> Tail:
    ident = Identity("customer", "fp", 1, p)
    domain = Domain(ident, dict, lambda s, e: s, lambda t, payload, v: payload, lambda s: s, lambda s: s)
    return Tail(domain)


def test_sealing_states_fetches_their_keys_in_one_round_trip_per_batch() -> None:
    store = _Counting()
    writer = protector(store=store)
    ids = [f"c-{i}" for i in range(5)]
    for aid in ids:
        writer.ring.for_writing(aid)  # the keys the events were written with
    tail = _tail(protector(store=store))  # a task's fresh ring: nothing cached
    for aid in ids:
        held = Held()
        held.version, held.state = 1, {"email": f"{aid}@example.com"}
        tail.add(aid, held)
    store.gets = store.batches = 0
    out = list(tail.encoded_snapshots(0, 10))
    assert store.batches == 1 and store.gets == 0  # 5 subjects, one batch (SEAL_BATCH is far above 5)
    assert len(out) == 5 and SEAL_BATCH > 5
    for key, value, _ in out:
        state = orjson.loads(value)["state"]
        assert isinstance(state, str) and state.startswith("kfenc1:") and b"@example.com" not in value
        assert writer.open_state("customer", key.decode(), state) == {"email": f"{key.decode()}@example.com"}
