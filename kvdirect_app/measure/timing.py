"""Timing (docs/measurement.md, "Every part of a step is timed where it runs"): the clock a region reads, the ops every
latency row has, and a lane's seconds per op, forward by forward (`StepTimes`).  How far a strategy's tokens agree
with the reference's is `agreement.py`'s; teacher-forced agreement and KL are `engine/teacher_forcing.py`'s."""

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
