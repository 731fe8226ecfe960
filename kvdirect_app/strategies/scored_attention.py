"""The attention a scored layer reads, computed inside the cache layer, never by switching the model to eager
attention: the queries rebuilt from a layer's attention input (`QueryProjector`), their causal attention
probabilities over the candidates in fp32 (`attention_probs`), and the mask of a layer type cut to a layer that hands
attention fewer keys (`fit_mask`).  `scored.py`'s layers score with the first two; the engine's lockstep and hooks
use them too (the attention snapshot, a layer holding fewer keys than its type's first)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.replay import HeadProjection
from ..models import compat
from .base import ContractError


class QueryProjector:
    """Rebuilds the queries of one attention layer from its attention input, as the model computes them
    (`replay.HeadProjection`: q_proj, q_norm where the family has one, RoPE), with the module's scaling and
    logit soft-capping.
    """

    def __init__(self, model: nn.Module, spec: compat.LayerSpec):
        attn = compat.attention_module(compat.decoder_layers(model)[spec.index])
        self.query = HeadProjection(model, spec, "q_proj", norm="q_norm", rotate=True)
        self.scaling: float = attn.scaling
        self.softcap: float | None = getattr(attn, "attn_logit_softcapping", None)

    def queries(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x (1, n, d): attention inputs of tokens at positions start..start+n-1 -> queries (1, H, n, d_h)."""
        return self.query(x, start)


def attention_probs(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Causal attention probabilities in fp32, query heads grouped onto their KV head.

    queries (1, H, n, d_h), keys (1, n_kv, T, d_h), query_positions (n,),
    key_positions (1, G, T) with G 1 or n_kv; `window`: a sliding layer's (a query at p sees keys after
    p - window).  `causal=False` where the caller knows every key is at or before every query (one query over its
    candidates): without a window the mask would hide nothing, so none is built.
    Returns (1, n_kv, H // n_kv, n, T).
    """
    _, heads, n, d_h = queries.shape
    n_kv = keys.shape[1]
    q = queries.float().view(1, n_kv, heads // n_kv, n, d_h)
    logits = torch.einsum("bkgnd,bktd->bkgnt", q, keys.float()) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if not causal and window is None:
        return torch.softmax(logits, dim=-1)
    keys_at, query_at = key_positions.long()[:, :, None, None, :], query_positions.long()[None, None, None, :, None]
    visible = keys_at <= query_at
    if window is not None:
        visible &= keys_at > query_at - window
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1)


def fit_mask(
    mask: torch.Tensor | None, keys: int, who: str = "a cache", layer: int | None = None
) -> torch.Tensor | None:
    """The mask of a layer type (sized by its first layer, which holds the most keys) for a layer handing attention
    `keys` keys: its rightmost columns.  Every cache hands attention its stored keys, all before the queries, then
    the step's own, so those columns say: stored keys visible, the chunk's own keys causal.  A layer handing
    attention more keys than the mask has columns breaks the rule that budgets never grow with depth
    (`ContractError`, naming `who`)."""
    if mask is None or mask.shape[-1] == keys:
        return mask
    if mask.shape[-1] < keys:
        raise ContractError(
            f"{who}: layer {layer} hands attention {keys} keys, more than the {mask.shape[-1]} its "
            "layer type's first layer holds (the mask is built once per layer type, sized by that "
            "layer); allowed: budgets that never grow with depth (`Scored.layer_budgets`)"
        )
    return mask[..., -keys:]
