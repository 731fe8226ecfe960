"""The statistics behind a verdict on scores: a paired sign test and a bootstrap interval (no torch: the page uses it).

A method "changes task scores" only when a paired one-sided test says so at a stated level (`LEVEL`): per
sample, its score against the full cache's on the same sample; the exact sign test counts the samples where it
scored lower and where it scored higher (ties tell nothing about a direction and are left out), and asks how
likely that many lower ones would be if lower and higher were equally likely.  A sample count too small to reach
the level whatever the scores (`reachable`) is "not enough samples", never a verdict either way.
"""

from __future__ import annotations

import math

import numpy as np

LEVEL = 0.05  # the one-sided level of every "changes scores" verdict
CHANGES, NO_CHANGE, TOO_FEW = "changes", "no change beyond noise", "not enough samples"
BOOTSTRAP_RESAMPLES = 2000


def sign_test(lower: int, higher: int) -> float:
    """One-sided exact sign test: P(X >= lower) for X ~ Binomial(lower + higher, 1/2), the chance of at least
    `lower` lower samples among the untied ones if the method did not tend to score lower.  1.0 with no untied
    sample."""
    if lower < 0 or higher < 0:
        raise ValueError(f"counts must be >= 0, got {lower}, {higher}")
    n = lower + higher
    return sum(math.comb(n, k) for k in range(lower, n + 1)) / 2**n


def reachable(samples: int, level: float = LEVEL) -> bool:
    """Whether `samples` paired samples can reach `level` at all: every one lower gives p = 0.5 ** samples."""
    return samples > 0 and 0.5**samples < level


def changes(deltas: list[float], level: float = LEVEL) -> dict:
    """The verdict on per-sample score differences (the method's minus the full cache's): `verdict` (CHANGES,
    NO_CHANGE or TOO_FEW), `p`, the sample count and how many were lower and higher."""
    lower, higher = sum(d < 0 for d in deltas), sum(d > 0 for d in deltas)
    p = sign_test(lower, higher)
    verdict = TOO_FEW if not reachable(len(deltas), level) else CHANGES if p < level else NO_CHANGE
    return {"verdict": verdict, "p": p, "level": level, "samples": len(deltas), "lower": lower, "higher": higher}


def bootstrap_interval(
    values: list[float], level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the mean of `values` (resampled with replacement, a fixed seed so that
    the same values give the same interval); None for no values."""
    if not values:
        return None
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)
