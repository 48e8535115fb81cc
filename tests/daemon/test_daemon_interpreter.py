"""The daemon's process gets the batch settings (kafold.interpreter) at start whatever it hosts: a daemon with no
projection task in it (here a log connector; in the latency bench, the webhook connector beside projections in
processes of their own) no longer runs the cyclic GC at Python's defaults."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

from kafold import interpreter
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.daemon.daemon_support import daemon_in_process, write_config
from tests.support import create_topic, wait_for
from tests.support.interpreter import interpreter_at


def test_a_daemon_without_a_projection_sets_up_its_process_for_batch_work(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, partitions=1)
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port())
    with interpreter_at(700, 0.005), daemon_in_process(path) as d:
        wait_for(lambda: d.runner.state == "RUNNING", "the log connector's task running")
        assert gc.get_threshold()[0] == interpreter.GC_GEN0_THRESHOLD
        assert sys.getswitchinterval() == pytest.approx(interpreter.SWITCH_INTERVAL_S)
        assert gc.get_freeze_count() > 0
