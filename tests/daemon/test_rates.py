"""The daemon's records/s and commands/s over the last minute (daemon/rates.py). Pure."""

from __future__ import annotations

from kafold.daemon.rates import SAMPLE_S, WINDOW_S, Rates


def test_no_rate_until_two_samples_then_the_rise_over_the_window() -> None:
    rates = Rates()
    assert rates.due(0.0)
    rates.sample({"connector:a": 100}, 0.0)
    assert rates.per_second() == {} and not rates.due(SAMPLE_S / 2)
    rates.sample({"connector:a": 150, "aggregate:b": 20}, 10.0)
    assert rates.per_second() == {"connector:a": 5.0, "aggregate:b": 2.0}


def test_old_samples_leave_the_window() -> None:
    rates = Rates()
    for t in range(0, 200, 5):
        rates.sample({"connector:a": t * 10 if t < 100 else 1000}, float(t))
    # the last minute holds no rise: the count stopped at t = 100
    assert rates.per_second() == {"connector:a": 0.0}
    assert rates.samples[-1][0] - rates.samples[0][0] <= WINDOW_S + SAMPLE_S


def test_a_count_that_fell_counts_from_zero() -> None:
    rates = Rates()
    rates.sample({"connector:a": 500}, 0.0)
    rates.sample({"connector:a": 30}, 10.0)  # its task restarted: the runner counts again from zero
    assert rates.per_second() == {"connector:a": 3.0}
