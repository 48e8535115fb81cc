"""kafold.interpreter: the switch interval and the GC's young threshold only ever move towards batch work, and
start-up's objects are frozen out of the collector."""

from __future__ import annotations

import gc
import sys

import pytest

from kafold import interpreter
from tests.support.interpreter import interpreter_at


def test_python_defaults_are_moved_to_the_batch_settings_and_frozen() -> None:
    with interpreter_at(700, 0.005):
        interpreter.set_up()
        assert gc.get_threshold()[0] == interpreter.GC_GEN0_THRESHOLD
        assert sys.getswitchinterval() == pytest.approx(interpreter.SWITCH_INTERVAL_S)
        assert gc.get_freeze_count() > 0


def test_settings_already_further_are_left_alone() -> None:
    with interpreter_at(200_000, 0.0001):
        interpreter.tune_interpreter()
        assert gc.get_threshold()[0] == 200_000
        assert sys.getswitchinterval() == pytest.approx(0.0001)
