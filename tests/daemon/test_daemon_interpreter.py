"""The daemon's process gets the batch settings (kafold.interpreter) at start whatever it hosts: a daemon with no
projection task in it (here a log connector; in the latency bench, the webhook connector beside projections in
processes of their own) no longer runs the cyclic GC at Python's defaults."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kafold import interpreter
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.daemon.daemon_support import daemon_in_process, write_config
from tests.support import create_topic, wait_for


@pytest.fixture
def python_defaults() -> Iterator[None]:
    """The test process at Python's defaults (an earlier test's projection task may have tuned it), restored after."""
    threshold, switch = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(700, *threshold[1:])
    sys.setswitchinterval(0.005)
    gc.unfreeze()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(switch)
        gc.unfreeze()


@pytest.mark.usefixtures("python_defaults")
def test_a_daemon_without_a_projection_sets_up_its_process_for_batch_work(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, partitions=1)
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port())
    with daemon_in_process(path) as d:
        wait_for(lambda: d.runner.state == "RUNNING", "the log connector's task running")
        assert gc.get_threshold()[0] == interpreter.GC_GEN0_THRESHOLD
        assert sys.getswitchinterval() == pytest.approx(interpreter.SWITCH_INTERVAL_S)
        assert gc.get_freeze_count() > 0
