"""The one verdict rule of `bench reproduce`, on plain numbers (no model)."""

import pytest

from kvdirect_app.claims import papers
from kvdirect_app.claims.verdicts import (
    DIRECTION_ONLY,
    EQUAL,
    EXACT_TOLERANCE,
    FAILS,
    HIGHER,
    HOLDS,
    LOWER,
    NOT_MEASURED,
    SIZE_TOLERANCE,
    VERDICTS,
    judge,
    rule_text,
    stated,
    worst,
)

pytestmark = pytest.mark.check  # the inner loop (`make check`)


def test_higher_is_better_holds_within_the_tolerance_and_keeps_its_direction_below():
    assert judge(16.3, 16.3, HIGHER, SIZE_TOLERANCE, 1.0) == HOLDS
    assert judge(16.3, 16.3 * (1 - SIZE_TOLERANCE), HIGHER, SIZE_TOLERANCE, 1.0) == HOLDS
    assert judge(16.3, 16.3 * (1 - SIZE_TOLERANCE) * 0.99, HIGHER, SIZE_TOLERANCE, 1.0) == DIRECTION_ONLY
    assert judge(16.3, 1.2, HIGHER, SIZE_TOLERANCE, 1.0) == DIRECTION_ONLY
    assert judge(16.3, 1.05, HIGHER, SIZE_TOLERANCE, 1.0) == FAILS  # a gain within the tolerance is no gain
    assert judge(16.3, 1.0, HIGHER, SIZE_TOLERANCE, 1.0) == FAILS  # no gain is no claim
    assert judge((0.05, 0.28), 0.99, LOWER, SIZE_TOLERANCE, 1.0) == FAILS  # baselines that lose 1% lose nothing
    assert judge((0.05, 0.28), 0.85, LOWER, SIZE_TOLERANCE, 1.0) == DIRECTION_ONLY
    assert judge(16.3, 0.5, HIGHER, SIZE_TOLERANCE, 1.0) == FAILS
    assert judge(5.0, 500.0, HIGHER, SIZE_TOLERANCE, 1.0) == HOLDS


def test_a_range_stands_by_its_weak_end():
    paper = (5.78, 54.0)
    assert judge(paper, (6.0, 11520.0), HIGHER, SIZE_TOLERANCE, 1.0) == HOLDS
    assert judge(paper, (1.43, 11520.0), HIGHER, SIZE_TOLERANCE, 1.0) == DIRECTION_ONLY
    assert judge(paper, (0.69, 11520.0), HIGHER, SIZE_TOLERANCE, 1.0) == FAILS
    baselines = (0.05, 0.28)  # lower is better: the largest baseline counts, against the paper's 28%
    assert judge(baselines, (0.06, 0.30), LOWER, SIZE_TOLERANCE, 1.0) == HOLDS  # within 10% of 0.28
    assert judge(baselines, (0.06, 0.32), LOWER, SIZE_TOLERANCE, 1.0) == DIRECTION_ONLY
    assert judge(baselines, (0.06, 0.85), LOWER, SIZE_TOLERANCE, 1.0) == DIRECTION_ONLY
    assert judge(baselines, (0.06, 0.99), LOWER, SIZE_TOLERANCE, 1.0) == FAILS  # one of them loses nothing
    assert judge(baselines, (0.06, 1.0), LOWER, SIZE_TOLERANCE, 1.0) == FAILS


def test_equality_is_exact_for_bits_and_rounded_for_bytes():
    assert judge(1.0, 1.0, EQUAL, EXACT_TOLERANCE) == HOLDS
    assert judge(1.0, 0.999, EQUAL, EXACT_TOLERANCE) == FAILS
    assert judge(1.0, (0.98, 1.0), EQUAL, EXACT_TOLERANCE) == FAILS
    assert judge(5, 5120 / 1024, EQUAL, SIZE_TOLERANCE) == HOLDS
    assert judge(5, 5.4, EQUAL, SIZE_TOLERANCE) == HOLDS
    assert judge(5, 10, EQUAL, SIZE_TOLERANCE) == FAILS
    assert judge(5, 2.5, EQUAL, SIZE_TOLERANCE) == FAILS  # equal has no direction: smaller is not better


def test_not_measured_and_the_worst_part():
    assert judge(5.0, None, HIGHER, SIZE_TOLERANCE, 1.0) == NOT_MEASURED
    assert worst([HOLDS, DIRECTION_ONLY]) == DIRECTION_ONLY
    assert worst([HOLDS, NOT_MEASURED]) == NOT_MEASURED
    assert worst([NOT_MEASURED, FAILS, HOLDS]) == FAILS
    assert worst([HOLDS, HOLDS]) == HOLDS
    with pytest.raises(ValueError, match="direction"):
        judge(1.0, 1.0, "bigger", SIZE_TOLERANCE)


def test_every_paper_figure_is_data_the_rule_can_read():
    assert set(VERDICTS) == {HOLDS, DIRECTION_ONLY, FAILS, NOT_MEASURED}
    for name, claim in papers.CLAIMS.items():
        assert (
            claim.figures
            and claim.quote
            and claim.paper in ("KV-Direct", "AnchorKV", "KV-Direct, AnchorKV", papers.BEYOND)
        )
        for f in claim.figures:
            assert f.direction in (HIGHER, LOWER, EQUAL) and f.tolerance in (SIZE_TOLERANCE, EXACT_TOLERANCE)
            assert f.measures and f.label and f.model
            if f.direction != EQUAL:
                assert f.neutral is not None, (name, f.key)
            assert judge(f.value, f.value, f.direction, f.tolerance, f.neutral) == HOLDS  # the paper meets itself
    text = rule_text()
    assert f"{SIZE_TOLERANCE:.0%}" in text and all(v in text for v in VERDICTS)


def test_a_verdict_in_a_sentence_keeps_its_words():
    """ "Claim 7b is not measured: ..." and "Claim 3 holds in direction, not in size: ...": the sentence carries the
    verdict's own words, so the card, the table and the sentence read alike.  Mutation that fails it: `stated`
    rewording a verdict (FAILS as "fails", or NOT_MEASURED without its "is")."""
    assert [stated(v) for v in VERDICTS] == [HOLDS, DIRECTION_ONLY, FAILS, "is not measured"]
    assert all(stated(v).endswith(v) for v in VERDICTS)
    with pytest.raises(ValueError, match="verdict 'no effect'; allowed: holds, holds in direction"):
        stated("no effect")
