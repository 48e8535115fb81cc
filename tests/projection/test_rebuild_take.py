"""The rebuild's per-record loop (`Rebuild._take`): what a batch takes below the targets, what it reads ahead."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kafold.connectors.api import TopicPartition
from kafold.connectors.projection.rebuild import Rebuild

A, B, C = TopicPartition("t", 0), TopicPartition("t", 1), TopicPartition("t", 2)


class _Msg:
    def __init__(self, tp: TopicPartition, offset: int) -> None:
        self.tp, self.off = tp, offset

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self.tp.topic

    def partition(self) -> int:
        return self.tp.partition

    def offset(self) -> int:
        return self.off


def _take(msgs: list[_Msg], targets: dict[TopicPartition, int], positions: dict[TopicPartition, int],
          phase: str = "copying", max_tail: int = 2, assigned: set[TopicPartition] | None = None,
          overrun: set[TopicPartition] | None = None) -> tuple[list[Any], dict[TopicPartition, int],
                                                               set[TopicPartition], dict[TopicPartition, list[int]]]:
    rebuild = SimpleNamespace(assigned=assigned if assigned is not None else set(targets), positions=positions,
                              ahead={}, phase=phase, max_tail=max_tail,
                              record_of=lambda m, dead, topic, part, off: (part, off))
    records: list[Any] = []
    advance: dict[TopicPartition, int] = {}
    overrun = overrun if overrun is not None else set()
    Rebuild._take(rebuild, msgs, targets, records, [], advance, overrun)  # type: ignore[arg-type]
    return records, advance, overrun, {tp: [m.off for m in kept] for tp, kept in rebuild.ahead.items()}


def test_records_below_their_targets_are_taken_in_order_across_interleaved_runs() -> None:
    msgs = [_Msg(A, 3), _Msg(A, 4), _Msg(B, 0), _Msg(A, 5), _Msg(B, 1), _Msg(B, 2)]
    records, advance, overrun, ahead = _take(msgs, {A: 10, B: 10}, {A: 3, B: 0})
    assert records == [(0, 3), (0, 4), (1, 0), (0, 5), (1, 1), (1, 2)]
    assert advance == {A: 6, B: 3} and not overrun and not ahead


def test_records_already_covered_or_of_partitions_not_taken_are_dropped() -> None:
    msgs = [_Msg(A, 1), _Msg(A, 2), _Msg(A, 2), _Msg(C, 0), _Msg(B, 7), _Msg(A, 3)]
    records, advance, _, _ = _take(msgs, {A: 10, B: 10}, {A: 2, B: 7}, assigned={A, B})
    assert records == [(0, 2), (1, 7), (0, 3)]  # A@1 below the checkpoint, A@2 twice, C not assigned
    assert advance == {A: 4, B: 8}
    records, advance, _, _ = _take([_Msg(B, 8)], {B: 10}, {B: 7}, overrun={B})
    assert records == [] and advance == {}


def test_while_copying_a_record_at_its_target_ends_the_partitions_batch() -> None:
    msgs = [_Msg(A, 8), _Msg(A, 9), _Msg(A, 10), _Msg(A, 11), _Msg(B, 0)]
    records, advance, overrun, ahead = _take(msgs, {A: 10, B: 5}, {A: 8, B: 0})
    assert records == [(0, 8), (0, 9), (1, 0)]
    assert advance == {A: 10, B: 1} and overrun == {A} and ahead == {A: []}


def test_in_the_tail_phase_records_past_the_target_are_read_ahead_up_to_max_tail() -> None:
    msgs = [_Msg(A, 9), _Msg(A, 10), _Msg(A, 11), _Msg(B, 4), _Msg(A, 12), _Msg(A, 13)]
    records, advance, overrun, ahead = _take(msgs, {A: 10, B: 4}, {A: 9, B: 4}, phase="catching-up", max_tail=2)
    assert records == [(0, 9)]
    assert ahead == {A: [10, 11], B: [4]} and overrun == {A}  # A@12 past max_tail: A is fetched again later
    assert advance == {A: 10, B: 4}
