"""Unit test: which of a projection's event types carry a subject's protected fields (`projection refresh`'s check)."""

from __future__ import annotations

import os

from kafold.connectors.projection.mapping import Mapping
from kafold.connectors.projection.subject_refresh import protected_types
from kafold.protect import Cipher, KeyRing, MemoryKeyStore, Protector, Rule
from tests.projection.test_projection_mapping import config

RULES = {("account", "AccountOpened"): Rule((("owner",),), "aggregate_id"),
         ("order", "Placed"): Rule((("email",),), "payload.customer_id")}


def _protector(rules: dict[tuple[str, str], Rule]) -> Protector:
    return Protector(rules, KeyRing(Cipher(os.urandom(32)), MemoryKeyStore()))


def test_protected_types_are_the_projected_types_with_a_rule() -> None:
    mapping = Mapping(config())  # folds AccountOpened, MoneyDeposited, AccountClosed
    assert protected_types(mapping, _protector(RULES)) == ["AccountOpened"]


def test_a_projection_of_unprotected_types_has_none() -> None:
    mapping = Mapping(config())
    assert protected_types(mapping, _protector({("order", "Placed"): RULES[("order", "Placed")]})) == []
