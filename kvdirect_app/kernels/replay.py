"""Exact K/V from stored attention inputs.

A layer's keys and values are deterministic projections of that layer's
attention input (the normed residual, `norm_l(r_l)`):

    K = rope(k_norm(W_k x), pos)        V = W_v x

`KVProjector` repeats the family's own modules (`k_proj`, `v_proj`, `k_norm`,
the family's `apply_rotary_pos_emb` and rotary embedding) so that, called with
the same GEMM shapes as the original forward, the result is bit-equal
(`torch.equal`) to what the model handed its cache.  Shapes matter: on CPU a
GEMM over many rows can round differently from the same rows one at a time
(docs/measurement.md, "Kernels").  So:

* `project(x, start)`: one GEMM over a chunk, as a prefill chunk was computed;
* `project_rows(x, positions)`: every row as its own GEMM, as decode steps were
  computed.  In fp32 it uses one `bmm`/`baddbmm` with each row as its own batch
  element when a start-up check (256 rows, the layer's own weights, the running
  device) shows it bit-equal to one-row `F.linear` calls; otherwise, and always
  in bf16/fp16 (where the batched kernel was seen to round 3 rows in 2,000
  differently), a Python loop of one-row calls.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models import compat
from .invariant import INVARIANT_ATTENTION, invariant_attention, native_now
from .invariant import active as active_kernels
from .row_replay import RowsContext
from .row_replay import rows as rows_scope


def _rows_batched(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """rows (N, d) -> (N, out), each row as its own batch element of one bmm."""
    n, d = rows.shape
    out = weight.shape[0]
    weight_t = weight.t().unsqueeze(0).expand(n, d, out)
    x = rows.unsqueeze(1)  # (N, 1, d)
    if bias is None:
        return torch.bmm(x, weight_t).squeeze(1)
    return torch.baddbmm(bias.view(1, 1, -1).expand(n, 1, out), x, weight_t).squeeze(1)


def _rows_loop(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """rows (N, d) -> (N, out), one `F.linear` on a (1, 1, d) input per row, exactly as a decode step."""
    return torch.cat([F.linear(rows[i].view(1, 1, -1), weight, bias).view(1, -1) for i in range(rows.shape[0])])


def _linear_rows_batched(linear: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    return _rows_batched(linear.weight, linear.bias, rows)


def _linear_rows_loop(linear: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    return _rows_loop(linear.weight, linear.bias, rows)


# A weight this large (elements) does not stay in cache while N rows stream it one after another: it is cut
# into blocks of output rows, and each block serves every row while it is hot.  Each output element is still
# the same dot product in the same order (measured bit-equal here, and checked like the batched kernel); the
# output head of SmolLM2 (49152 x 576) takes 21 ms instead of 40 ms for 7 rows.
BLOCK_FROM = 1 << 23
BLOCK_ROWS = 1024


def _rows_blocked(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [
            _rows_batched(weight[j : j + BLOCK_ROWS], None if bias is None else bias[j : j + BLOCK_ROWS], rows)
            for j in range(0, weight.shape[0], BLOCK_ROWS)
        ],
        dim=1,
    )


# (shape, dtype, bias, device, threads) -> the fastest kernel checked exact here.  The thread count is part of the
# key: some kernels split their work by it, and a verdict at one count says nothing about another.
_KERNELS: dict[tuple, Callable] = {}


def rows_kernel_is_exact(linear: nn.Linear, n_rows: int | None = None) -> bool:
    """Whether a batched row kernel is bit-equal to one-row calls for this layer's shape on its device and dtype.

    Checked once per (shape, dtype, bias, device, thread count) on random rows with the
    layer's own weight: 256 rows, fewer for a large weight (an output head
    of 49152 x 576 gets 16; its loop of one-row calls alone takes seconds
    here).  The engine checks every linear layer of the model when it is
    built, outside any timed or traced region.  Only fp32 is tried: in bf16
    the batched kernel rounds a few rows in a thousand differently on this
    CPU (measured), more often than a start-up check can be trusted to catch.
    """
    return rows_are_exact(linear.weight, linear.bias, n_rows)


def rows_are_exact(weight: torch.Tensor, bias: torch.Tensor | None, n_rows: int | None = None) -> bool:
    return _kernel(weight, bias, n_rows) is not _rows_loop


def _kernel(weight: torch.Tensor, bias: torch.Tensor | None, n_rows: int | None = None) -> Callable:
    key = (tuple(weight.shape), weight.dtype, bias is not None, str(weight.device), torch.get_num_threads())
    if key not in _KERNELS:
        kernel = _rows_loop
        if weight.dtype == torch.float32:
            n_rows = n_rows or max(16, min(256, BLOCK_FROM // weight.numel()))
            gen = torch.Generator(device="cpu").manual_seed(0)
            rows = torch.randn(n_rows, weight.shape[1], generator=gen).to(weight)
            candidates = ([_rows_blocked] if weight.numel() >= BLOCK_FROM else []) + [_rows_batched]
            with torch.inference_mode():
                want = _rows_loop(weight, bias, rows)
                kernel = next((k for k in candidates if torch.equal(k(weight, bias, rows), want)), _rows_loop)
        _KERNELS[key] = kernel
    return _KERNELS[key]


def check_rows_kernels(model: nn.Module) -> None:
    """Picks the row kernel of every distinct linear layer shape of `model` now, so no forward pays for it."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            _kernel(module.weight, module.bias)


def linear_rows(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """rows (N, d) -> (N, out), each row as its own GEMM: a batched kernel where it is exact here, else a loop."""
    return _kernel(weight, bias)(weight, bias, rows)


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
            raise ValueError(
                f"{type(attn).__name__} has no nn.Linear `{name}`; this needs separate q/k/v "
                "projections (llama, mistral, qwen2/3, gemma2/3, olmo2 families)"
            )
        self.linear: nn.Linear = linear
        self.head_dim: int = attn.head_dim
        self.num_heads: int = linear.out_features // attn.head_dim
        self.norm: nn.Module | None = getattr(attn, norm, None) if norm else None
        self.norm_full_width = self.norm is not None and self.norm.weight.numel() == linear.out_features
        self.rope = compat.rope_function(attn) if rotate else None
        self.rotary = compat.rotary_for_layer(model, spec.layer_type) if rotate else None

    def finish(self, y: torch.Tensor, position_ids: torch.Tensor | None, start: int = 0) -> torch.Tensor:
        """y (1, T, H*d_h) -> (1, H, T, d_h), rotated at `position_ids` (1, T), or at start .. start+T-1 when None."""
        if self.norm is not None and self.norm_full_width:
            y = self.norm(y)
        y = y.view(*y.shape[:-1], -1, self.head_dim)
        if self.norm is not None and not self.norm_full_width:
            y = self.norm(y)
        y = y.transpose(1, 2)
        if self.rope is not None and self.rotary is not None:
            if position_ids is None:
                position_ids = torch.arange(start, start + y.shape[2], device=y.device).unsqueeze(0)
            cos, sin = self.rotary(y, position_ids)
            # The family's own function, as the model rotates its keys; its query slot gets no heads (nothing
            # computed there: the same bits for y, half the work).
            _, y = self.rope(y[:, :0], y, cos, sin)
        return y

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x (1, T, d) at positions start..start+T-1 -> (1, H, T, d_h), as one GEMM (the run's kernels; the model's
        own inside `kernels.native()`)."""
        y = F.linear(x, self.linear.weight, self.linear.bias) if native_now() else self.linear(x)
        return self.finish(y, None, start)


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

    def project(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x (1, T, d): attention inputs of tokens at positions start..start+T-1, as one GEMM.

        Returns K, V of shape (1, n_kv, T, d_h).
        """
        return self.key(x, start), self.value(x, start)

    def project_rows(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (1, N, d): N single-token inputs at `positions` (N,), each row its own GEMM as in decoding."""
        rows = x[0]
        position_ids = positions.view(1, -1)
        k = self.key.finish(linear_rows(self.key.linear.weight, self.key.linear.bias, rows).unsqueeze(0), position_ids)
        v = self.value.finish(
            linear_rows(self.value.linear.weight, self.value.linear.bias, rows).unsqueeze(0), position_ids
        )
        return k, v


class _ReplayStop(Exception):
    """Raised by a replayed layer once its K/V are stored, when the rest of that layer is not needed."""


class _BufferLayer(compat.DynamicLayer):
    """K/V of a replayed global layer, written chunk after chunk into buffers of a fixed `capacity` (no
    concatenation per chunk); attention gets the filled prefix.  The caller fills the rest (hot and new tokens)."""

    def __init__(self, capacity: int, stop: bool):
        super().__init__()
        self.capacity, self.stop, self.count = capacity, stop, 0

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.keys = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[-1])
        self.values = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.keys[..., self.count : self.count + n, :] = key_states
        self.values[..., self.count : self.count + n, :] = value_states
        self.count += n
        if self.stop:
            raise _ReplayStop
        return self.keys[..., : self.count, :], self.values[..., : self.count, :]

    def get_seq_length(self) -> int:
        return self.count

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.count + query_length, 0


class _SizeLayer(compat.DynamicLayer):
    """Stands in for a layer that is not replayed: stores nothing, reports mask sizes as the real layer would
    have (the model builds each type's mask from its first layer of that type)."""

    def __init__(self, sliding_window: int | None):
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.window = sliding_window
        self.count = 0

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
    """Replays decoder layers on stored anchors, one layer at a time, repeating the original chunking (AnchorKV).

    `replay_layer(j, hidden, chunks)` runs decoder layer `j` over `chunks`
    [(start, n)] of `hidden` (1, T, d), in order, each chunk as one causal
    forward over the chunks before it, with the masks and rotary embeddings
    the model's own forward builds for those shapes.  It can carry the hidden
    states up (each chunk's output overwrites its input, which no later chunk
    of this layer needs) and return the layer's K/V.  Chunk by chunk within a
    layer, or layer by layer within a chunk: every op sees the same inputs
    and shapes, so both orders give the same bits, and the layer-major order
    needs one layer's K/V and one hidden state per token at a time.

    Consecutive one-token chunks (decoded tokens) of a global layer go
    through the layer in one call that keeps each row's shapes (`row_replay.py`),
    once the first such call of each layer type was checked bit-equal to
    separate calls here; `rows_exact` records the check.

    The engine's observer counts its decoder-layer passes (`replay_layer`, one per replayed layer) and layer
    calls (`_call`), and runs the one-time rows check (`_check_rows`) as the measurement's own work.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = compat.text_config(model.config)
        self.layers = compat.decoder_layers(model)
        self.specs = compat.layer_specs(model.config)
        self.embed = compat.input_embeddings(model)
        self.rotary = {s.layer_type: compat.rotary_for_layer(model, s.layer_type) for s in self.specs}
        self.rows_exact: dict[str, bool] = {}  # layer type -> rows in one call checked bit-equal to separate calls
        # The model's own attention implementation, set explicitly for every replayed call: a replay may run
        # inside a batched pass of several lanes, whose attention function is another (lockstep.py).
        self.attention_impl = compat.attention_module(self.layers[0]).config._attn_implementation
        compat.register_attention(INVARIANT_ATTENTION, invariant_attention)
        self._inputs: dict[tuple, tuple] = {}  # (start, n, type) -> (mask, rotary); valid for one set of chunks
        self.invariant = False  # invariant kernels: calls of any size (REPLAY_ROWS tokens), their attention, no mask

    def forget_inputs(self):
        """Masks and rotary embeddings are cached per chunk shape; call when a step is over."""
        self._inputs = {}

    def _chunk_inputs(self, start: int, n: int, layer_type: str, like: torch.Tensor) -> tuple:
        """The mask and rotary embeddings the model's forward builds for a chunk of `n` tokens after `start`."""
        invariant = self.invariant and not native_now()
        key = (start, n, layer_type, invariant)
        if key not in self._inputs:
            sizes = [_SizeLayer(s.sliding_window) for s in self.specs]
            for layer in sizes:
                layer.count = start
            positions = torch.arange(start, start + n, device=like.device).unsqueeze(0)
            mask = None  # the invariant attention masks by position
            if not invariant:
                # The mask a forward builds depends on the attention implementation: the model's own, not the one
                # a batched pass may have set for the moment.
                with compat.attention_implementation(self.config, self.attention_impl):
                    mask = compat.mask_function(layer_type)(
                        config=self.config,
                        inputs_embeds=like[:, :n],
                        attention_mask=None,
                        cache=compat.Cache(layers=sizes),
                        position_ids=positions,
                    )
            rotary = self.rotary[layer_type](like[:, :n], positions) if self.rotary[layer_type] else None
            self._inputs[key] = (mask, rotary)
        return self._inputs[key]

    def _target(self, j: int, capacity: int, carry: bool):
        spec = self.specs[j]
        return (
            compat.DynamicSlidingWindowLayer(spec.sliding_window)
            if spec.is_sliding
            else _BufferLayer(capacity, stop=not carry)
        )

    def _cache(self, j: int, target, start: int = 0):
        stand_ins = [_SizeLayer(s.sliding_window) for s in self.specs]
        for layer in stand_ins:
            layer.count = start
        return compat.Cache(layers=[target if i == j else stand_ins[i] for i in range(len(self.specs))]), stand_ins

    @staticmethod
    def _groups(chunks: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """Chunks as (start, n, rows): consecutive one-token chunks merged into one run of rows."""
        groups = []
        for start, n in chunks:
            last = groups[-1] if groups else None
            if n == 1 and last is not None and last[2] and last[0] + last[1] == start:
                groups[-1] = (last[0], last[1] + 1, True)
            else:
                groups.append((start, n, n == 1))
        return groups

    def _call(self, j: int, hidden: torch.Tensor, start: int, n: int, cache, carry: bool, rows: bool = False):
        """One call of layer `j` on hidden[:, start:start+n] (its output written back when `carry`)."""
        t = self.specs[j].layer_type
        chunk = hidden[:, start : start + n]
        positions = torch.arange(start, start + n, device=hidden.device).unsqueeze(0)
        mask, embeddings = self._chunk_inputs(start, n, t, chunk)
        invariant = self.invariant and not native_now()
        if invariant and active_kernels() is None:
            raise RuntimeError("an invariant replay runs outside its run's kernels: use Engine.kernel_scope()")
        attn = compat.attention_module(self.layers[j])
        scope = compat.attention_implementation(attn.config, INVARIANT_ATTENTION if invariant else self.attention_impl)
        if rows:
            like = hidden[:, start : start + 1]
            context = RowsContext(
                start,
                n,
                compat.attention_function(attn, self.attention_impl),
                lambda pos: self._chunk_inputs(pos, 1, t, like)[0],
                linear_rows,
            )
            scope = rows_scope(attn.config, context)
        try:
            with scope:
                out = compat.run_decoder_layer(self.layers[j], chunk, mask, embeddings, positions, cache)
            if carry:
                hidden[:, start : start + n] = out
        except _ReplayStop:
            pass

    def replay_layer(
        self,
        j: int,
        hidden: torch.Tensor,
        chunks: list[tuple[int, int]],
        capacity: int | None = None,
        carry: bool = True,
    ):
        """Run layer `j` over `chunks` of `hidden`; returns its K/V buffers ((1, n_kv, capacity, d_h), the first
        T rows filled) when `capacity` is given.  With `carry`, `hidden` holds layer j's output afterwards."""
        spec = self.specs[j]
        target = self._target(j, capacity if capacity is not None else hidden.shape[1], carry)
        cache, stand_ins = self._cache(j, target)
        for start, n, is_rows in self._groups(chunks):
            if (
                is_rows
                and n > 1
                and not spec.is_sliding
                and not (self.invariant and not native_now())
                and self.rows_exact.get(spec.layer_type) is not False
            ):
                if spec.layer_type not in self.rows_exact:  # once per layer type (the observer's, not the lane's)
                    self._check_rows(j, hidden, start, n, target, carry)
                if self.rows_exact[spec.layer_type]:
                    self._call(j, hidden, start, n, cache, carry, rows=True)
                    for layer in stand_ins:
                        layer.count += n
                    continue
            for s, q in [(start + i, 1) for i in range(n)] if is_rows else [(start, n)]:
                self._call(j, hidden, s, q, cache, carry)
                for layer in stand_ins:
                    layer.count += q
        if spec.is_sliding or capacity is None:
            return None
        return target.keys, target.values

    def _check_rows(self, j: int, hidden: torch.Tensor, start: int, n: int, target, carry: bool):
        """Run `n` rows in one call on copies, beside the separate calls about to run, and keep whether they give
        the same bits (K/V and, when carried, the layer's output)."""
        trial = _BufferLayer(target.capacity, stop=not carry)
        if target.count:
            trial.lazy_initialization(target.keys[..., :1, :], target.values[..., :1, :])
            trial.keys[..., : target.count, :] = target.keys[..., : target.count, :]
            trial.values[..., : target.count, :] = target.values[..., : target.count, :]
            trial.count = target.count
        rows_hidden = hidden.clone()
        trial_cache, _ = self._cache(j, trial, start)
        self._call(j, rows_hidden, start, n, trial_cache, carry, rows=True)
        separate_hidden = hidden.clone()
        check_target = _BufferLayer(target.capacity, stop=not carry)
        check_target.lazy_initialization(trial.keys[..., :1, :], trial.values[..., :1, :])
        check_target.keys[..., : target.count, :] = trial.keys[..., : target.count, :]
        check_target.values[..., : target.count, :] = trial.values[..., : target.count, :]
        check_target.count = target.count
        check_cache, stand_ins = self._cache(j, check_target, start)
        for i in range(n):
            self._call(j, separate_hidden, start + i, 1, check_cache, carry)
            for layer in stand_ins:
                layer.count += 1
        rows = slice(start, start + n)
        same = (
            torch.equal(trial.keys[..., rows, :], check_target.keys[..., rows, :])
            and torch.equal(trial.values[..., rows, :], check_target.values[..., rows, :])
            and (not carry or torch.equal(rows_hidden[:, rows], separate_hidden[:, rows]))
        )
        self.rows_exact[self.specs[j].layer_type] = same

    def replay(
        self,
        start_hidden: torch.Tensor,
        anchor: int,
        targets: list[int],
        chunks: list[tuple[int, int]],
        capacity: int | None = None,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Layers `anchor..max(targets)` over `chunks`, layer by layer from `start_hidden` (1, T, d; overwritten);
        K/V of every target layer (capacity rows, the first T filled)."""
        last = max(targets)
        out = {}
        for j in range(anchor, last + 1):
            kv = self.replay_layer(j, start_hidden, chunks, capacity if j in targets else None, carry=j < last)
            if j in targets:
                out[j] = kv
        return out
