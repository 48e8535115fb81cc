"""`kafold run`'s demo traffic, folded through the bank example's own decide/evolve: a believable bank, mostly
accepted, with a few refusals of more than one kind."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter
from typing import Any

from kafold import config
from kafold.domain import AggregateDomain
from kafold.refs import import_ref
from tests.support import EXAMPLES


def test_the_demo_traffic_is_mostly_accepted_with_a_few_refusals_to_show() -> None:
    loaded = config.load_file(EXAMPLES / "bank" / "kafold.toml")
    agg = loaded.config.aggregates[0]
    domain = AggregateDomain.load(agg, loaded.config.daemon.python_path, loaded.base)
    with config.python_path(loaded.config, loaded.base):
        generate = import_ref("bank_traffic:commands")  # what `kafold run` sends by default
    states: dict[str, Any] = {}
    accepted, refused = 0, Counter[str]()
    first_seconds = 0.0
    for n, (aggregate_id, command) in enumerate(itertools.islice(generate(random.Random(7)), 20_000)):
        if n == 1_000:  # what the live view shows first: a few seconds at the default rate
            first_seconds = accepted / n
        # As the command travels: its type name and fields as JSON data, rebuilt by the domain on the other side.
        data = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
        state = states.get(aggregate_id, domain.initial())
        try:
            events = domain.decide(domain.command(type(command).__name__, data), state)
        except domain.rejections as e:
            refused[str(e).split(":")[0]] += 1
            continue
        accepted += 1
        for event in events:
            state = domain.evolve(state, domain.event(*domain.codec.payload(event)))
        states[aggregate_id] = state
    total = accepted + sum(refused.values())
    assert first_seconds >= 0.9 and accepted / total >= 0.9, (first_seconds, accepted, refused)
    assert sum(refused.values()) / total >= 0.01, refused  # refusals are there to be seen...
    assert {"insufficient funds", "account is closed", "account already exists", "account is new"} <= set(refused)
    statuses = Counter(s.status for s in states.values())
    assert statuses["open"] >= 150 and statuses["closed"] > 0, statuses  # ...among accounts that live and close
