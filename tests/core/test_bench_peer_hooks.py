"""The names the peer harness wraps in kafold's aggregates bench exist, and the bench's phase goes through them."""

from __future__ import annotations

import importlib

HOOKS = ("_setup", "_in_thread", "_throughput", "_throughput_instances")


def test_the_peer_harness_finds_the_names_it_wraps() -> None:
    # ../shared/peers/kstreams_aggregate/run_kafold.py imports the old path and patches these four names
    bench = importlib.import_module("kafold.bench.aggregates")
    for name in HOOKS:
        assert callable(getattr(bench, name)), name
    assert "_throughput" in bench.run.__code__.co_names
    assert {"_setup", "_in_thread", "_throughput_instances"} <= set(bench.aggregate_throughput.__code__.co_names)
