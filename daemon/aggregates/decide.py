"""Decider: one batch's commands decided into an open transaction (events, results, dead letters) with an undo log.

Offsets and commits: nothing is committed here. The runtime (runtime.py) begins the transaction, hands the LIVE
commands to `decide`, and commits the events, results and dead letters written here together with the commands'
offsets; an aborted transaction is undone from the `Undo` log this fills (StateStore.revert).
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

from kafold import tracing
from kafold.config import AggregateConfig
from kafold.connectors.api import RawRecord
from kafold.connectors.dlq import dlq_headers, fitted
from kafold.daemon.aggregates.gate import PartitionGate
from kafold.daemon.aggregates.processor import handle
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.daemon.aggregates.txn import TransactionalWriter
from kafold.domain import AggregateDomain
from kafold.envelope import format_epoch_ms
from kafold.errors import DecodeError, RecordError
from kafold.kafka_message import Message
from kafold.messages import REJECTED, Command, Result, decode_command, header

CLOCK_SKEW_MS = 60_000  # a command time further ahead of this host's clock is taken as this host's clock

# Per aggregate touched in a batch: (state, version) as committed (None: new in this batch), command ids decided
Undo = dict[str, tuple[tuple[Any, int] | None, list[str]]]
TALLY = ("accepted", "rejected", "dead_lettered", "duplicates", "events")


def command_time(m: Any, now_ms: int) -> int:
    """A command's time (ms): its record's timestamp, or `now_ms` when it has none or one from the future (a
    client clock far ahead must not push every other id out of the window)."""
    kind, ts = m.timestamp()
    return ts if kind != TIMESTAMP_NOT_AVAILABLE and 0 < ts <= now_ms + CLOCK_SKEW_MS else now_ms


def decode(m: Any) -> Command | DecodeError:
    try:
        return decode_command(m.key(), m.value(), raw=m)
    except DecodeError as e:
        return e


class Decider:
    """Decides commands of LIVE partitions against the store (`gates`: the runtime's, read to note first
    decisions and count any decided while recovering, which must stay 0)."""

    def __init__(self, agg: AggregateConfig, domain: AggregateDomain, store: StateStore,
                 gates: dict[int, PartitionGate], window_ms: int, log: Any) -> None:
        self.agg, self.domain, self.store, self.gates, self.window_ms, self.log = (agg, domain, store, gates,
                                                                                   window_ms, log)
        self.commands, self.events, self.results = (agg.topic(k) for k in ("commands", "events", "results"))

    def decide(self, writer: TransactionalWriter, live: list[Message], decoded: list[Command | DecodeError],
               undo: Undo) -> tuple[dict[int, int], dict[int, int], dict[str, int]]:
        """Write the outcome of every command of `live` into `writer`'s open transaction; (first offset and next
        offset per partition, the tally of outcomes)."""
        tally = dict.fromkeys(TALLY, 0)
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        now_ms = int(time.time() * 1000)
        tracer = tracing.tracer()  # once per batch: off, no header is read and nothing traced
        for m, cmd in zip(live, decoded, strict=True):
            n, offset = m.partition(), m.offset()
            if n not in first:
                first[n] = offset
            last[n] = offset + 1
            if tracer is None:
                self._one(writer, m, cmd, n, command_time(m, now_ms), undo, tally)
            else:
                self._one_traced(writer, tracer, m, cmd, n, command_time(m, now_ms), undo, tally)
        return first, last, tally

    def _one_traced(self, writer: TransactionalWriter, tracer: Any, m: Any, cmd: Command | DecodeError, n: int,
                    t: int, undo: Undo, tally: dict[str, int]) -> None:
        """`_one` in a span, child of the command record's trace context; its events and result carry the span's."""
        # opentelemetry: kafold[tracing], imported only when [tracing] is on
        from opentelemetry import trace

        name = f"handle {self.agg.name} {cmd.type}" if isinstance(cmd, Command) else f"handle {self.agg.name}"
        with tracer.start_as_current_span(name, context=tracing.extract(m.headers()), kind=trace.SpanKind.CONSUMER,
                                          attributes={"kafold.aggregate": self.agg.name, "kafold.partition": n,
                                                      "kafold.offset": m.offset()}) as span:
            self._one(writer, m, cmd, n, t, undo, tally, tracing.inject(trace.set_span_in_context(span)))

    def _one(self, writer: TransactionalWriter, m: Any, cmd: Command | DecodeError, n: int, t: int, undo: Undo,
             tally: dict[str, int], trace: list[tuple[str, bytes]] | None = None) -> None:
        at = format_epoch_ms(t)
        landing = None  # where the command's last event lands: its result's token (txn.py)
        if isinstance(cmd, DecodeError):
            key = m.key() or b""
            cid = header(m.headers(), "kafold-command-id") or f"{m.topic()}/{n}/{m.offset()}"
            result = Result(cid, key.decode("utf-8", "replace"), REJECTED, 0, (), str(cmd), cid, at=at)
            self.dead_letter(writer, m, cmd)
            tally["rejected"] += 1
            tally["dead_lettered"] += 1
        else:
            entry = self.store.get(cmd.aggregate_id)
            fresh = entry is None
            if entry is None:
                entry = Entry(self.domain.initial(), 0, n)
            gate = self.gates[n]
            if not gate.may_decide():  # unreachable by construction; counted so a test can prove it
                gate.decided_while_recovering += 1
            if gate.first_decided_at is None:
                gate.first_decided_at = time.monotonic()
            out = handle(self.domain, cmd, entry, at, t, self.window_ms)
            result = out.result
            if trace:  # tracing on: the events carry the aggregate span's context (kafold.tracing)
                out.events = [(k, v, [*h, *trace]) for k, v, h in out.events]
            if out.remember is not None:  # decided (not a repeat): its outcome joins the window
                aid = cmd.aggregate_id
                if aid not in undo:  # first change in this batch: keep what was committed
                    undo[aid] = (None if fresh else (entry.state, entry.version), [])
                undo[aid][1].append(cmd.command_id)
                landing = writer.produce_events(self.events, n, out.events, t)
                entry.state, entry.version = out.state, out.version
                self.store.window.remember(entry, aid, cmd.command_id, out.remember, result.event_ids)
                if fresh:
                    self.store.put(aid, entry)
                tally["events"] += len(out.events)
            if out.refused:
                self.log.error("aggregate.event_id_refused", command_id=cmd.command_id,
                               aggregate_id=cmd.aggregate_id, partition=n, offset=m.offset(), reason=out.refused)
            if out.error is not None:
                out.error.raw = m
                self.dead_letter(writer, m, out.error)
                tally["dead_lettered"] += 1
            tally["duplicates" if result.duplicate else "accepted" if result.accepted else "rejected"] += 1
        writer.produce_result(self.results, n, result, landing, t, trace,
                              (self.events, n) if result.duplicate else None)

    def dead_letter(self, writer: TransactionalWriter, m: Any, error: RecordError) -> None:
        raw = RawRecord.of(m)
        headers = dlq_headers(raw, error, f"aggregate.{self.agg.name}", int(time.time() * 1000))
        writer.produce(self.agg.dlq_topic, 0, raw.key, *fitted(raw.value, headers))  # an oversized value is dropped
        self.log.warning("aggregate.dead_lettered", partition=raw.partition, offset=raw.offset,
                         reason=error.reason, error=str(error)[:200])
