"""The test process's interpreter settings (kafold.interpreter's) set for a block and restored after it."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interpreter_at(gen0_threshold: int, switch_interval_s: float) -> Iterator[None]:
    """The cyclic GC's gen-0 threshold and the switch interval set, nothing frozen, for the block (an earlier test's
    projection task may have tuned this process); restored after (gc.freeze undone: the frozen objects go back to
    the oldest generation)."""
    threshold, switch = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(gen0_threshold, *threshold[1:])
    sys.setswitchinterval(switch_interval_s)
    gc.unfreeze()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(switch)
        gc.unfreeze()
