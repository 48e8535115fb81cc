"""ShadowWrites: how a rebuild's batches reach its shadow table while it reads the next ones (rebuild.py plans the
batches; shadow_writer.py writes them).

While copying, a batch's write runs in a thread of its own as the next batch is consumed and decoded, at most one
in flight; when the writer can fold ahead (ShadowWriter.can_fold_ahead, decided on the first batch) batches are
folded in memory and written when AHEAD_ROWS keys wait, after AHEAD_BATCHES batches or AHEAD_S after the last
write. The tail phase and the swap write batch by batch, in the caller's thread.

Note on offsets and commits: the rebuild counts a batch's offsets as applied once it is handed over here; anything
that relies on them (a save of progress, the swap, the end of the run) comes after `settle`, and a write that
failed has moved no checkpoint in PostgreSQL (the rebuild resumes from those).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kafold.connectors.api import SinkRecord, TopicPartition
from kafold.connectors.projection.fold import Prepared
from kafold.connectors.projection.held_keys import DeadLetter
from kafold.connectors.projection.shadow_writer import Rewind, ShadowWriter

# Rows of the shadow a rebuild (each copy worker) keeps between its batches: ~0.5 KB a row of a few columns.
SHADOW_CACHE_ROWS = 65536
# While copying, the shadow's rows are folded ahead in memory and written (with their checkpoints) when this many
# keys are waiting, after this many batches or this long after the last write, whichever comes first: a key's row
# is written once per write, not once per batch; a killed rebuild redoes at most that much.
AHEAD_ROWS, AHEAD_BATCHES, AHEAD_S = SHADOW_CACHE_ROWS, 50, 5.0


class ShadowWrites:
    """The writes of one rebuild (or copy worker) into its shadow through `writer`."""

    def __init__(self, writer: ShadowWriter, name: str) -> None:
        self.writer = writer
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"kafold-rebuild-{name}")
        self.inflight: Future[Any] | None = None
        self.folding: bool | None = None  # folding ahead while copying (see AHEAD_ROWS); decided on the first batch
        self.folded_at = time.monotonic()  # when the rows folded ahead were last written
        self.folded_batches = 0  # batches folded ahead since

    def folds_ahead(self) -> bool:
        """Whether copying folds ahead (asked of the writer once, on the first batch; off after a Rewind)."""
        if self.folding is None:
            self.folding = self.writer.can_fold_ahead
        return self.folding

    def hand_over(self, records: list[SinkRecord], dead: list[DeadLetter], advance: dict[TopicPartition, int],
                  prepared: Prepared | None, *, ahead: bool, background: bool) -> None:
        """One batch to the shadow (after `settle`): folded ahead (`ahead`), or written in the write thread
        (`background`, while copying) or here."""
        if ahead:
            self.inflight = self.pool.submit(self._fold_ahead, records, dead, advance, prepared)
        elif background:
            self.inflight = self.pool.submit(self.writer.write, records, dead, offsets=advance, prepared=prepared)
        else:
            self.writer.write(records, dead, offsets=advance, prepared=prepared)

    def settle(self, flush: bool = True) -> Rewind | None:
        """Wait for the write in flight, and write what was folded ahead unless `flush` is False (an error ends the
        run: it resumes from the checkpoints in PostgreSQL, which that write did not move). The Rewind when folding
        ahead gave way (nothing of it was written: folding is off from now on, the caller reads again)."""
        inflight, self.inflight = self.inflight, None
        try:
            if inflight is not None:
                inflight.result()
            if flush and self.writer.ahead_events:
                self._flush()
        except Rewind as e:
            self.folding = False
            return e
        return None

    def close(self) -> None:
        self.pool.shutdown()

    def _fold_ahead(self, records: list[SinkRecord], dead: list[DeadLetter], advance: dict[TopicPartition, int],
                    prepared: Prepared | None) -> None:
        writer = self.writer
        writer.fold_ahead(records, dead, advance, prepared)
        self.folded_batches += 1
        if (writer.ahead_rows >= AHEAD_ROWS or self.folded_batches >= AHEAD_BATCHES
                or time.monotonic() - self.folded_at >= AHEAD_S):
            self._flush()

    def _flush(self) -> None:
        self.writer.flush()
        self.folded_at, self.folded_batches = time.monotonic(), 0
