"""Forgetting: cached aggregate states whose subject was forgotten (kafold.protect), evicted between two batches.

A state folded while a subject's key existed holds its data in clear; once the subject is forgotten (in this
process, or by another one: `kafold subjects forget`) the state is evicted and reloaded with placeholders. Nothing
here touches offsets or commits: an evicted state is reloaded from the committed events before its next use.
"""

from __future__ import annotations

import time
from typing import Any

from kafold import protect
from kafold.daemon.aggregates.store import StateStore
from kafold.domain import AggregateDomain
from kafold.errors import FatalError

ERASURES_CHECK_S = 2.0  # how often a runtime with protected fields looks for forgets made by other processes


class Forgetting:
    """The ids to evict before the next poll (`forget`, any thread) and the watch of other processes' forgets
    (`watch`, set once the runtime has started when its aggregate has protect rules)."""

    def __init__(self, name: str, domain: AggregateDomain, store: StateStore, log: Any) -> None:
        self.name, self.domain, self.store, self.log = name, domain, store, log
        self.forgotten: list[str] = []  # aggregate ids whose subject was forgotten, evicted before the next poll
        self.watch: protect.ErasureWatch | None = None  # forgets by other processes (the CLI), with protect rules
        self.checked_at = 0.0

    def forget(self, aggregate_id: str) -> None:
        self.forgotten.append(aggregate_id)

    def between_batches(self) -> None:
        """On the runtime's thread, before a poll: look for other processes' forgets now and then, then evict."""
        if self.watch is not None and time.monotonic() >= self.checked_at:
            self.checked_at = time.monotonic() + ERASURES_CHECK_S
            self._forget_erased(self.watch)
        while self.forgotten:
            aid = self.forgotten.pop()
            with self.store.lock:  # as StateStore.trim: evicted ids are reloaded from Kafka before any use
                entry = self.store.entries.pop(aid, None)
                if entry is not None:
                    self.store.evicted.setdefault(entry.partition, set()).add(aid)

    def _forget_erased(self, watch: protect.ErasureWatch) -> None:
        """Evict the states of subjects another process forgot (`kafold subjects forget`): they were folded while
        the key existed and are reloaded with placeholders. A state folded under a payload-path subject may hold
        any subject's data, so with such rules every state is reloaded after an erasure."""
        assert self.domain.protector is not None
        protector = self.domain.protector
        try:
            hashes = watch.new()
        except FatalError as e:  # PostgreSQL down for longer than the key store's retries: look again later
            self.log.warning("aggregate.erasures_unreadable", error=str(e))
            return
        if not hashes:
            return
        with self.store.lock:
            held = list(self.store.entries)
        if protector.subjects_in_payloads(self.name):
            matched = held
        else:
            matched = [aid for aid in held if protector.ring.cipher.subject_hash(aid) in hashes]
        protector.ring.drop(matched)
        self.forgotten.extend(matched)
        self.log.info("aggregate.erasures_seen", erasures=len(hashes), states_reloaded=len(matched))
