"""Token match and timing helpers (docs/measurement.md, "Every part of a step is timed where it runs"); agreement and
KL are `teacher.agree`'s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def clock(device: torch.device) -> float:
    """perf_counter after the accelerator has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


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


# The ops of every latency row, in every lane, batched or alone (zero where an op did not run); see forwards.py.
OPS = ("recompute", "replay", "cache_update", "scoring", "attention", "shared", "other")


@dataclass
class StepTimes:
    """Seconds per op for each forward of one strategy; the first forward of a turn is its prefill."""

    prefill: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)

    def add(self, ops: dict, prefill: bool, piece: int = 0):
        """One forward's seconds per op; a prompt fed in pieces is one prefill (pieces > 0 add to it)."""
        if prefill and piece > 0 and self.prefill:
            last = self.prefill[-1]
            for op, s in ops.items():
                last[op] = last.get(op, 0.0) + s
            return
        (self.prefill if prefill else self.decode).append(ops)

    def summary(self) -> dict:
        """Milliseconds: time to first token, mean per decode step, per-op means and totals."""
        ops = (*OPS, "total")
        out = {"ttft_ms": 1e3 * self.prefill[0]["total"] if self.prefill else None}
        n = len(self.decode)
        for op in ops:
            total = sum(step.get(op, 0.0) for step in self.decode)
            out[f"decode_{op}_ms_mean"] = 1e3 * total / n if n else None
            out[f"{op}_ms_total"] = 1e3 * (total + sum(step.get(op, 0.0) for step in self.prefill))
        out["decode_steps"] = n
        return out
