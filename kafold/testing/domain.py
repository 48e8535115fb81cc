"""Given events, when a command, then events, a rejection or a state: a domain's tests through the daemon's own path.

The domain is loaded as the daemon loads it (kafold.domain: its EVENT_TYPES/COMMAND_TYPES codec, its upcasters, the
fingerprint's checks), a command is read from its JSON and decided by kafold.decision (the function the aggregate
runtime calls), each event is written as the envelope stores it and read back from those bytes before `evolve`, and a
state is checked to survive the snapshot codec. So a tuple that would come back a list, a naive datetime, a float
where a Decimal was meant or an upcaster with a gap fails here, not in production. Pure: no broker, no database.

    fixture = DomainFixture.from_config("kafold.toml", "cart")
    fixture.given(CartOpened(opened_at=t0)).when(AddItems(lines=(Line("a", Decimal("2.50")),))).then(
        ItemsAdded(skus=("a",), lines=(Line("a", Decimal("2.50")),)))
    fixture.given().when(CheckOut(at=t0)).then_rejected("empty")
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kafold import decision
from kafold.config import AggregateConfig
from kafold.domain import AggregateDomain
from kafold.envelope import Event, derive_event_id, encode, utc_now
from kafold.errors import ConfigError
from kafold.fold import domain_event, fields
from kafold.schema import Problems, is_missing, load

__all__ = ["DomainFixture", "Stored", "Then"]

COMMAND_ID = "kafold-testing"


@dataclass(frozen=True)
class Stored:
    """An event as an older writer stored it: its type name, JSON payload and schema version (read through the
    domain's upcasters, as the daemon reads history)."""

    type: str
    payload: Mapping[str, Any]
    schema_version: int = 1


class DomainFixture:
    """A domain loaded as the daemon loads it; `given(...)` starts a scenario."""

    def __init__(self, domain: AggregateDomain, aggregate_id: str = "test-1") -> None:
        self.domain, self.aggregate_id = domain, aggregate_id

    @classmethod
    def from_config(cls, path: str | Path, aggregate: str, aggregate_id: str = "test-1") -> DomainFixture:
        """The `[[aggregates]]` entry named `aggregate` of a kafold.toml, with its `daemon.python_path` (relative
        to the file), upcasters and fingerprint, as the daemon reads it."""
        p = Path(path)
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
        entries = [a for a in raw.get("aggregates", []) if isinstance(a, dict) and a.get("name") == aggregate]
        if not entries:
            raise ConfigError([f"{p}: no [[aggregates]] entry named {aggregate!r}"])
        problems = Problems(str(p))
        agg = load(AggregateConfig, entries[0], f"aggregates[{aggregate!r}]", problems, p.parent)
        if problems.items or is_missing(agg):
            raise ConfigError(problems.items)
        python_path = raw.get("daemon", {}).get("python_path", [])
        return cls(AggregateDomain.load(agg, python_path, p.parent), aggregate_id)

    @classmethod
    def of(cls, name: str, initial: Callable[[], Any], evolve: Callable[[Any, Any], Any],
           decide: Callable[[Any, Any], Any], *, upcasters: Iterable[Mapping[str, Any]] = (),
           aggregate_id: str = "test-1") -> DomainFixture:
        """The domain of three module-level functions (and upcasters written as in kafold.toml), loaded by the
        same `module:function` references the daemon would resolve."""
        raw = {"name": name, "initial": _ref(initial), "evolve": _ref(evolve), "decide": _ref(decide),
               "upcasters": [dict(u) for u in upcasters]}
        problems = Problems(f"aggregate {name!r}")
        agg = load(AggregateConfig, raw, name, problems, Path("."))
        if problems.items or is_missing(agg):
            raise ConfigError(problems.items)
        return cls(AggregateDomain.load(agg), aggregate_id)

    def given(self, *events: Any) -> Given:
        """A history: domain events (today's classes, or dicts with `type` for a domain without classes) or
        `Stored` events of older schema versions, each written and read back as the daemon would."""
        state, version = self.domain.initial(), 0
        for ev in events:
            version += 1
            state = self.domain.evolve(state, self._read_back(ev, version))
        return Given(self, state, version)

    def _read_back(self, ev: Any, version: int) -> Any:
        if isinstance(ev, Stored):
            type_name, payload, schema_version = ev.type, dict(ev.payload), ev.schema_version
        else:
            type_name, payload, _ = self.domain.codec.written(ev)
            schema_version = self.domain.codec.upcaster.version_of(type_name)
        written = encode(Event(derive_event_id(f"{COMMAND_ID}-given", version), type_name, self.domain.name,
                               self.aggregate_id, version, utc_now(), COMMAND_ID, payload, schema_version))
        return domain_event(self.domain, fields(written[1]))


@dataclass(frozen=True)
class Given:
    """A scenario's state after its history; `when(command)` decides a command on it."""

    fixture: DomainFixture
    state: Any
    version: int

    def when(self, command: Any, data: Mapping[str, Any] | None = None) -> Then:
        """Decide a command: a command object (one of COMMAND_TYPES, sent as its JSON, as a client would) or a
        type name and its JSON data."""
        domain = self.fixture.domain
        if isinstance(command, str):
            type_name, body = command, dict(data or {})
        else:
            names = {c: n for n, c in domain.codec.command_types.items()}
            if type(command) not in names:
                raise AssertionError(f"{type(command).__name__} is not in the domain's COMMAND_TYPES "
                                     f"({', '.join(sorted(domain.codec.command_types)) or 'none'})")
            type_name, body = names[type(command)], msgspec.to_builtins(command, str_keys=True)
        out = decision.decide(domain, type_name, body, self.fixture.aggregate_id, self.state, self.version,
                              command_id=COMMAND_ID, correlation_id=COMMAND_ID, at=utc_now())
        return Then(self.fixture, out)


@dataclass(frozen=True)
class Then:
    """What the command gave; each `then_…` asserts one expectation and returns self, so they chain."""

    fixture: DomainFixture
    decided: decision.Decided

    @property
    def events(self) -> list[Any]:
        """The decided events as `evolve` received them: read back from the bytes the daemon would write."""
        return [domain_event(self.fixture.domain, fields(value)) for _, value, _ in self.decided.events]

    @property
    def state(self) -> Any:
        return self.decided.state

    def _accepted(self) -> None:
        d = self.decided
        if d.reason is not None:
            kind = f"refused as a defect ({d.error.reason})" if d.error is not None else "rejected"
            raise AssertionError(f"the command was {kind}: {d.reason}")

    def then(self, *expected: Any) -> Then:
        """Accepted, with exactly these events (compared as read back, in order)."""
        self._accepted()
        got = self.events
        if got != list(expected):
            raise AssertionError(f"decided events differ:\n  expected {list(expected)!r}\n  got      {got!r}")
        return self

    def then_nothing(self) -> Then:
        """Accepted, with no event (an idempotent command)."""
        return self.then()

    def then_rejected(self, reason: str | None = None) -> Then:
        """Rejected by a business rule (an exception of the decide module, or kafold's Rejected); `reason`: a
        substring of the reason the client would read. A defect (an invalid command, a bug) is not a
        rejection: it fails here, naming it."""
        d = self.decided
        if d.reason is None:
            raise AssertionError(f"the command was accepted with {len(d.events)} event(s), not rejected")
        if d.error is not None:
            raise AssertionError(f"the command was refused as a defect ({d.error.reason}), not rejected by the "
                                 f"domain: {d.reason}")
        if reason is not None and reason not in d.reason:
            raise AssertionError(f"rejected for {d.reason!r}, expected {reason!r}")
        return self

    def then_refused(self, reason: str) -> Then:
        """Refused as a defect the daemon dead-letters: `reason` is its kind (`invalid-command`, `unknown-type`,
        `decide-error`, `evolve-error`, `bad-event`)."""
        d = self.decided
        if d.error is None or d.error.reason != reason:
            got = d.error.reason if d.error is not None else ("accepted" if d.reason is None else "rejected")
            raise AssertionError(f"expected a {reason!r} refusal, got {got}: {d.reason}")
        return self

    def then_state(self, expected: Any) -> Then:
        """The state after the command equals `expected`, and survives the snapshot codec as itself (a
        snapshot restore gives back the same state)."""
        domain = self.fixture.domain
        if self.state != expected:
            raise AssertionError(f"state differs:\n  expected {expected!r}\n  got      {self.state!r}")
        restored = domain.state_from_json(msgspec.json.decode(msgspec.json.encode(domain.state_to_json(self.state))))
        if restored != self.state:
            raise AssertionError(f"the state does not survive a snapshot: {self.state!r} reads back as {restored!r}")
        return self


def _ref(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}:{fn.__name__}"
