"""A strategy that keeps an `mmap` on itself: its state cannot be deep-copied
(tests/kernels/test_twins_and_shapes.py)."""

import mmap
from dataclasses import dataclass

import torch

from kvdirect_app.strategies.scored import Scored, Step


@dataclass
class KeepsMmap(Scored):
    def __post_init__(self):
        super().__post_init__()
        self._notes = mmap.mmap(-1, 4096)

    def score(self, step: Step) -> torch.Tensor | None:
        if not step.evicts:
            return None
        return step.positions.float()  # the most recent kept
