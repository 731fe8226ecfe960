"""StreamingLLM: attention sinks plus a window of recent tokens.

Xiao, Tian, Chen, Han, Lewis, "Efficient Streaming Language Models with
Attention Sinks", ICLR 2024, https://arxiv.org/abs/2309.17453.  The first few
tokens receive large attention whatever their content ("attention sinks");
keeping them next to a window of recent tokens keeps the model stable when
the rest is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import StrategyError
from .scored import Scored, Step


@dataclass
class StreamingLLM(Scored):
    """Keep the first `sinks` tokens and the most recent `budget - sinks` tokens per global layer.

    Parameters
    ----------
    budget : int, default 64
        Tokens kept per global layer (>= 1), sinks included.
    sinks : int, default 4
        Leading tokens never evicted (0 <= sinks < budget; the paper uses 4).

    Notes
    -----
    Positions differ from the paper: StreamingLLM caches keys before RoPE and
    rotates them by their slot in the cache; here, as for every strategy of
    this project, keys are stored as the model produced them (rotated by their
    original position) and never re-rotated.  Inside the pre-training context
    (all our runs) the model sees the true distances; beyond it the paper's
    variant would be needed.  One selection per layer (all heads keep the
    same tokens).
    """

    sinks: int = 4

    name = "streaming_llm"

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.sinks < self.budget:
            raise StrategyError(f"{self.name}: sinks={self.sinks} must be >= 0 and < budget={self.budget}")

    def score(self, step: Step) -> torch.Tensor:
        scores = step.positions.float()
        return scores.masked_fill(step.positions < self.sinks, float("inf"))
