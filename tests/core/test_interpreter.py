"""kafold.interpreter: the switch interval and the GC's young threshold only ever move towards batch work, and
start-up's objects are frozen out of the collector."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest

from kafold import interpreter


@pytest.fixture
def interpreter_restored() -> Iterator[None]:
    """The process's settings as they were, after the test (gc.freeze undone: the frozen objects go back to the
    oldest generation)."""
    threshold, switch = gc.get_threshold(), sys.getswitchinterval()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(switch)
        gc.unfreeze()


@pytest.mark.usefixtures("interpreter_restored")
def test_python_defaults_are_moved_to_the_batch_settings_and_frozen() -> None:
    gc.set_threshold(700, 10, 10)
    sys.setswitchinterval(0.005)
    gc.unfreeze()
    interpreter.set_up()
    assert gc.get_threshold() == (interpreter.GC_GEN0_THRESHOLD, 10, 10)
    assert sys.getswitchinterval() == pytest.approx(interpreter.SWITCH_INTERVAL_S)
    assert gc.get_freeze_count() > 0


@pytest.mark.usefixtures("interpreter_restored")
def test_settings_already_further_are_left_alone() -> None:
    gc.set_threshold(200_000, 5, 5)
    sys.setswitchinterval(0.0001)
    interpreter.tune_interpreter()
    assert gc.get_threshold() == (200_000, 5, 5)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
