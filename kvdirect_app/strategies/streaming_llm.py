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
        Leading tokens never evicted (>= 0; the paper uses 4).  Sinks that do
        not leave room for a recent token (sinks >= budget) are cut to
        ``budget // 2``, and `notes` says so: every budget from 1 runs.

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
        if self.sinks < 0:
            raise StrategyError(f"{self.name}: sinks={self.sinks} must be >= 0")

    @property
    def kept_sinks(self) -> int:
        """The sinks actually kept: `sinks`, cut to leave the recent window at least half the budget."""
        return self.sinks if self.sinks < self.budget else self.budget // 2

    @property
    def notes(self) -> list[str]:
        if self.kept_sinks == self.sinks:
            return []
        return [f"sinks={self.sinks} does not fit budget={self.budget}; {self.kept_sinks} sink(s) kept (budget // 2)"]

    def score(self, step: Step) -> torch.Tensor:
        scores = step.positions.float()
        return scores.masked_fill(step.positions < self.kept_sinks, float("inf"))
