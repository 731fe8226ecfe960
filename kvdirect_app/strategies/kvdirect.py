"""KV-Direct: keep residual-stream vectors instead of keys and values.

"The Residual Stream Is All You Need" (KV-Direct, 2026).  Keys and values of
a layer are deterministic projections of that layer's input, so a cache can
keep the input and recompute K/V on demand.

Here, on every global-attention layer, the last `budget` tokens keep their
K/V; every token also keeps its attention input (the normed residual
`norm_l(r_l)`, `d` elements: as good as `r_l` for pure projection and one norm
cheaper per step, DESIGN.md).  K/V of tokens older than the budget are rebuilt
from those inputs at their original absolute positions:

* ``mode=exact``: shape-faithful replay, each prefill chunk as one GEMM and
  each decoded token as its own row, so K/V are `torch.equal` to the full
  cache (tests check this on every family, fp32 and bf16);
* ``mode=fast``: one batched GEMM over all old tokens; its error is measured
  and shown, never hidden.

``rebuild=step`` (default) rebuilds at every step (bounded peak memory, the
paper's setting); ``rebuild=turn`` rebuilds once when a turn starts and keeps
full K/V while the turn is active (fast, full-KV memory during the turn).

Sliding-window layers keep exactly what the full cache keeps (their window).

Settings: ``budget`` (>= 1, default 64), ``mode`` (exact|fast), ``rebuild``
(step|turn).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import compat
from ..compat import CacheLayerMixin
from ..geometry import ModelGeometry
from ..replay import KVProjector
from .base import MeasuredLayer, SlidingLayer, Strategy, StrategyCache, storage_bytes, window_layer_bytes, window_layer_transient

MODES = ("exact", "fast")
REBUILDS = ("step", "turn")


class ResidualLayer(MeasuredLayer, CacheLayerMixin):
    """Attention inputs of all tokens, K/V of the last `budget`, K/V of older tokens rebuilt on demand."""

    is_sliding = False

    def __init__(self, projector: KVProjector, budget: int, mode: str, rebuild: str):
        super().__init__()
        self.projector = projector
        self.budget = budget
        self.mode = mode
        self.rebuild = rebuild
        self.inputs: torch.Tensor | None = None  # (1, seen, d)
        # Forward chunks as [start, length, is_rows]: a prefill chunk, or a run of one-token decode steps.
        self.runs: list[list] = []
        self.seen = 0
        self.pending: torch.Tensor | None = None
        self.active: tuple[torch.Tensor, torch.Tensor] | None = None  # rebuild="turn": K/V while the turn lasts
        self.recompute_s = 0.0
        self.init_measures()

    def capture(self, x: torch.Tensor):
        """Receives the attention input (1, q, d) of this forward, just before `update`."""
        self.pending = x

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.is_initialized = True

    def _record_run(self, q: int):
        last = self.runs[-1] if self.runs else None
        if q == 1 and last is not None and last[2] and last[0] + last[1] == self.seen:
            last[1] += 1
        else:
            self.runs.append([self.seen, q, q == 1])

    def rebuild_old(self, end: int):
        """K/V (1, n_kv, end, d_h) of tokens 0..end-1 from their stored inputs, or (None, None)."""
        if end <= 0:
            return None, None
        if self.mode == "fast":
            return self.projector.project(self.inputs[:, :end], 0)
        keys, values = [], []
        for start, n, is_rows in self.runs:
            if start >= end:
                break
            take = min(n, end - start)
            if is_rows:
                positions = torch.arange(start, start + take, device=self.inputs.device)
                k, v = self.projector.project_rows(self.inputs[:, start:start + take], positions)
            else:
                # The whole chunk, as it was computed; then the part that is old.
                k, v = self.projector.project(self.inputs[:, start:start + n], start)
                k, v = k[..., :take, :], v[..., :take, :]
            keys.append(k)
            values.append(v)
        return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)

    def update(self, key_states, value_states, *args, **kwargs):
        t0 = time.perf_counter()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        x, self.pending = self.pending, None
        if x is None:
            raise RuntimeError("kvdirect: the attention input was not handed over; run the model through engine.InputTap")
        q = key_states.shape[-2]
        self.inputs = x if self.inputs is None else torch.cat([self.inputs, x], dim=1)
        self._record_run(q)
        hot = 0 if self.keys is None else self.keys.shape[-2]
        old_k = old_v = None
        rebuild_s = 0.0
        if self.active is not None:
            keys = torch.cat([self.active[0], key_states], dim=-2)
            values = torch.cat([self.active[1], value_states], dim=-2)
        else:
            t1 = time.perf_counter()
            old_k, old_v = self.rebuild_old(self.seen - hot)
            rebuild_s = time.perf_counter() - t1
            keys = torch.cat([t for t in (old_k, self.keys, key_states) if t is not None], dim=-2)
            values = torch.cat([t for t in (old_v, self.values, value_states) if t is not None], dim=-2)
        if self.rebuild == "turn":
            self.active = (keys, values)
        # The hot window: K/V of the last `budget` tokens, copied so no larger buffer stays pinned.
        hot_k = key_states if self.keys is None else torch.cat([self.keys, key_states], dim=-2)
        hot_v = value_states if self.values is None else torch.cat([self.values, value_states], dim=-2)
        if hot_k.shape[-2] > self.budget:
            hot_k, hot_v = hot_k[..., -self.budget:, :].clone(), hot_v[..., -self.budget:, :].clone()
        self.keys, self.values = hot_k, hot_v
        self.seen += q
        self.transient = storage_bytes(old_k, old_v)
        if self.active is None:
            self.transient += storage_bytes(keys, values)
        self.recompute_s += rebuild_s
        self.cache_update_s += time.perf_counter() - t0 - rebuild_s
        self.compare(keys, values)
        return keys, values

    def end_turn(self):
        self.active = None

    def token_states(self) -> list[str]:
        hot = 0 if self.keys is None else self.keys.shape[-2]
        return ["residual"] * (self.seen - hot) + ["kv"] * hot

    def state_bytes(self) -> int:
        active = self.active or (None, None)
        return storage_bytes(self.inputs, self.keys, self.values, *active)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


@dataclass
class KVDirect(Strategy):
    """KV-Direct with a hot K/V window of `budget` tokens; older K/V rebuilt from attention inputs."""

    budget: int = 64
    mode: str = "exact"
    rebuild: str = "step"

    name = "kvdirect"

    def __post_init__(self):
        self.check_min(self.name, "budget", self.budget, 1)
        self.check_choice(self.name, "mode", self.mode, MODES)
        self.check_choice(self.name, "rebuild", self.rebuild, REBUILDS)

    @property
    def claims_exact(self) -> bool:
        return self.mode == "exact"

    def build_cache(self, model) -> StrategyCache:
        layers = []
        for spec in compat.layer_specs(model.config):
            if spec.is_sliding:
                layers.append(SlidingLayer(spec.sliding_window))
            else:
                layers.append(ResidualLayer(KVProjector(model, spec), self.budget, self.mode, self.rebuild))
        return StrategyCache(self, layers)

    def formula_persistent(self, geom: ModelGeometry, seen: int) -> int:
        total = 0
        for layer in geom.layers:
            if layer.is_sliding:
                total += window_layer_bytes(geom, layer.index, seen)
                continue
            total += seen * layer.residual_bytes_per_token + min(seen, self.budget) * layer.kv_bytes_per_token
            if self.rebuild == "turn":
                total += seen * layer.kv_bytes_per_token  # full K/V held while the turn is active
        return total

    def formula_transient(self, geom: ModelGeometry, seen_before: int, q: int, turn_start: bool = False) -> int:
        worst = 0
        for layer in geom.layers:
            if layer.is_sliding:
                worst = max(worst, window_layer_transient(geom, layer.index, seen_before, q))
                continue
            old = seen_before - min(seen_before, self.budget)
            if self.rebuild == "turn":
                tokens = old if turn_start else 0
            else:
                tokens = old + seen_before + q  # rebuilt K/V plus the K/V handed to attention
            worst = max(worst, tokens * layer.kv_bytes_per_token)
        return worst
