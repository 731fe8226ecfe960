"""SnapKV: the observation window of a prompt predicts what generation will attend to.

Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen, "SnapKV: LLM
Knows What You are Looking for Before Generation", NeurIPS 2024,
https://arxiv.org/abs/2404.14469; official code: FasterDecoding/SnapKV
(`snapkv_utils.py`).  At the end of a prompt, the attention of its last
`window` queries (the observation window) onto the earlier tokens, pooled
over neighbouring positions, picks the tokens each head keeps; the window
itself is always kept.  The prompt is compressed once; generation then
appends to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import StrategyError
from .scored import DECODES, Scored, Step

POOLINGS = ("avg", "max")


@dataclass
class SnapKV(Scored):
    """Compress each user turn's prompt to `budget` tokens per KV head; while decoding, grow (or hold).

    Parameters
    ----------
    budget : int, default 64
        Tokens kept per global layer and KV head after a prompt is compressed,
        observation window included (the official code's `max_capacity_prompt`).
    window : int, default 32
        Observation window: the last `window` prompt queries vote, and the last
        `window` tokens are always kept.  A window that does not fit the budget
        (window >= budget) is shrunk to ``max(1, budget // 2)``, and `notes` says so.
    kernel : int, default 5
        Width of the 1-D pooling over positions (odd, >= 1; 1 means no pooling).
    pooling : {"avg", "max"}, default "avg"
        Pooling of the votes; average pooling counts the zero padding at the
        ends, as the official code's `avg_pool1d` does.
    decode : {"grow", "hold"}, default "grow"
        ``grow``: nothing is evicted while decoding, the cache grows by one
        token per step until the next prompt (the paper, the official code and
        NVIDIA kvpress).  ``hold``: the budget also holds while decoding: the
        tokens chosen at the prompt stay and the newest tokens fill the rest
        of the budget as a sliding window.

    Notes
    -----
    Defaults are the official code's (window 32, kernel 5, average pooling;
    its LongBench runs used kernel 7 with max pooling, available as settings).
    At the end of every user turn's prompt (its last piece, when the engine
    feeds a long prompt in pieces), if the held tokens plus the prompt exceed
    the budget: per query head, the softmax attention
    of the prompt's last `min(window, prompt)` queries over all candidates is
    summed over those queries and pooled along the candidates before the
    window (each head's compacted token order); query heads of a group are
    then averaged onto their KV head (kvpress's order: pool per head, then
    average the group); each KV head keeps its top `budget - window` plus the
    last `window` tokens.  Differences from the official code are listed in
    the README ("Baselines against their papers").
    """

    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    decode: str = "grow"

    name = "snapkv"
    kvpress = {"window": 64}  # kvpress's `SnapKVPress` (and `PyramidKVPress`): window_size=64, kernel_size=5
    per_head = True
    needs_attention = True

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise StrategyError(f"{self.name}: window={self.window} must be >= 1")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise StrategyError(f"{self.name}: kernel={self.kernel} must be an odd integer >= 1")
        self.check_choice(self.name, "pooling", self.pooling, POOLINGS)
        self.check_choice(self.name, "decode", self.decode, DECODES)

    @property
    def observed(self) -> int:
        """The observation window actually used: `window`, shrunk to fit the budget."""
        return self.window if self.window < self.budget else max(1, self.budget // 2)

    @property
    def notes(self) -> list[str]:
        if self.observed == self.window:
            return []
        return [
            f"window={self.window} does not fit budget={self.budget}; the observation window is "
            f"{self.observed} (budget // 2)"
        ]

    @property
    def prompt_window(self) -> int:
        return self.observed

    def holds(self, prefill: bool) -> bool:
        return prefill or self.decode == "hold"

    def scored_queries(self, q: int) -> int:
        return self.observed

    def score(self, step: Step) -> torch.Tensor | None:
        window = self.observed
        if step.prefill:
            # Tokens older than this turn's observation window were either chosen now or kept before.
            step.state["selected_before"] = step.seen - window
            if not step.evicts:
                return None
            votes = step.attention(min(window, step.prompt_tokens)).sum(dim=3)  # (1, n_kv, groups, T)
            prefix = votes[..., :-window]
            if prefix.shape[-1]:
                n_kv, groups, length = prefix.shape[1:]
                pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
                pooled = (
                    pool(
                        prefix.reshape(n_kv * groups, 1, length),
                        kernel_size=self.kernel,
                        stride=1,
                        padding=self.kernel // 2,
                    )
                    .view(1, n_kv, groups, length)
                    .mean(dim=2)
                )
            else:
                pooled = prefix.mean(dim=2)
            return torch.cat([pooled, torch.full_like(votes[:, :, 0, -window:], float("inf"))], dim=-1)
        if not step.evicts:
            return None
        scores = step.positions.float()
        return scores.masked_fill(step.positions < step.state["selected_before"], float("inf"))
