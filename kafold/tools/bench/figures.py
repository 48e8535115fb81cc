"""The benches' arithmetic on measured figures: a figure that cannot be computed is absent (None), never 0."""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def per(amount: float | None, over: float | None, scale: float = 1.0) -> float | None:
    """`amount / over * scale`, or None when either is unknown or `over` is not positive: a run too small to time
    (its first measured mark already covering the whole of it: nothing counted over no time) has no rate."""
    if amount is None or over is None or over <= 0:
        return None
    return amount / over * scale


def rounded(value: float | None, digits: int | None = None) -> float | int | None:
    """`round(value, digits)`, None kept absent."""
    if value is None:
        return None
    return round(value) if digits is None else round(value, digits)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values present (None: a round without the figure), None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_ratio(values: Iterable[float | None], baseline: Iterable[float | None],
                 digits: int = 3) -> float | None:
    """median(values) / median(baseline), rounded; None when either side has no figure or the baseline is 0."""
    return rounded(per(median(values), median(baseline)), digits)
