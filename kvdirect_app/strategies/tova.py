"""TOVA: Token Omission Via Attention.

Oren, Hassid, Yarden, Adi, Schwartz, "Transformers are Multi-State RNNs",
EMNLP 2024, https://arxiv.org/abs/2401.06104.  A bounded cache is a
multi-state RNN; TOVA keeps it bounded greedily: at each step, drop the token
to which the current query attends least.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scored import Scored, Step


@dataclass
class TOVA(Scored):
    """Evict the token with the lowest attention from the current query, averaged over heads, per layer.

    Parameters
    ----------
    budget : int, default 64
        Tokens kept per global layer (>= 1); TOVA has no other setting.

    Notes
    -----
    Score of a candidate: the softmax attention weight it receives from the
    step's last query, averaged over all query heads (grouped-query heads
    included, each query head once), so all heads of a layer keep the same
    tokens.  The new token is a candidate as well.  When decoding, one token
    over the budget means one token is dropped; after a prefill chunk the
    chunk's last query ranks all candidates at once and the top `budget` are
    kept (the rule NVIDIA kvpress's TOVA press uses for prompts).  Attention
    weights are only computed in steps that evict.
    """

    name = "tova"
    needs_attention = True

    def scored_queries(self, q: int) -> int:
        return 1

    def score(self, step: Step) -> torch.Tensor | None:
        if not step.evicts:
            return None
        probs = step.attention(1)  # (1, n_kv, groups, 1, T)
        return probs.mean(dim=(1, 2, 3)).unsqueeze(1)  # (1, 1, T)
