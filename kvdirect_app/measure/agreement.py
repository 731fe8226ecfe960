"""Agreement of a strategy's free run with the reference's: the fraction of the reference's tokens it generated
identically and its first divergence (`token_match`), the figure `bench run` and the run's summary report.
Teacher-forced agreement and KL are measured by the engine (`engine/teacher_forcing.py`)."""

from __future__ import annotations


def token_match(reference: list[list[int]], tokens: list[list[int]]) -> tuple[float, int | None]:
    """Fraction of the reference's positions (over all turns) where `tokens` agree, and the first divergence.

    A position the strategy did not reach, or reached past the reference's end,
    is a mismatch; the divergence index counts over the concatenated turns.
    """
    matched, total, offset, first = 0, 0, 0, None
    for ref, got in zip(reference, tokens):
        for i, t in enumerate(ref):
            same = i < len(got) and got[i] == t
            matched += same
            if not same and first is None:
                first = offset + i
        if first is None and len(got) > len(ref):
            first = offset + len(ref)
        total += len(ref)
        offset += len(ref)
    if total == 0:
        return 1.0, first
    return matched / total, first
