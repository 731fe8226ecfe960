"""SnapKV: the observation window of a prompt predicts what generation will attend to.

Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen, "SnapKV: LLM
Knows What You are Looking for Before Generation", NeurIPS 2024,
https://arxiv.org/abs/2404.14469.  At the end of a prompt, the attention of
its last `window` queries (the observation window) onto the earlier tokens,
pooled over neighbouring positions, picks the tokens each head keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import StrategyError
from .scored import Scored, Step

POOLINGS = ("max", "avg")


@dataclass
class SnapKV(Scored):
    """Compress each user turn's prefill to `budget` tokens per KV head; hold the budget while decoding.

    Parameters
    ----------
    budget : int, default 64
        Tokens kept per global layer and KV head, observation window included
        (window < budget, as the reference code asserts).
    window : int, default 32
        Observation window: the last `window` prompt queries vote, and the last
        `window` tokens are always kept.
    kernel : int, default 7
        Width of the 1-D pooling over positions (odd, >= 1; 1 means no pooling).
    pooling : {"max", "avg"}, default "max"
        Pooling of the votes (the reference code offers max and avg pooling,
        with zero padding for avg).

    Notes
    -----
    At the first forward of every turn (the prefill of the user's message),
    if the held tokens plus the chunk exceed the budget: per query head, the
    softmax attention of the chunk's last `min(window, chunk)` queries over all
    candidates is summed over those queries; query heads of a group are
    averaged onto their KV head; the sums of the candidates before the
    observation window are pooled along each head's (compacted) token order;
    each KV head keeps its top `budget - window` of them plus the last
    `window` tokens.

    New tokens while decoding (the paper does not evict while decoding): the
    tokens chosen at the last prefill stay; the newest tokens fill the rest of
    the budget as a sliding window, so each decoded token evicts the oldest
    token that came after the last prefill's selection.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    name = "snapkv"
    per_head = True
    needs_attention = True

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.window < self.budget:
            raise StrategyError(f"{self.name}: window={self.window} must be >= 1 and < budget={self.budget}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise StrategyError(f"{self.name}: kernel={self.kernel} must be an odd integer >= 1")
        self.check_choice(self.name, "pooling", self.pooling, POOLINGS)

    def score(self, step: Step) -> torch.Tensor | None:
        if step.prefill:
            # Tokens older than this turn's observation window were either chosen now or kept before.
            step.state["selected_before"] = step.seen - self.window
            if not step.evicts:
                return None
            votes = step.attention(min(self.window, step.q)).sum(dim=3).mean(dim=2)  # (1, n_kv, T)
            prefix = votes[..., :-self.window]
            pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
            pooled = pool(prefix, kernel_size=self.kernel, stride=1, padding=self.kernel // 2)
            return torch.cat([pooled, torch.full_like(votes[..., -self.window:], float("inf"))], dim=-1)
        if not step.evicts:
            return None
        scores = step.positions.float()
        return scores.masked_fill(step.positions < step.state["selected_before"], float("inf"))
