"""The figures the bench derives from its samples: quantiles, Jain's index, ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["jain", "quantile", "ratio"]


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return math.nan
    return total * total / (len(values) * squares)


def ratio(num: float, den: float) -> float:
    return num / den if den else math.nan
