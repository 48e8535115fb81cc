"""The local state store: one LMDB environment per assigned partition, holding its aggregates' states, versions,
idempotency window outcomes and the events offset they reflect; the in-memory LRU (store.py) is its hot cache.

Offsets and commits
-------------------
Kafka stays the source of truth; this store is a cache of it that survives restarts and evictions. It is written
only *after* a batch's transaction committed (`committed`), never before, so it can lag the committed events but
never be ahead of them: a crash between the commit and the store write leaves the store at its previous offset,
and the next assignment replays the tail from there (the fold skips an event whose version its aggregate already
has, so an aggregate record written later than the offset is harmless). Each partition records `offset`: every
committed event of the partition below it is in the records. It is written with a batch's states in one LMDB
transaction (atomic, fsync'd at commit) as the offset after the batch's last event, and when a gate opens as the
replay's end (`seal`).

On assignment (`open`) the store is trusted up to its offset only when it opens, its meta record's checksum matches,
it was written by the same fold (fingerprint and state schema version) in this record layout (`LAYOUT`), and its
offset lies within the committed events partition (first offset <= offset <= the last stable offset). Anything else
(missing, unreadable, another fold or layout, or *ahead* of the committed events: the events topic was recreated or
truncated, or the files came from elsewhere) empties the partition's store; the runtime then restores from the
snapshot topic + tail and fills the store from that restore.

Why the open reads one record, not all of them: LMDB commits by switching a meta page after the data pages are
synced, so a kill -9 or a power loss leaves the last committed transaction whole (no torn record to look for); what
a checksum still finds is damage after the fact (a failing disk, a file edited by hand). That is checked when a
record is read (`load`, `outcome`), not at the open, so a restart costs the same whatever the history (the open
checked every record's crc32 until 2026-12: 0.3-1 s per million records, one partition after another). A record
found damaged distrusts its partition: its meta record is deleted (the next open rebuilds it from the snapshot
topic + tail), nothing more is written to it, and the runtime stops with a FatalError naming the file (`damaged`);
the daemon's restart of the aggregate then rebuilds that partition. Deciding on, or answering from, a damaged
record is never done. Records written while a partition recovers (aggregates evicted from the
cache mid-replay, `spill`) carry committed states only (the replay reads read_committed) and are not trusted until
the gate opens and records the offset.

The idempotency window on disk, and the results offset
------------------------------------------------------
Each command id's first outcome (time, version after, events written, rejection reason) is kept under its aggregate
with an expiry index by command time; outcomes past the window are swept a bounded number per write. The meta
record also holds `results`: the offset of the results partition (same number) below which every committed result
the window needs (a rejection, an acceptance without events) is in the outcomes. It is written in the same LMDB
transaction as `offset` and the outcomes it covers: the offset after the batch's last result per partition
(TransactionalWriter.result_ends), and at a seal the end the gate's results read reached. A trusted store's
catch-up therefore reads only the results past it (recovery.note_results `since`), not the whole 24 hours; an
outcome recorded before it is read back from here when its command id is retried (`read_back`).

Why the crash orders are safe (the write follows the commit, in one LMDB transaction):
- transaction committed, store not written (a crash in between): `offset` and `results` both stay at an earlier
  batch's, at or below what Kafka committed; the events tail refolds the batch's states and the ids of its
  acceptances, the results tail past `results` gives its rejections: state and window equal a full replay's.
- store written, transaction aborted: cannot happen, the write is made only once `commit` returned True (an
  outcome not known yet is asked again until decided, txn.py; an error writes nothing). Were the files ahead
  anyway (copied from elsewhere, the topics recreated), `offset` above the events' last stable offset or `results`
  above the results' distrusts the whole store: it is emptied and rebuilt, as a missing or corrupt one is.
- a store without `results` (written before it was recorded) is trusted for its states; its window is rebuilt
  from the results within the window, as before.
"""

from __future__ import annotations

import hashlib
import shutil
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import orjson

from kafold import logs
from kafold.config import AggregateConfig, DaemonConfig
from kafold.daemon.aggregates.mapped import MappedPages
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.daemon.aggregates.window import Remembered, accepted, event_ids, rejected, unpack
from kafold.domain import AggregateDomain
from kafold.errors import FatalError

log = logs.get(__name__)

# Address space reserved per partition (LMDB maps its file; the file itself grows only as records are written).
MAP_SIZE = 1 << 36  # 64 GiB
SWEEP_MAX = 10_000  # expired window outcomes deleted per committed batch at most (the rest on the next ones)
META, AGGREGATE, EXPIRY = b"m", b"a", b"x"
# How the records are keyed (the meta record's `layout`; a store of another layout is rebuilt, as one of another fold).
# An aggregate's state and its window outcomes sit side by side (`state_key`, `outcome_key`: one prefix, the id's
# length first so no id is a prefix of another's keys), so a command on a cold aggregate dirties one page where its
# state is, not two far apart: at 1M accounts the store write of a batch of updates to random aggregates took half
# the batch (layout 1 kept outcomes under a prefix of their own; docs/benchmarks.md, issue 56).
LAYOUT = 2
# LMDB refuses a key over 511 bytes, and an id of MAX_ID_CHARS characters (kafold.envelope) is up to 1,024 bytes in
# UTF-8, two of them in an outcome's keys: such a command made the store's write fail after its commit, and the
# runtime stop on every restart. An id over ID_KEY_BYTES is keyed by its SHA-256, under a length no id has.
ID_KEY_BYTES = 128
_DIGEST_LENGTH = (1 << 31 | 32).to_bytes(4, "big")
# A state record's JSON: msgspec's, which writes and reads back an int of any size (orjson refuses one past 64 bits
# and reads it back as a float); as fast, and it reads the records orjson wrote.
_STATE_JSON, _STATE_READ = msgspec.json.Encoder(), msgspec.json.Decoder()


def _sealed(body: bytes) -> bytes:
    """A value with its crc32 in front: a record damaged on disk is found when the store is opened."""
    return zlib.crc32(body).to_bytes(4, "big") + body


_EMPTY = _sealed(b"")  # an expiry index entry's value: the key is the record


def _opened(value: bytes) -> bytes:
    if len(value) < 4 or zlib.crc32(value[4:]).to_bytes(4, "big") != value[:4]:
        raise ValueError("checksum mismatch")
    return value[4:]


def _time_of(value: bytes) -> int:
    """The command time of a stored outcome (a damaged one: 0, swept as expired; its next read would refuse it)."""
    try:
        return int(orjson.loads(value[4:])[0])
    except (ValueError, TypeError, IndexError, KeyError):
        return 0


def _id_part(value: str) -> bytes:
    """An id in a key: its length, then its bytes, or for a long one its digest (ID_KEY_BYTES)."""
    raw = value.encode()
    if len(raw) > ID_KEY_BYTES:
        return _DIGEST_LENGTH + hashlib.sha256(raw).digest()
    return len(raw).to_bytes(4, "big") + raw


def state_key(aggregate_id: str) -> bytes:
    return AGGREGATE + _id_part(aggregate_id) + b"s"


def outcome_key(aggregate_id: str, command_id: str) -> bytes:
    return AGGREGATE + _id_part(aggregate_id) + b"w" + _id_part(command_id)


@dataclass(frozen=True)
class Trusted:
    """What an opened store is trusted to: the events offset the tail replays from, and the results offset the
    window's results are read from (None: not recorded, the whole window is read)."""

    offset: int
    results: int | None


def local_states(daemon: DaemonConfig, agg: AggregateConfig, domain: AggregateDomain,
                 window_ms: int) -> LocalStates | None:
    """The local store of aggregate `agg` under `daemon.state_dir`, or None: no state_dir (evicted aggregates are
    reloaded from Kafka), or an aggregate with protected fields (its states hold opened values, which must not
    outlive a forget on a disk kafold does not erase; it keeps the Kafka reload)."""
    if not daemon.state_dir:
        return None
    if domain.protector is not None:
        log.warning("aggregate.local_store_off", aggregate=agg.name, reason="the aggregate has protected fields")
        return None
    return LocalStates(Path(daemon.state_dir) / agg.name, domain, agg.state_schema_version, window_ms)


class LocalStates:
    """The local stores of one aggregate type's assigned partitions, under `<state_dir>/<aggregate>/<partition>`."""

    def __init__(self, root: Path, domain: AggregateDomain, state_schema_version: int, window_ms: int) -> None:
        self.root = root
        self.domain = domain
        self.identity = {"fingerprint": domain.fingerprint, "state_schema_version": state_schema_version,
                         "layout": LAYOUT}
        self.window_ms = window_ms
        self.envs: dict[int, lmdb.Environment] = {}
        self.filling: set[int] = set()  # partitions recovering: their offset is recorded only when the gate opens
        # partitions sealed without a results offset: it stays where it was until they are opened and sealed again
        # (a later batch's would skip results whose outcomes the seal did not hold)
        self.results_held: set[int] = set()
        self.damaged: dict[int, str] = {}  # partition -> why it is distrusted (a record failed its checksum on read)
        self.reads = self.writes = 0
        self.mapped = MappedPages()  # the files' pages the process keeps mapped, bounded (mapped.py)

    def path(self, partition: int) -> Path:
        return self.root / str(partition)

    # ---- assignment ---------------------------------------------------------------------------------------------
    def open(self, partition: int, low: int, stable: int, results_stable: int | None = None) -> Trusted | None:
        """Open partition `partition`'s store; the offsets it is trusted to (the tails replay from there), or None
        when it was missing, unreadable, of another fold, outside [low, stable] or with a results offset above
        `results_stable` and was emptied (see the module note). `stable`, `results_stable`: the events and results
        partitions' last stable offsets (their committed ends; None: not checked, the results offset unused)."""
        self.close(partition)
        self.damaged.pop(partition, None)  # its meta record was deleted: this open empties and rebuilds it
        self.filling.add(partition)
        path = self.path(partition)
        why, offset, results = None, None, None
        try:
            env = self._env(path)
            meta = self._check(env)
            if meta is None:
                why = "missing"
            elif meta.get("layout", 1) != LAYOUT:  # written by an earlier kafold: its keys are not where we look
                why = f"record layout {meta.get('layout', 1)} (this kafold's: {LAYOUT})"
            elif {k: meta.get(k) for k in self.identity} != self.identity:
                why = "another fold"
            elif not low <= meta["offset"] <= stable:
                why = "ahead of the committed events" if meta["offset"] > stable else "before the first event"
            elif results_stable is not None and meta.get("results", -1) > results_stable:
                why = "ahead of the committed results"
            else:
                offset = int(meta["offset"])
                recorded = meta.get("results")
                results = None if results_stable is None or recorded is None else int(recorded)
        except (lmdb.Error, OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError) as e:
            why, env = f"unreadable: {type(e).__name__}: {e}", None
        if offset is None:
            if env is not None:
                env.close()
            shutil.rmtree(path, ignore_errors=True)
            try:
                env = self._env(path)
            except (lmdb.Error, OSError) as e:  # not writable, no space: no assignment can be served from here
                raise FatalError(f"local state store {path}: cannot create it: {e}") from e
            log.warning("aggregate.local_store_rebuilding", partition=partition, path=str(path), reason=why,
                        low=low, committed_end=stable)
        else:
            log.info("aggregate.local_store_trusted", partition=partition, path=str(path), offset=offset,
                     committed_end=stable, tail=stable - offset, results_offset=results,
                     results_tail=None if results is None or results_stable is None else results_stable - results)
        assert env is not None
        self.envs[partition] = env
        self.mapped.opened(partition, path / "data.mdb")
        return None if offset is None else Trusted(offset, results)

    def _env(self, path: Path) -> lmdb.Environment:
        path.mkdir(parents=True, exist_ok=True)
        # sync on commit (the default): a recorded offset survives a power loss with the records it covers
        return lmdb.open(str(path), map_size=MAP_SIZE, max_dbs=0, readahead=False, lock=True)

    def _check(self, env: lmdb.Environment) -> dict[str, Any] | None:
        """The partition's meta record, its checksum verified (ValueError on a bad one); the other records are
        verified when read (see the module note: why the open reads one record)."""
        with env.begin() as txn:
            value = txn.get(META)
        return None if value is None else dict(orjson.loads(_opened(value)))

    def seal(self, partition: int, entries: Iterable[tuple[str, Entry]], offset: int, results: int | None) -> None:
        """The gate of `partition` opened at events offset `offset`: the partition's cached entries (what the restore
        and the tail replay built, with the outcomes the results read added; those evicted meanwhile were spilled),
        the offset and `results`, where that results read ended, in one LMDB transaction. `results` None: not every
        outcome the read found is in `entries` (or none was read), so the recorded one is kept, and no batch moves
        it until the partition is opened and sealed again."""
        self._write(partition, entries, None, offset, results=results)
        self.filling.discard(partition)
        if results is None:
            self.results_held.add(partition)

    def close(self, partition: int) -> None:
        """The partition was released (revoked, or re-opened): its files stay, for a later assignment here."""
        self.mapped.closing(partition)  # before the map goes: it is never advised after its close
        env = self.envs.pop(partition, None)
        self.filling.discard(partition)
        self.results_held.discard(partition)
        if env is not None:
            env.close()

    def close_all(self) -> None:
        for n in list(self.envs):
            self.close(n)

    # ---- reads --------------------------------------------------------------------------------------------------
    def load(self, partition: int, aggregate_id: str) -> Entry | None:
        """The stored entry of `aggregate_id` (state and version; its window outcomes are read one by one, `outcome`),
        or None: it has no committed event below the recorded offset (or the partition is not open here)."""
        env = self.envs.get(partition)
        if env is None:
            return None
        with env.begin() as txn:
            found = self._entry(txn, partition, aggregate_id)
        self.mapped.touch(partition, 1)
        return found

    def _entry(self, txn: Any, partition: int, aggregate_id: str) -> Entry | None:
        value = self._value(partition, txn, state_key(aggregate_id))
        if value is None:
            return None
        self.reads += 1
        version, state = _STATE_READ.decode(value)
        return Entry(self.domain.state_from_json(state), version, partition)

    def outcome(self, partition: int, aggregate_id: str, command_id: str) -> Remembered | None:
        """The first outcome of `command_id` on `aggregate_id`, if decided within the window (expired ones may linger
        until swept: the caller compares times, as for the ones in memory)."""
        env = self.envs.get(partition)
        if env is None:
            return None
        with env.begin() as txn:
            found = self._outcome(txn, partition, aggregate_id, command_id)
        self.mapped.touch(partition, 1)
        return found

    def _outcome(self, txn: Any, partition: int, aggregate_id: str, command_id: str) -> Remembered | None:
        value = self._value(partition, txn, outcome_key(aggregate_id, command_id))
        if value is None:
            return None
        t, after, n, reason = orjson.loads(value)
        return accepted(t, after, n) if reason is None else rejected(t, after, reason)

    def _value(self, partition: int, txn: Any, key: bytes) -> bytes | None:
        """The body of record `key` read in `txn`, its checksum verified; a damaged one distrusts the partition
        (FatalError)."""
        if partition in self.damaged:
            raise FatalError(self.damaged[partition])
        try:
            value = txn.get(key)
            return None if value is None else _opened(value)
        except (ValueError, lmdb.CorruptedError) as e:
            self._distrust(partition, self.envs[partition], key, e)
            raise FatalError(self.damaged[partition]) from e

    def _distrust(self, partition: int, env: lmdb.Environment, key: bytes, error: Exception) -> None:
        """A record failed its check: the meta record goes (the next open rebuilds the partition) and nothing more
        is written here; the runtime stops on `damaged` (the module note)."""
        path = self.path(partition)
        self.damaged[partition] = (f"local state store {path}: record {key[:64]!r} is damaged ({error}); the "
                                   "partition is rebuilt from the snapshot topic and its events when opened again")
        try:
            with env.begin(write=True) as txn:
                txn.delete(META)
        except lmdb.Error as e:  # cannot even write: the files go instead, so the next open finds nothing to trust
            log.error("aggregate.local_store_unwritable", partition=partition, path=str(path), error=str(e))
            shutil.rmtree(path, ignore_errors=True)
        log.error("aggregate.local_store_damaged", partition=partition, path=str(path), key=repr(key[:64]),
                  error=str(error), fix="the aggregate stops; its restart rebuilds the partition")

    def disk_bytes(self) -> int:
        """Bytes of the open partitions' files on disk (what /metrics shows)."""
        total = 0
        for n in list(self.envs):
            for f in self.path(n).glob("*.mdb"):
                try:
                    total += f.stat().st_blocks * 512
                except OSError:
                    continue
        return total

    def read_back(self, store: StateStore, commands: Iterable[tuple[int, str, str]]) -> None:
        """Before a batch is decided: its aggregates that are not cached, and the outcomes of its command ids that are
        not in memory (evicted with their aggregate, or dropped early from the window), read back into `store`.
        `commands`: (partition, aggregate id, command id) of each command of the batch. One read transaction per
        partition for the whole batch (a transaction per key cost as much as the lookup itself)."""
        readers: dict[int, Any] = {}
        try:
            for n, aid, cid in commands:
                txn = readers.get(n)
                if txn is None:
                    env = self.envs.get(n)
                    if env is None:  # not open here: nothing to read back (as `load` answers)
                        continue
                    txn = readers[n] = env.begin()
                entry = store.get(aid)
                if entry is None:
                    entry = self._entry(txn, n, aid)
                    if entry is not None:
                        store.put(aid, entry)
                if entry is not None and cid in entry.recent:
                    continue
                seen = self._outcome(txn, n, aid, cid)
                if seen is None:
                    continue
                if entry is None:  # a key known only from rejections
                    entry = Entry(self.domain.initial(), 0, n)
                    store.put(aid, entry)
                _, after, count, reason = unpack(seen)
                store.window.remember(entry, aid, cid, seen,
                                      event_ids(cid, after - count, count) if reason is None and count else ())
        finally:
            for txn in readers.values():
                txn.abort()
            for n in readers:  # the partitions this batch read from
                self.mapped.release(n)

    # ---- writes -------------------------------------------------------------------------------------------------
    def write_batch(self, store: StateStore, decided: Mapping[str, list[str]], ends: Mapping[tuple[str, int], int],
                    events_topic: str, result_ends: Mapping[tuple[str, int], int] | None = None,
                    results_topic: str = "") -> None:
        """After a batch's transaction committed: the aggregates it changed (id -> the command ids decided on it),
        from `store`, with the offset after each partition's newest committed event (`ends`: (topic, partition) ->
        offset, TransactionalWriter.ends) and after its newest committed result (`result_ends`,
        TransactionalWriter.result_ends).

        Commit note: called after the commit returned, never before; a crash in between leaves the store behind
        the committed events (never ahead), and the next assignment replays the tail past its recorded offset."""
        touched: dict[int, list[tuple[str, Entry, list[str]]]] = {}
        with store.lock:
            for aid, cids in decided.items():
                entry = store.entries.get(aid)  # changed in this batch: still cached (trim runs after)
                if entry is not None:
                    touched.setdefault(entry.partition, []).append((aid, entry, cids))
        after = {n: off + 1 for (topic, n), off in ends.items() if topic == events_topic}
        results = {n: off for (topic, n), off in (result_ends or {}).items() if topic == results_topic}
        self.committed(touched, after, store.window.high - self.window_ms, results)

    def committed(self, entries: dict[int, list[tuple[str, Entry, list[str]]]], ends: dict[int, int],
                  cutoff: int, results: dict[int, int] | None = None) -> None:
        """After a batch's transaction committed: per partition the touched aggregates (entry, command ids decided)
        and `ends[partition]`, the offset after its last committed event (absent: no event written, the offset
        stays), `results[partition]` the offset after its last committed result (absent: it stays). Outcomes older
        than `cutoff` (ms) are swept. A partition with no touched aggregate (only duplicates) is not written: its
        results offset lags by results a restart reads and skips (a duplicate adds nothing to the window)."""
        results = results or {}
        for n, touched in entries.items():
            if n in self.envs:
                self._write(n, [(aid, e) for aid, e, _ in touched],
                            [(aid, cid, e.recent[cid]) for aid, e, cids in touched for cid in cids if cid in e.recent],
                            ends.get(n), cutoff, None if n in self.results_held else results.get(n))

    def spill(self, evicted: Iterable[tuple[str, Entry]]) -> None:
        """Entries evicted from the cache while their partition recovers (changed by the replay, not yet written):
        their records, so they are read back rather than refolded; the offset is not touched."""
        by: dict[int, list[tuple[str, Entry]]] = {}
        for aid, entry in evicted:
            if entry.partition in self.filling and entry.partition in self.envs:
                by.setdefault(entry.partition, []).append((aid, entry))
        for n, entries in by.items():
            self._write(n, entries, None, None)

    def keep(self, dropped: Iterable[tuple[int, str, str, Remembered]]) -> None:
        """Window outcomes dropped from memory early (idempotency_max_ids, Window.keep): those of a recovering
        partition are written now (its seal writes only what the cache still holds, and records an offset past
        them); a live partition's were written with their batch. The offsets are not touched."""
        by: dict[int, list[tuple[str, str, Remembered]]] = {}
        for n, aid, cid, outcome in dropped:
            if n in self.filling and n in self.envs:
                by.setdefault(n, []).append((aid, cid, outcome))
        for n, outcomes in by.items():
            self._write(n, (), outcomes, None)

    def _write(self, partition: int, entries: Iterable[tuple[str, Entry]],
               outcomes: list[tuple[str, str, Remembered]] | None, offset: int | None, cutoff: int | None = None,
               results: int | None = None) -> None:
        env = self.envs.get(partition)
        if env is None:
            return
        if partition in self.damaged:  # its meta record was deleted: writing one again would trust it again
            raise FatalError(self.damaged[partition])
        try:
            self._write_txn(env, entries, outcomes, offset, cutoff, results)
        except lmdb.Error as e:  # disk full, a failing disk: the store lags from here; a restart replays the tail
            raise FatalError(f"local state store {self.path(partition)}: cannot write: {e}") from e
        self.mapped.release(partition)

    def _write_txn(self, env: lmdb.Environment, entries: Iterable[tuple[str, Entry]],
                   outcomes: list[tuple[str, str, Remembered]] | None, offset: int | None, cutoff: int | None,
                   results: int | None) -> None:
        """One LMDB transaction."""
        dumps, to_json, put_outcome = _STATE_JSON.encode, self.domain.state_to_json, self._put_outcome
        with env.begin(write=True) as txn:
            put = txn.put
            for aid, entry in entries:
                if entry.version > 0:  # a key known only from rejections has no state to keep, only outcomes
                    put(state_key(aid), _sealed(dumps([entry.version, to_json(entry.state)])))
                    self.writes += 1
                if outcomes is None:  # a seal or a spill: the whole window the entry holds
                    for cid, o in entry.recent.items():
                        put_outcome(put, aid, cid, o)
            for aid, cid, o in outcomes or ():
                put_outcome(put, aid, cid, o)
            if offset is not None or results is not None:  # the offsets, with the records they cover
                meta = self._meta(txn)
                if offset is not None:
                    meta["offset"] = offset
                if results is not None:
                    meta["results"] = max(results, meta.get("results", 0))  # a delivery report may be missed
                if "offset" in meta:  # never a meta without the events offset (read as unreadable)
                    put(META, _sealed(dumps({**meta, **self.identity})))
            if cutoff is not None:
                self._sweep(txn, cutoff)

    def _meta(self, txn: Any) -> dict[str, Any]:
        value = txn.get(META)
        return {} if value is None else dict(orjson.loads(value[4:]))

    def _put_outcome(self, put: Any, aggregate_id: str, command_id: str, outcome: Remembered) -> None:
        t, after, n, reason = unpack(outcome)
        key = outcome_key(aggregate_id, command_id)
        put(key, _sealed(orjson.dumps([t, after, n, reason])))
        put(EXPIRY + t.to_bytes(8, "big") + key, _EMPTY)

    def _sweep(self, txn: Any, cutoff: int) -> int:
        """Delete the window outcomes decided before `cutoff` (by command time), oldest first, at most SWEEP_MAX;
        the expiry entries deleted."""
        cursor, n = txn.cursor(), 0
        if not cursor.set_range(EXPIRY):
            return 0
        while n < SWEEP_MAX:
            key = cursor.key()
            if not key.startswith(EXPIRY) or int.from_bytes(key[1:9], "big") >= cutoff:
                break
            outcome = key[9:]
            value = txn.get(outcome)
            # the id decided again since (retried past the window): its newer outcome, under its own expiry entry, stays
            if value is not None and _time_of(value) < cutoff:
                txn.delete(outcome)
            if not cursor.delete():  # moves to the next record
                break
            n += 1
        return n
