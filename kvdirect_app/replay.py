"""Exact K/V from stored attention inputs.

A layer's keys and values are deterministic projections of that layer's
attention input (the normed residual, `norm_l(r_l)`):

    K = rope(k_norm(W_k x), pos)        V = W_v x

`KVProjector` repeats the family's own modules (`k_proj`, `v_proj`, `k_norm`,
the family's `apply_rotary_pos_emb` and rotary embedding) so that, called with
the same GEMM shapes as the original forward, the result is bit-equal
(`torch.equal`) to what the model handed its cache.  Shapes matter: on CPU a
GEMM over many rows can round differently from the same rows one at a time
(DESIGN.md, "Exactness").  So:

* `project(x, start)`: one GEMM over a chunk, as a prefill chunk was computed;
* `project_rows(x, positions)`: every row as its own GEMM, as decode steps were
  computed.  In fp32 it uses one `bmm`/`baddbmm` with each row as its own batch
  element when a start-up check (256 rows, the layer's own weights, the running
  device) shows it bit-equal to one-row `F.linear` calls; otherwise, and always
  in bf16/fp16 (where the batched kernel was seen to round 3 rows in 2,000
  differently), a Python loop of one-row calls.
"""

from __future__ import annotations

import torch
from torch import nn

from . import compat


def _linear_rows_batched(linear: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    """rows (N, d) -> (N, out), each row as its own batch element of one bmm."""
    n, d = rows.shape
    weight_t = linear.weight.t().unsqueeze(0).expand(n, d, linear.out_features)
    x = rows.unsqueeze(1)  # (N, 1, d)
    if linear.bias is None:
        return torch.bmm(x, weight_t).squeeze(1)
    bias = linear.bias.view(1, 1, -1).expand(n, 1, linear.out_features)
    return torch.baddbmm(bias, x, weight_t).squeeze(1)


def _linear_rows_loop(linear: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    """rows (N, d) -> (N, out), one `F.linear` on a (1, 1, d) input per row, exactly as a decode step."""
    return torch.cat([linear(rows[i].view(1, 1, -1)).view(1, -1) for i in range(rows.shape[0])])


def rows_kernel_is_exact(linear: nn.Linear, n_rows: int = 256) -> bool:
    """Whether the batched row kernel is bit-equal to one-row calls for this layer on its device and dtype.

    Only fp32 is tried: in bf16 the batched kernel rounds a few rows in a
    thousand differently on this CPU (measured), more often than a start-up
    check can be trusted to catch.
    """
    if linear.weight.dtype != torch.float32:
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randn(n_rows, linear.in_features, generator=gen).to(linear.weight)
    with torch.inference_mode():
        return torch.equal(_linear_rows_batched(linear, rows), _linear_rows_loop(linear, rows))


class HeadProjection:
    """One projection of an attention module, finished as the family finishes it.

    `linear` output (1, T, H*d_h) -> optional RMSNorm (OLMo 2: over the whole
    projection, before the heads are split; Qwen 3, Gemma 3: per head) ->
    (1, H, T, d_h) -> RoPE at the given positions (when `rope` is given).
    Shared by K/V rebuilding and the eviction strategies' query rebuilding.
    """

    def __init__(self, model: nn.Module, spec: compat.LayerSpec, name: str, norm: str | None, rotate: bool):
        attn = compat.attention_module(compat.decoder_layers(model)[spec.index])
        linear = getattr(attn, name, None)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{type(attn).__name__} has no nn.Linear `{name}`; this needs separate q/k/v "
                             "projections (llama, mistral, qwen2/3, gemma2/3, olmo2 families)")
        self.linear: nn.Linear = linear
        self.head_dim: int = attn.head_dim
        self.num_heads: int = linear.out_features // attn.head_dim
        self.norm: nn.Module | None = getattr(attn, norm, None) if norm else None
        self.norm_full_width = self.norm is not None and self.norm.weight.numel() == linear.out_features
        self.rope = compat.rope_function(attn) if rotate else None
        self.rotary = compat.rotary_for_layer(model, spec.layer_type) if rotate else None

    def finish(self, y: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.norm is not None and self.norm_full_width:
            y = self.norm(y)
        y = y.view(*y.shape[:-1], -1, self.head_dim)
        if self.norm is not None and not self.norm_full_width:
            y = self.norm(y)
        y = y.transpose(1, 2)
        if self.rope is not None and self.rotary is not None:
            cos, sin = self.rotary(y, position_ids)
            _, y = self.rope(y, y, cos, sin)
        return y

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x (1, T, d) at positions start..start+T-1 -> (1, H, T, d_h), as one GEMM."""
        positions = torch.arange(start, start + x.shape[1], device=x.device).unsqueeze(0)
        return self.finish(self.linear(x), positions)


class KVProjector:
    """Rebuilds K/V of one attention layer from its attention inputs.

    Parameters
    ----------
    model : the causal LM (its modules are used read-only).
    spec : the layer's `compat.LayerSpec`.
    """

    def __init__(self, model: nn.Module, spec: compat.LayerSpec):
        self.spec = spec
        self.key = HeadProjection(model, spec, "k_proj", norm="k_norm", rotate=True)
        self.value = HeadProjection(model, spec, "v_proj", norm=None, rotate=False)
        self._rows_exact: bool | None = None

    @property
    def rows_batched(self) -> bool:
        """True when the batched row kernel was checked bit-equal here (checked once, lazily)."""
        if self._rows_exact is None:
            self._rows_exact = rows_kernel_is_exact(self.key.linear) and rows_kernel_is_exact(self.value.linear)
        return self._rows_exact

    def project(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x (1, T, d): attention inputs of tokens at positions start..start+T-1, as one GEMM.

        Returns K, V of shape (1, n_kv, T, d_h).
        """
        return self.key(x, start), self.value(x, start)

    def project_rows(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (1, N, d): N single-token inputs at `positions` (N,), each row its own GEMM as in decoding."""
        rows = x[0]
        linear_rows = _linear_rows_batched if self.rows_batched else _linear_rows_loop
        position_ids = positions.view(1, -1)
        k = self.key.finish(linear_rows(self.key.linear, rows).unsqueeze(0), position_ids)
        v = self.value.finish(linear_rows(self.value.linear, rows).unsqueeze(0), position_ids)
        return k, v


class _ReplayStop(Exception):
    """Raised by the last layer of a replay once its K/V are stored: the rest of that layer is not needed."""


class _StopLayer(compat.DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        super().update(key_states, value_states, *args, **kwargs)
        raise _ReplayStop


class _SizeLayer(compat.DynamicLayer):
    """Stands in for a layer outside the replayed segment: stores nothing, reports mask sizes as the real
    layer would have (the model builds each type's mask from its first layer of that type)."""

    def __init__(self, sliding_window: int | None):
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.window = sliding_window
        self.count = 0

    def advance(self, n: int):
        self.count += n

    def get_seq_length(self) -> int:
        return self.count

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.count + query_length, 0
        offset = max(self.count - self.window + 1, 0)
        if self.count >= self.window:
            return self.window - 1 + query_length, offset
        return self.count + query_length, offset


class LayerReplayer:
    """Replays decoder layers on stored anchors, repeating the original chunking (AnchorKV).

    `replay(start_hidden, anchor, targets, chunks)` runs layers
    `anchor..max(targets)` over `chunks` [(start, n)] in order, each chunk as
    one causal forward over everything before it, with the masks and rotary
    embeddings the model's own forward builds for those shapes; the last layer
    stops once its K/V are stored.  Counts decoder-layer passes (per segment
    replay) and layer calls (per chunk).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = compat.text_config(model.config)
        self.layers = compat.decoder_layers(model)
        self.specs = compat.layer_specs(model.config)
        self.embed = compat.input_embeddings(model)
        self.rotary = {s.layer_type: compat.rotary_for_layer(model, s.layer_type) for s in self.specs}
        self.passes = 0
        self.calls = 0

    def replay(self, start_hidden, anchor: int, targets: list[int], chunks: list[tuple[int, int]]):
        last = max(targets)
        layers = []
        for s in self.specs:
            if anchor <= s.index < last:
                layers.append(compat.DynamicSlidingWindowLayer(s.sliding_window) if s.is_sliding else compat.DynamicLayer())
            elif s.index == last:
                layers.append(_StopLayer())
            else:
                layers.append(_SizeLayer(s.sliding_window))
        cache = compat.Cache(layers=layers)
        types = {self.specs[j].layer_type for j in range(anchor, last + 1)}
        for start, n in chunks:
            hidden = start_hidden(start, n)
            positions = torch.arange(start, start + n, device=hidden.device).unsqueeze(0)
            masks = {t: compat.mask_function(t)(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                                cache=cache, position_ids=positions) for t in types}
            embeddings = {t: self.rotary[t](hidden, positions) if self.rotary[t] else None for t in types}
            for j in range(anchor, last + 1):
                t = self.specs[j].layer_type
                try:
                    hidden = compat.run_decoder_layer(self.layers[j], hidden, masks[t], embeddings[t], positions, cache)
                except _ReplayStop:
                    pass
                self.calls += 1
            for layer in layers:
                if isinstance(layer, _SizeLayer):
                    layer.advance(n)
        self.passes += last - anchor + 1
        return {g: (cache.layers[g].keys, cache.layers[g].values) for g in targets}
