"""Master-key rotation: every subject's data key re-wrapped under the current master key, in resumable batches.

The data keys themselves do not change (sealed values name them by key id and stay readable); only their wrapping
does. Each wrapped key records which master key wrapped it (kafold.protect.WRAP_V2), so a run walks the store in
subject order and skips keys already under the current master key: a run interrupted anywhere (each batch is
committed on its own, compare-and-set against the wrapped key it read) is resumed by running it again. Until a
run reports nothing left, the previous master key is still needed (`[privacy] previous_master_key`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kafold import logs
from kafold.protect import Cipher, KeyStore

log = logs.get(__name__)
BATCH = 500


@dataclass(frozen=True)
class RotationProgress:
    """Where a rotation stands: keys seen so far, re-wrapped by this run, already current, of `total`."""

    seen: int
    rewrapped: int
    current: int
    total: int


def pending(store: KeyStore, cipher: Cipher, batch: int = BATCH) -> int:
    """How many keys are not wrapped under the current master key (a walk of the store)."""
    left, after = 0, ""
    while rows := store.scan(after, batch):
        left += sum(1 for _, _, wrapped in rows if not cipher.current(wrapped))
        after = rows[-1][0]
    return left


def rotate(store: KeyStore, cipher: Cipher, batch: int = BATCH,
           progress: Callable[[RotationProgress], None] | None = None) -> RotationProgress:
    """Re-wrap every key not under `cipher`'s current master key; the final RotationProgress. A key that changed between
    its read and its rewrap (forgotten meanwhile, or rewrapped by another run) is left as it is then."""
    started = time.monotonic()
    total = store.count()
    seen = rewrapped = current = 0
    after = ""
    while rows := store.scan(after, batch):
        after = rows[-1][0]
        todo = []
        for subject, key_id, wrapped in rows:
            if cipher.current(wrapped):
                current += 1
                continue
            key = cipher.unwrap(subject, key_id, wrapped)  # DecryptError names a master key not configured
            todo.append((subject, key_id, wrapped, cipher.wrap(subject, key_id, key)))
        rewrapped += store.rewrap(todo) if todo else 0
        seen += len(rows)
        done = RotationProgress(seen, rewrapped, current, max(total, seen))
        if progress is not None:
            progress(done)
    final = RotationProgress(seen, rewrapped, current, seen)
    log.info("keys.rotated", master_key_id=cipher.master_id.hex(), keys=seen, rewrapped=rewrapped,
             already_current=current, seconds=round(time.monotonic() - started, 3))
    return final
