"""The benchmarks find the bank example from where they are installed (a move of kafold/tools/bench broke it once)."""

from kafold.tools.bench import aggregates, history, snapshots


def test_every_bench_finds_the_bank_example() -> None:
    for mod in (aggregates, history, snapshots):
        assert (mod.BANK / "kafold.toml").is_file(), f"{mod.__name__}.BANK = {mod.BANK}"
