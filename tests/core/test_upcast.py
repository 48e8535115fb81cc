"""Upcaster chains (kafold.upcast): declarative and function steps, the newest version writers use, gaps and
conflicts refused when the configuration loads, a failing step named; and the cart aggregate reading a v1/v2
history as today's v3 events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from kafold import config
from kafold.config import AggregateConfig
from kafold.daemon.aggregates import recovery
from kafold.daemon.aggregates.store import StateStore
from kafold.domain import AggregateDomain
from kafold.envelope import Event, encode
from kafold.errors import ConfigError
from kafold.upcast import UpcasterConfig, UpcastError, build

M = "tests.aggregates.cart_domain"
AT = "2026-11-01T09:00:00Z"
# The cart's ItemsAdded history: v1 was called CartFilled with `items`; v2 renamed it ItemsAdded with `lines`;
# v3 (today) also carries `skus`, computed from the lines (a function step).
CART_UPCASTERS = [UpcasterConfig(type="CartFilled", from_version=1, rename_type="ItemsAdded",
                                 rename_fields={"items": "lines"}),
                  UpcasterConfig(type="ItemsAdded", from_version=2, function="tests.core.test_upcast:skus_from_lines")]


def skus_from_lines(type_name: str, version: int, payload: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
    if not isinstance(payload.get("lines"), list):
        raise ValueError("no lines")
    return type_name, version + 1, {**payload, "skus": [line["sku"] for line in payload["lines"]]}


def test_declared_steps_rename_add_remove_and_split() -> None:
    up = build([UpcasterConfig(type="Moved", rename_fields={"addr": "address"}, add_fields={"country": "FR"},
                               remove_fields=["legacy"]),
                UpcasterConfig(type="Moved", from_version=2, split_on="kind",
                               split_types={"home": "HomeMoved", "office": "OfficeMoved"})], "aggregates[0]")
    assert up.apply("Moved", 1, {"addr": "x", "legacy": 1, "kind": "home"}) == \
        ("HomeMoved", 3, {"address": "x", "country": "FR", "kind": "home"})
    assert up.apply("Moved", 2, {"kind": "office"}) == ("OfficeMoved", 3, {"kind": "office"})
    assert up.apply("Other", 1, {"a": 1}) == ("Other", 1, {"a": 1})  # no chain: as stored
    assert (up.version_of("Moved"), up.version_of("HomeMoved"), up.version_of("Other")) == (3, 3, 1)
    with pytest.raises(UpcastError, match=r"upcasting Moved v2 failed: ValueError: kind='car' is none of"):
        up.apply("Moved", 1, {"kind": "car"})


def test_a_rename_chain_reaches_todays_version() -> None:
    up = build(CART_UPCASTERS, "aggregates[0]")
    lines = [{"sku": "a", "price": "1.10"}]
    assert up.apply("CartFilled", 1, {"items": lines}) == ("ItemsAdded", 3, {"lines": lines, "skus": ["a"]})
    assert up.apply("ItemsAdded", 2, {"lines": lines}) == ("ItemsAdded", 3, {"lines": lines, "skus": ["a"]})
    assert up.version_of("ItemsAdded") == 3
    with pytest.raises(UpcastError, match=r"upcasting ItemsAdded v2 failed: ValueError: no lines"):
        up.apply("CartFilled", 1, {})


@pytest.mark.parametrize(("steps", "problem"), [
    ([UpcasterConfig(type="A", from_version=1, rename_fields={"a": "b"}),
      UpcasterConfig(type="A", from_version=3, rename_fields={"b": "c"})], "event type 'A' has no step from v2"),
    ([UpcasterConfig(type="A", from_version=2, rename_fields={"a": "b"})], "event type 'A' has no step from v1"),
    ([UpcasterConfig(type="A", rename_fields={"a": "b"}), UpcasterConfig(type="A", add_fields={"c": 1})],
     "a second step reads A v1"),
    ([UpcasterConfig(type="A")], "nothing to do"),
    ([UpcasterConfig(type="A", function="nope.mod:f")], "cannot import module 'nope.mod'"),
    ([UpcasterConfig(type="A", function="json:loads", rename_type="B")], "not both"),
])
def test_a_chain_with_a_gap_or_a_conflict_is_refused(steps: list[UpcasterConfig], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(steps, "aggregates[0]")
    assert any(problem in p and p.startswith("aggregates[0].upcasters") for p in info.value.problems), \
        info.value.problems


def test_the_configuration_file_refuses_a_gap_at_load(tmp_path: Path) -> None:
    path = tmp_path / "kafold.toml"
    path.write_text(f"""
[[aggregates]]
name = "cart"
initial = "{M}:initial"
evolve = "{M}:evolve"
decide = "{M}:decide"

[[aggregates.upcasters]]
type = "ItemsAdded"
from_version = 1
add_fields = {{note = ""}}

[[aggregates.upcasters]]
type = "ItemsAdded"
from_version = 3
function = "tests.core.test_upcast:skus_from_lines"
""")
    with pytest.raises(ConfigError, match=r"aggregates\[0\]\.upcasters: event type 'ItemsAdded' has no step from v2"):
        config.load_file(path)


def test_a_connector_on_an_aggregates_events_takes_its_upcasters_unless_it_is_raw(tmp_path: Path) -> None:
    """One chain per topic: a projection or webhook reading the cart's events sees them in today's shape without
    repeating the aggregate's chain; `raw = true` sees them as written; its own chain replaces the inherited one."""
    path = tmp_path / "kafold.toml"
    aggregate = f"""
[[aggregates]]
name = "cart"
initial = "{M}:initial"
evolve = "{M}:evolve"
decide = "{M}:decide"

[[aggregates.upcasters]]
type = "CartFilled"
from_version = 1
rename_type = "ItemsAdded"
"""
    path.write_text(aggregate + """
[[connectors]]
name = "rows"
class = "log"
topics = ["cart.events"]

[[connectors]]
name = "hooks"
class = "log"
topics = ["cart.events"]
raw = true

[[connectors]]
name = "own"
class = "log"
topics = ["cart.events"]

[[connectors.upcasters]]
type = "Other"
from_version = 1
rename_type = "Another"

[[connectors]]
name = "elsewhere"
class = "log"
topics = ["orders"]
""")
    cons = {c.name: c for c in config.load_file(path).config.connectors}
    assert [(u.type, u.rename_type) for u in cons["rows"].upcasters] == [("CartFilled", "ItemsAdded")]
    assert cons["hooks"].upcasters == [] and cons["elsewhere"].upcasters == []
    assert [u.type for u in cons["own"].upcasters] == ["Other"]
    path.write_text(aggregate + """
[[connectors]]
name = "hooks"
class = "log"
topics = ["cart.events"]
raw = true

[[connectors.upcasters]]
type = "Other"
from_version = 1
rename_type = "Another"
""")
    with pytest.raises(ConfigError, match=r"connectors\[0\]\.raw: a raw connector sees events as written"):
        config.load_file(path)


def _cart(upcasters: list[UpcasterConfig]) -> AggregateDomain:
    return AggregateDomain.load(AggregateConfig(name="cart", initial=f"{M}:initial", evolve=f"{M}:evolve",
                                                decide=f"{M}:decide", upcasters=upcasters))


def test_a_history_in_v1_v2_and_v3_folds_to_the_state_of_the_same_history_in_v3() -> None:
    lines = [{"sku": "a", "price": "1.10"}, {"sku": "b", "price": "2"}]
    more = [{"sku": "c", "price": "0.05"}]
    old = [Event.new("CartOpened", "cart", "c1", 1, {"opened_at": "2026-11-01T09:00:00Z"}),
           Event.new("CartFilled", "cart", "c1", 2, {"items": lines}),
           Event.new("ItemsAdded", "cart", "c1", 3, {"lines": more}, schema_version=2),
           Event.new("ItemsAdded", "cart", "c1", 4, {"lines": more, "skus": ["c"], "note": "v3"}, schema_version=3)]
    native = [old[0], Event.new("ItemsAdded", "cart", "c1", 2, {"lines": lines, "skus": ["a", "b"]}, schema_version=3),
              Event.new("ItemsAdded", "cart", "c1", 3, {"lines": more, "skus": ["c"]}, schema_version=3), old[3]]
    domain = _cart(CART_UPCASTERS)

    def fold(evs: list[Event]) -> Any:
        store = StateStore(10)
        records = [encode(e) for e in evs]
        recovery.folder(domain, store, 0).fold(list(range(len(evs))), [k for k, _, _ in records],
                                               [v for _, v, _ in records])
        return domain.state_to_json(store.entries["c1"].state), store.entries["c1"].version

    assert fold(old) == fold(native)
    assert orjson.loads(orjson.dumps(fold(old)[0]))["skus"] == ["a", "b", "c", "c"]


def test_decide_writes_the_newest_version() -> None:
    from kafold.daemon.aggregates.processor import handle
    from kafold.daemon.aggregates.store import Entry
    from kafold.messages import Command

    domain = _cart(CART_UPCASTERS)
    entry = Entry(domain.initial(), 0, 0)
    opened = handle(domain, Command("o", "OpenCart", "c1", {"at": "2026-11-01T09:00:00Z"}), entry, AT, 0, 1)
    entry = Entry(opened.state, opened.version, 0)
    added = handle(domain, Command("a", "AddItems", "c1", {"lines": [{"sku": "a", "price": "1"}]}), entry, AT, 0, 1)
    bodies = [orjson.loads(v) for _, v, _ in [*opened.events, *added.events]]
    assert [(b["type"], b["schema_version"]) for b in bodies] == [("CartOpened", 1), ("ItemsAdded", 3)]


def test_a_spark_jobs_spec_carries_the_upcasters_and_the_policy_with_their_types() -> None:
    """Executors rebuild the aggregate's settings from the job's JSON spec: the chain and the fold-error policy
    must come back as the loader gave them (a dict step or a plain string policy would build another fold)."""
    from kafold.config import FoldErrorPolicy, KafkaConfig
    from kafold.spark_jobs.source import load_spec, spec_json

    agg = AggregateConfig(name="cart", initial=f"{M}:initial", evolve=f"{M}:evolve", decide=f"{M}:decide",
                          upcasters=CART_UPCASTERS, on_fold_error=FoldErrorPolicy.DEAD_LETTER)
    _, back, _, _ = load_spec(spec_json(KafkaConfig(bootstrap_servers="b:1"), agg, [], [0], 0))
    assert back == agg and back.on_fold_error is FoldErrorPolicy.DEAD_LETTER
    assert build(back.upcasters, "x").apply("CartFilled", 1, {"items": []})[:2] == ("ItemsAdded", 3)
