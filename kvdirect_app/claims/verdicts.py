"""The one verdict rule: our figure against the paper's, on the same metric, in the claim's direction.

Every claim of the report is judged by `judge`; a claim made of several
figures takes the worst of its parts (`worst`).  Four outcomes, no others:

* **holds**: our figure meets the paper's in the claim's direction and size,
  within the tolerance;
* **holds in direction, not in size**: our figure is on the claimed side of
  the neutral value (the value at which the claimed effect vanishes: 1x for
  a speed-up or a capacity ratio), by more than the tolerance, but short of
  the paper's;
* **does not hold here**: it is not (or, for a claim of equality, it is not
  within the tolerance of the paper's figure);
* **not measured**: there is no figure of ours.

A figure is a number or a range (low, high).  For a range only its weak end
counts: the low end where higher is better ("5.78-54x by spacing" promises
at least 5.78x at every spacing), the high end where lower is better
("baselines fall to 5-28%" puts every baseline at 28% or below).
"""

from __future__ import annotations

HOLDS = "holds"
DIRECTION_ONLY = "holds in direction, not in size"
FAILS = "does not hold here"
NOT_MEASURED = "not measured"
VERDICTS = (HOLDS, DIRECTION_ONLY, FAILS, NOT_MEASURED)
_WORST_FIRST = (FAILS, NOT_MEASURED, DIRECTION_ONLY, HOLDS)  # a measured failure outranks a missing part

HIGHER, LOWER, EQUAL = "higher is better", "lower is better", "equal"
DIRECTIONS = (HIGHER, LOWER, EQUAL)

# The papers quote two or three digits and our timings move by several per cent between runs on a shared
# CPU: a figure within 10% of the paper's meets it.
SIZE_TOLERANCE = 0.10
# Bit-exactness and token identity are all or nothing.
EXACT_TOLERANCE = 0.0


def span(value) -> tuple[float, float]:
    """(low, high) of a number or a two-item range."""
    if isinstance(value, (list, tuple)):
        low, high = value
        return float(low), float(high)
    return float(value), float(value)


def weak_end(value, direction: str) -> float:
    """The end of a figure that a claim in `direction` stands or falls by."""
    low, high = span(value)
    return high if direction == LOWER else low


def judge(paper, ours, direction: str, tolerance: float, neutral: float | None = None) -> str:
    """The verdict on one figure of a claim.

    Parameters
    ----------
    paper, ours : float or (float, float) or None
        The paper's figure and ours on the same metric; `ours` None means not measured.
    direction : {"higher is better", "lower is better", "equal"}
    tolerance : float
        Relative to the paper's figure: higher is better holds at ``ours >= paper * (1 - tolerance)``,
        lower at ``ours <= paper * (1 + tolerance)``, equal at ``|ours - paper| <= tolerance * |paper|``
        (every end of a range of ours).
    neutral : float, optional
        Where the claimed effect vanishes (needed for higher and lower).

    Returns
    -------
    str
        One of `VERDICTS`.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r}; allowed: {', '.join(DIRECTIONS)}")
    if ours is None:
        return NOT_MEASURED
    if direction == EQUAL:
        target = weak_end(paper, direction)
        return HOLDS if all(abs(x - target) <= tolerance * abs(target) for x in span(ours)) else FAILS
    mine, theirs = weak_end(ours, direction), weak_end(paper, direction)
    # An effect within the tolerance of the neutral value is no effect: a baseline that keeps 99% of the tokens,
    # a 1.05x speed-up, do not hold even in direction.
    if direction == HIGHER:
        size, side = mine >= theirs * (1 - tolerance), mine > neutral * (1 + tolerance)
    else:
        size, side = mine <= theirs * (1 + tolerance), mine < neutral * (1 - tolerance)
    return HOLDS if size else (DIRECTION_ONLY if side else FAILS)


def stated(verdict: str) -> str:
    """The verdict as the predicate of a sentence about a claim ("Claim 2 does not hold here: ..."), its words
    unchanged, so a card, the table and a sentence show the same string."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict {verdict!r}; allowed: {', '.join(VERDICTS)}")
    return f"is {verdict}" if verdict == NOT_MEASURED else verdict


def worst(verdicts) -> str:
    """A claim of several figures holds as far as its weakest part."""
    return min(verdicts, key=_WORST_FIRST.index)


def rule_text() -> str:
    """The rule in one paragraph, with the tolerances, for the report."""
    return (
        f"Verdict rule, the same for every claim: our figure against the paper's on the same metric. "
        f"Where higher (lower) is better, the weak end of each range counts (the least, or the largest, value): "
        f"**{HOLDS}** when ours is at least as good as the paper's, within {SIZE_TOLERANCE:.0%} of the paper's "
        f"figure; **{DIRECTION_ONLY}** when ours is on the claimed side of the neutral value (1x: no gain; a "
        f"token match of 1: no loss) by more than {SIZE_TOLERANCE:.0%} of it, but short of the paper's; **{FAILS}** "
        "otherwise. A claim of equality "
        f"holds within {SIZE_TOLERANCE:.0%} for figures the paper rounds (bytes), within {EXACT_TOLERANCE:g} "
        f"for bit-exactness and token identity, and otherwise does not hold here. **{NOT_MEASURED}**: no figure "
        f'of ours. A claim of several figures takes its worst part. "Computed from the config" is arithmetic '
        f"on a model's config, not a measurement."
    )
