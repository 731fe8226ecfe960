"""PyramidKV: SnapKV's selection with budgets that shrink with depth.

Cai, Zhang, Gao, Liu, Li, Liu, Lu, Xiong, Dong, Hu, Xiao, "PyramidKV: Dynamic
KV Cache Compression based on Pyramidal Information Funneling", 2024,
https://arxiv.org/abs/2406.02069; official code: Zefan-Cai/KVCache-Factory
(`pyramidkv/pyramidkv_utils.py`, `PyramidKVCluster`).  Attention scatters
widely in the lower layers and funnels onto a few tokens in the upper ones, so
lower layers get more of the cache: per-layer budgets follow an arithmetic
sequence whose top is `1/beta` of the mean, with the same mean as a uniform
budget.  Each layer picks its tokens as SnapKV does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

from .snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV per layer, the shallowest global layer keeping the most: `budget` tokens per layer on average.

    Parameters
    ----------
    budget : int, default 64
        Mean tokens kept per global layer and KV head after a prompt is
        compressed, observation window included (the official code's
        `max_capacity_prompt`): the layers together keep what SnapKV's do.
    window, kernel, pooling, decode
        As SnapKV's (defaults window 32, kernel 5, average pooling, ``grow``:
        the official code's).
    beta : int, default 20
        The pyramid's steepness (>= 1): beyond the observation window, the
        deepest layer keeps ``1/beta`` of the mean, the shallowest twice the
        mean less that (the paper's beta = 20).

    Notes
    -----
    With `w` the observation window, `e = budget - w` and `G` global layers,
    once the prompt spans `n >= max(budget, 2e)` tokens the shallowest layer
    keeps ``w + b`` with ``b = min(2e - e/beta, n - w)``, the deepest
    ``w + 2e - b``, the layers between on a straight line (so the mean is
    `budget`, and no layer is asked for more than the prompt holds); a shorter
    prompt gives every layer `budget`, SnapKV's uniform rule (the official
    code's branches).
    Real-valued budgets are rounded down and the tokens left over go to the
    largest remainders (the shallower layer on a tie), so the budgets sum to
    exactly ``G * budget`` and never grow with depth.  `n` is the tokens seen
    when the layer compresses (the whole prompt, for the first turn).  Each
    layer then selects as SnapKV does, with its own budget.  Differences from
    the official code are listed in the README ("Baselines against their
    papers").
    """

    beta: int = 20

    name = "pyramidkv"

    def __post_init__(self):
        super().__post_init__()
        self.check_min(self.name, "beta", self.beta, 1)

    def layer_budgets(self, count: int, seen: int) -> tuple[int, ...]:
        window, extra = self.observed, self.budget - self.observed
        return budgets(window, extra, self.beta, count, min(seen, window + 2 * extra))  # more seen changes nothing


@functools.lru_cache(maxsize=1024)
def budgets(window: int, extra: int, beta: int, count: int, seen: int) -> tuple[int, ...]:
    """Tokens each of `count` layers keeps (shallowest first) after a prompt that ends at `seen` tokens: `window`
    plus an arithmetic sequence of mean `extra` (the class's Notes), rounded to sum exactly to count * extra."""
    if count == 1 or seen < max(window + extra, 2 * extra):
        return (window + extra,) * count
    bottom = min(2 * extra - Fraction(extra, beta), seen - window)
    step = (2 * bottom - 2 * extra) / (count - 1)  # bottom - top, top = 2 * extra - bottom
    sizes = [bottom - r * step for r in range(count)]
    floors = [math.floor(size) for size in sizes]
    largest = sorted(range(count), key=lambda r: (floors[r] - sizes[r], r))[: count * extra - sum(floors)]
    return tuple(window + floor + (r in largest) for r, floor in enumerate(floors))
