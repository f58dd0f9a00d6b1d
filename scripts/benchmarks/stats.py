"""Side-by-side arithmetic: interleaved repeats, medians, paired ratios.

Why paired: on a shared CPU the speed of the machine drifts over minutes. Sides measured
back to back within one repeat see the same drift, so the median of the per-repeat ratios
is steadier than the ratio of two medians taken minutes apart (both are reported).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the middle two for an even count)."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def ratio(a: float, b: float) -> float:
    """a / b; a zero or missing denominator is a failed measurement, not infinity."""
    if not b:
        raise ZeroDivisionError(f"ratio {a} / {b}: the denominator side measured nothing")
    return a / b


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Ratio of each repeat's A to the same repeat's B."""
    if len(a) != len(b):
        raise ValueError(f"unpaired sides: {len(a)} vs {len(b)} repeats")
    return [ratio(x, y) for x, y in zip(a, b, strict=True)]


def interleave(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Call every side once per repeat, in the given order (A, B, A, B, ...).

    Returns each side's values in repeat order, so ``paired_ratios`` can pair them.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    out: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, measure in sides.items():
            out[name].append(float(measure()))
    return out


def compare(a: Sequence[float], b: Sequence[float], higher_is_better: bool = True) -> dict:
    """A vs B: the headline (median of paired ratios) and everything it came from.

    ``best_ratio`` compares each side's best repeat (max of a rate, min of a time).
    Interference from other work on a shared machine only ever slows a side down, so the
    best repeat is the least disturbed one; where the median and the best disagree a lot,
    the machine was too busy for either to be trusted.
    """
    pairs = paired_ratios(a, b)
    best = max if higher_is_better else min
    return {
        "ratio": median(pairs),
        "best_ratio": ratio(best(a), best(b)),
        "paired_ratios": pairs,
        "ratio_of_medians": ratio(median(a), median(b)),
        "a": list(a),
        "b": list(b),
        "a_median": median(a),
        "b_median": median(b),
    }


def fmt(value: float) -> str:
    """Ratios near 1 need three decimals; large speed-ups do not."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"
