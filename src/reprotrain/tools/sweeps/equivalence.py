"""The statistics behind a statistical verdict: t intervals, Welch differences, TOST.

Closes: "the bits differ, so does the result still hold?" (TOST, Schuirmann 1987, on scipy's
Student t; the verdicts: docs/when-bits-differ.md).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

CONSISTENT, INCONSISTENT, INCONCLUSIVE = "CONSISTENT", "INCONSISTENT", "INCONCLUSIVE"
ALPHA = 0.05
MARGIN_FLOOR_FRACTION = 0.005


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The t confidence interval of the mean; None below two values."""
    n = len(values)
    if n < 2:
        return None
    mean, std = statistics.fmean(values), statistics.stdev(values)
    half = t_quantile(0.5 + level / 2, n - 1) * std / math.sqrt(n)
    return mean - half, mean + half


@dataclass
class Difference:
    """``candidate - reference``: the means, the difference and its Welch interval."""

    mean_reference: float
    mean_candidate: float
    n_reference: int
    n_candidate: int
    diff: float
    ci: tuple[float, float] | None  # None: fewer than two values on a side
    level: float
    paired: bool = False


def _interval(d: float, se: float, df: float, level: float) -> tuple[float, float]:
    """``d`` ± the t quantile times ``se``; a point when ``se`` is 0 (e.g. a bitwise re-run)."""
    half = t_quantile(0.5 + level / 2, df) * se if se else 0.0
    return d - half, d + half


def welch(reference: list[float], candidate: list[float], level: float) -> Difference:
    """Difference of means with a Welch-Satterthwaite t interval at ``level``."""
    na, nb = len(reference), len(candidate)
    ma, mb = statistics.fmean(reference), statistics.fmean(candidate)
    if na < 2 or nb < 2:
        return Difference(ma, mb, na, nb, mb - ma, None, level)
    va, vb = statistics.variance(reference) / na, statistics.variance(candidate) / nb
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1)) if va + vb else 1.0
    ci = _interval(mb - ma, math.sqrt(va + vb), df, level)
    return Difference(ma, mb, na, nb, mb - ma, ci, level)


def paired(reference: list[float], candidate: list[float], level: float) -> Difference:
    """Mean of the per-seed differences ``candidate[i] - reference[i]`` with a t interval."""
    n = len(reference)
    ma, mb = statistics.fmean(reference), statistics.fmean(candidate)
    diffs = [b - a for a, b in zip(reference, candidate, strict=True)]
    d = statistics.fmean(diffs)
    ci = _interval(d, statistics.stdev(diffs) / math.sqrt(n), n - 1, level) if n > 1 else None
    return Difference(ma, mb, n, n, d, ci, level, True)


@dataclass
class Equivalence:
    verdict: str
    margin: float
    difference: Difference
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "difference": asdict(self.difference)}


def tost(
    reference: list[float], candidate: list[float], margin: float, pair: bool = False
) -> Equivalence:
    """CONSISTENT when the (1 - 2 ``ALPHA``) interval of the difference (paired when ``pair``: the
    sides share seeds; else Welch) lies inside ±``margin``, INCONSISTENT when wholly beyond."""
    diff = (paired if pair else welch)(reference, candidate, 1 - 2 * ALPHA)
    if diff.ci is None:
        n = min(diff.n_reference, diff.n_candidate)
        return Equivalence(INCONCLUSIVE, margin, diff, f"too few seeds (n={n}; need 2 or more)")
    lo, hi = diff.ci
    if -margin < lo and hi < margin:
        return Equivalence(CONSISTENT, margin, diff, "the interval lies inside the margin")
    if lo > margin or hi < -margin:
        return Equivalence(INCONSISTENT, margin, diff, "the interval lies beyond the margin")
    return Equivalence(INCONCLUSIVE, margin, diff, "the interval overlaps the margin's edge")


def default_margin(reference: list[float]) -> tuple[float, str]:
    """(margin, how it was derived): the reference's 95% CI half-width, floored."""
    mean = statistics.fmean(reference) if reference else 0.0
    floor = max(MARGIN_FLOOR_FRACTION * abs(mean), 1e-12)
    ci = mean_ci(reference)
    if ci is None:
        return floor, f"{MARGIN_FLOOR_FRACTION:.1%} of the reference mean (one seed: no spread)"
    half = (ci[1] - ci[0]) / 2
    if half >= floor:
        return half, f"the reference's 95% CI half-width (n={len(reference)})"
    return floor, f"floor: {MARGIN_FLOOR_FRACTION:.1%} of the reference mean (CI narrower)"
