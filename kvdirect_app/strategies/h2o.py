"""H2O: Heavy-Hitter Oracle.

Zhang, Sheng, Zhou, Chen, Zheng, Cai, Song, Tian, Ré, Barrett, Wang, Chen,
"H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048.  A few
tokens collect most of the attention mass over time ("heavy hitters"); the
cache keeps those, by attention accumulated over all queries so far, plus a
window of recent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import StrategyError
from .scored import Scored, Step


@dataclass
class H2O(Scored):
    """Keep, per KV head, the `recent` newest tokens and the `budget - recent` heaviest hitters.

    Parameters
    ----------
    budget : int, default 64
        Tokens kept per global layer and KV head (>= 1).
    recent : int, default -1
        Tokens of the recent window (0 <= recent <= budget); -1 means half the
        budget, rounded down (the paper's default split: half heavy, half recent).

    Notes
    -----
    Accumulated attention of a token: the sum, over every query that has seen
    it (every prefill query and every decoding step), of the softmax weight it
    received, kept in an fp32 buffer per KV head and token (counted in the
    state bytes) and dropped with the token.  Grouped-query heads: the weights
    of the query heads of a group are averaged onto their KV head; each KV head
    selects its own tokens, as each head does in the paper.
    """

    recent: int = -1

    name = "h2o"
    per_head = True
    needs_attention = True
    token_buffers = ("accumulated",)

    def __post_init__(self):
        super().__post_init__()
        if self.recent != -1 and not 0 <= self.recent <= self.budget:
            raise StrategyError(
                f"{self.name}: recent={self.recent} must be between 0 and budget={self.budget}, or -1 (half the budget)"
            )

    @property
    def recent_tokens(self) -> int:
        return self.budget // 2 if self.recent == -1 else self.recent

    def score(self, step: Step) -> torch.Tensor:
        probs = step.attention(step.q)  # (1, n_kv, groups, q, T)
        accumulated = step.buffers["accumulated"] + probs.sum(dim=3).mean(dim=2)  # (1, n_kv, T)
        step.buffers["accumulated"] = accumulated
        recent = step.positions >= step.seen - self.recent_tokens
        return accumulated.masked_fill(recent, float("inf"))
