"""KNorm: keys of low L2 norm draw the attention, so keep those.

Devoto, Zhao, Scardapane, Minervini, "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression", EMNLP 2024,
https://arxiv.org/abs/2406.11430; official code: alessiodevoto/l2compress
(`cache.py`, `l2_compress`).  A key's L2 norm predicts, before any query
arrives, how much attention it will draw (low norm, high attention): each head
keeps the keys of lowest norm.  No attention weights are needed, so the rule
works with any attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scored import DECODES, Scored, Step


@dataclass
class KNorm(Scored):
    """Keep, per KV head, the `budget` keys of lowest L2 norm; the first `skip` layers are not compressed.

    Parameters
    ----------
    budget : int, default 64
        Tokens kept per compressed global layer and KV head (>= 1).
    skip : int, default 2
        Decoder layers 0 .. skip-1 are not compressed: their global layers keep
        every token, as the full cache does (>= 0).  The paper skips layers 0
        and 1, whose norms predict attention worst; ``skip=0`` compresses
        every layer, as NVIDIA kvpress's `KnormPress` does.
    decode : {"hold", "grow"}, default "hold"
        ``hold``: the budget holds after every forward, the newest token a
        candidate like any other (the paper's language-modelling runs, which
        compress the cache after every step).  ``grow``: each user turn's
        prompt is compressed to the budget, then the cache grows while
        decoding until the next prompt (the paper's needle-in-a-haystack and
        passkey runs, and kvpress).

    Notes
    -----
    Score of a candidate: minus the L2 norm of its key (post-RoPE, as the
    model produced it, in fp32), per KV head; ties keep the newer token.  No
    recent window and no sinks are protected (the paper and the official code
    rank every cached token by norm alone).  Differences from the official code
    are listed in the README ("Baselines against their papers").
    """

    skip: int = 2
    decode: str = "hold"

    name = "knorm"
    kvpress = {"skip": 0, "decode": "grow"}  # kvpress's `KnormPress`: every layer, the prompt only
    per_head = True

    def __post_init__(self):
        super().__post_init__()
        self.check_min(self.name, "skip", self.skip, 0)
        self.check_choice(self.name, "decode", self.decode, DECODES)

    def compresses(self, index: int) -> bool:
        return index >= self.skip

    def holds(self, prefill: bool) -> bool:
        return prefill or self.decode == "hold"

    def score(self, step: Step) -> torch.Tensor | None:
        if not step.evicts:
            return None
        return -step.keys.float().norm(dim=-1)  # (1, n_kv, T)
