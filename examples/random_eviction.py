"""Random eviction: the floor every eviction method should beat, as a strategy of one's own in one file.

    python -m kvdirect_app.bench run --strategies full,examples/random_eviction.py:RandomEviction:budget=64
    python -m kvdirect_app.bench check-strategy examples/random_eviction.py:RandomEviction
    (the page: "examples/random_eviction.py:RandomEviction:seed=3" in the sidebar's extra specs box)

A `Scored` subclass writes one method, `score(step)`: a number per candidate token (higher is kept).  Its settings
are its dataclass fields, checked like the package's own; `budget` comes from `Scored`.
"""

from dataclasses import dataclass

import torch

from kvdirect_app.strategies.scored import Scored, Step


@dataclass
class RandomEviction(Scored):
    """Keep `budget` tokens per layer drawn at random; the same seed keeps the same tokens.

    Parameters
    ----------
    seed : int, default 0
        The draw's seed (with the tokens seen: each eviction draws afresh).
    """

    seed: int = 0

    def score(self, step: Step) -> torch.Tensor | None:
        if not step.evicts:  # nothing is dropped at this step: no scores needed
            return None
        draw = torch.Generator().manual_seed(self.seed * 1_000_003 + step.seen)
        return torch.rand(step.positions.shape, generator=draw)  # (1, 1, candidates)
