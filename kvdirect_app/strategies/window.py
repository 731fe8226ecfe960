"""A plain window: the last `budget` tokens of every global layer.

The simplest lossy baseline: the same bytes as a sliding-window cache of
`budget` tokens, applied to every global-attention layer (sliding layers are
left as the full cache keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scored import Scored, Step


@dataclass
class Window(Scored):
    """Keep the most recent `budget` tokens per global layer.

    Parameters
    ----------
    budget : int, default 64
        Tokens kept per global layer (>= 1).

    Notes
    -----
    Score of a token: its original position, so the oldest token is evicted
    first.  One selection per layer (all heads keep the same tokens).
    """

    name = "window"

    def score(self, step: Step) -> torch.Tensor:
        return step.positions.float()  # (1, 1, T)
