"""SnapshotScheduler triggers (interval, N new events) and its lock; the Java check's error message."""

from __future__ import annotations

import threading

import pytest

from kafold.snapshot.scheduler import SnapshotScheduler
from kafold.spark_jobs import session


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interval_trigger_counts_from_the_first_check() -> None:
    clock = Clock()
    sched = SnapshotScheduler(lambda: 0, interval_s=60, clock=clock)
    assert sched.due() is None
    clock.now = 59
    assert sched.due() is None
    clock.now = 60
    assert sched.due() == "interval"
    assert sched.run_once("interval") and sched.runs == 1
    assert sched.due() is None


def test_new_events_trigger_after_n_events_since_the_last_run() -> None:
    clock, events = Clock(), [100]
    sched = SnapshotScheduler(lambda: 0, interval_s=3600, every_n_events=50, new_events=lambda: events[0],
                              clock=clock)
    assert sched.due() is None  # baseline taken: 100
    events[0] = 149
    assert sched.due() is None
    events[0] = 150
    assert sched.due() == "new-events"
    sched.run_once("new-events")
    assert sched.events_at_last_run == 150 and sched.due() is None


def test_never_two_runs_at_once() -> None:
    started, release = threading.Event(), threading.Event()

    def job() -> int:
        started.set()
        release.wait(10)
        return 0

    sched = SnapshotScheduler(job, interval_s=3600)
    first = threading.Thread(target=sched.run_once)
    first.start()
    assert started.wait(10)
    assert sched.trigger("manual") is False  # skipped: a run holds the lock
    release.set()
    first.join(10)
    assert sched.runs == 1
    assert sched.trigger("manual") is True and sched.runs == 2


def test_a_failing_job_is_counted_and_the_scheduler_keeps_going() -> None:
    def job() -> int:
        raise RuntimeError("spark died")

    sched = SnapshotScheduler(job, interval_s=3600)
    assert sched.run_once() and sched.failures == 1
    assert sched.run_once() and sched.failures == 2


def test_every_n_events_needs_a_counter() -> None:
    with pytest.raises(ValueError, match="new_events"):
        SnapshotScheduler(lambda: 0, interval_s=1, every_n_events=10)


def test_missing_java_says_exactly_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "_candidates", lambda: [])
    with pytest.raises(session.JavaNotFoundError, match="apt-get install openjdk-17-jre-headless"):
        session.find_java_home()
