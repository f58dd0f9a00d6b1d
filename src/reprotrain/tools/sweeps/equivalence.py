"""The statistics behind a statistical verdict: t intervals, Welch differences, TOST.

Closes: "the bits differ, so does the result still hold?". CONSISTENT when the (1 - 2 alpha)
interval of the difference of the means (paired when both sides hold the same seeds, else
Welch; TOST, Schuirmann 1987) lies inside (-m, m); INCONSISTENT when wholly beyond; else
INCONCLUSIVE. Quantiles are scipy's Student t. docs/when-bits-differ.md.
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


def welch(reference: list[float], candidate: list[float], level: float) -> Difference:
    """Difference of means with a Welch-Satterthwaite t interval at ``level``."""
    na, nb = len(reference), len(candidate)
    ma, mb = statistics.fmean(reference), statistics.fmean(candidate)
    d = mb - ma
    if na < 2 or nb < 2:
        return Difference(ma, mb, na, nb, d, None, level)
    va, vb = statistics.variance(reference) / na, statistics.variance(candidate) / nb
    se = math.sqrt(va + vb)
    if se == 0:  # both samples without spread (e.g. a bitwise re-run): the interval is a point
        return Difference(ma, mb, na, nb, d, (d, d), level)
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    half = t_quantile(0.5 + level / 2, df) * se
    return Difference(ma, mb, na, nb, d, (d - half, d + half), level)


def paired(reference: list[float], candidate: list[float], level: float) -> Difference:
    """Mean of the per-seed differences ``candidate[i] - reference[i]`` with a t interval."""
    n = len(reference)
    ma, mb = statistics.fmean(reference), statistics.fmean(candidate)
    diffs = [b - a for a, b in zip(reference, candidate, strict=True)]
    d = statistics.fmean(diffs)
    if n < 2:
        return Difference(ma, mb, n, n, d, None, level, True)
    sd = statistics.stdev(diffs)
    if sd == 0:  # every seed moved by the same amount (0 for a bitwise re-run)
        return Difference(ma, mb, n, n, d, (d, d), level, True)
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return Difference(ma, mb, n, n, d, (d - half, d + half), level, True)


@dataclass
class Equivalence:
    verdict: str
    margin: float
    difference: Difference
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "difference": asdict(self.difference)}


def tost(
    reference: list[float],
    candidate: list[float],
    margin: float,
    alpha: float = ALPHA,
    pair: bool = False,
) -> Equivalence:
    """The TOST verdict at ``alpha`` against ``margin``; ``pair``: the sides share seeds."""
    diff = (paired if pair else welch)(reference, candidate, 1 - 2 * alpha)
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
