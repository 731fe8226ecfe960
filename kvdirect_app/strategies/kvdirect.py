"""KV-Direct: keep residual-stream vectors instead of keys and values.

"The Residual Stream Is All You Need" (KV-Direct, 2026).  Keys and values of
a layer are deterministic projections of that layer's input, so a cache can
keep the input and recompute K/V on demand.

Here, on every global-attention layer, the last `budget` tokens keep their
K/V; every token also keeps its attention input (the normed residual
`norm_l(r_l)`, `d` elements: as good as `r_l` for pure projection and one norm
cheaper per step, docs/strategies.md).  K/V of tokens older than the budget are rebuilt
from those inputs at their original absolute positions:

* ``mode=exact``: shape-faithful replay, each prefill chunk as one GEMM and
  each decoded token as its own row, so K/V are `torch.equal` to the full
  cache (tests check this on every family, fp32 and bf16);
* ``mode=fast``: one GEMM over all old tokens with the model's own kernels (whatever the run's); its error is
  measured
  and shown, never hidden.

``rebuild=step`` (default) rebuilds at every step (bounded peak memory, the
paper's setting); ``rebuild=turn`` rebuilds once when a turn starts and keeps
full K/V while the turn is active (fast, full-KV memory during the turn).

Sliding-window layers keep exactly what the full cache keeps (their window).

Settings: ``budget`` (>= 1, default 64), ``mode`` (exact|fast), ``rebuild``
(step|turn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.invariant import native
from ..kernels.replay import KVProjector
from ..models import compat
from ..models.geometry import ModelGeometry
from .base import SlidingLayer, Strategy, StrategyCache, window_layer_bytes, window_layer_transient
from .rebuild import MODES, REBUILDS, RebuildingLayer, rebuilding_persistent, rebuilding_transient, record_run


class ResidualLayer(RebuildingLayer):
    """Attention inputs of all tokens; K/V of older tokens projected from them."""

    def __init__(self, projector: KVProjector, budget: int, mode: str, rebuild: str):
        super().__init__(budget, rebuild)
        self.projector = projector
        self.mode = mode
        self.inputs: torch.Tensor | None = None  # (1, seen, d)
        self.runs: list[list] = []
        self.pending: torch.Tensor | None = None

    one_gemm = False  # set under invariant kernels: any grouping of rows gives their bits

    def use_kernels(self, kernels):
        self.one_gemm = kernels.invariant

    def capture(self, x: torch.Tensor):
        """Receives the attention input (1, q, d) of this forward, just before `update`."""
        self.pending = x

    def before_update(self, q: int):
        x, self.pending = self.pending, None
        if x is None:
            raise RuntimeError(
                "kvdirect: the attention input was not handed over; run the model through engine.InputTap"
            )
        self.inputs = x if self.inputs is None else torch.cat([self.inputs, x], dim=1)
        record_run(self.runs, self.seen, q)

    def held_tensors(self) -> tuple:
        return (self.inputs,)

    def rebuild_old(self, end: int, capacity: int):
        key, value = self.projector.key, self.projector.value
        keys = self.inputs.new_empty(1, key.num_heads, capacity, key.head_dim)
        values = self.inputs.new_empty(1, value.num_heads, capacity, value.head_dim)
        if self.mode == "fast":  # one GEMM with the model's own kernels: its error is measured, not promised
            with native():
                keys[..., :end, :], values[..., :end, :] = self.projector.project(self.inputs[:, :end], 0)
            return keys, values
        if self.one_gemm:  # one call of the invariant kernels: the forward's bits
            keys[..., :end, :], values[..., :end, :] = self.projector.project(self.inputs[:, :end], 0)
            return keys, values
        for start, n, is_rows in self.runs:
            if start >= end:
                break
            take = min(n, end - start)
            if is_rows:
                positions = torch.arange(start, start + take, device=self.inputs.device)
                k, v = self.projector.project_rows(self.inputs[:, start : start + take], positions)
            else:
                # The whole chunk, as it was computed; then the part that is old.
                k, v = self.projector.project(self.inputs[:, start : start + n], start)
                k, v = k[..., :take, :], v[..., :take, :]
            keys[..., start : start + take, :] = k
            values[..., start : start + take, :] = v
        return keys, values

    def token_states(self) -> list[str]:
        return super().token_states("residual")


@dataclass
class KVDirect(Strategy):
    """KV-Direct with a hot K/V window of `budget` tokens; older K/V rebuilt from attention inputs."""

    budget: int = 64
    mode: str = "exact"
    rebuild: str = "step"

    name = "kvdirect"
    kv_comparable = True

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

    def formula_between_turns(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        return self.formula_persistent(geom, seen, ended=True)

    def formula_persistent(
        self, geom: ModelGeometry, seen: int, forwards: list | None = None, parked: bool = False, ended: bool = False
    ) -> int:
        total = 0
        for layer in geom.layers:
            if layer.is_sliding:
                total += window_layer_bytes(geom, layer.index, seen)
            else:
                total += seen * layer.residual_bytes_per_token
                if not parked:
                    total += rebuilding_persistent(geom, layer, seen, self.budget, "step" if ended else self.rebuild)
        return total

    def formula_parked(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        return self.formula_persistent(geom, seen, parked=True)

    def formula_transient(
        self, geom: ModelGeometry, seen_before: int, q: int, turn_start: bool = False, forwards: list | None = None
    ) -> int:
        worst = 0
        for layer in geom.layers:
            if layer.is_sliding:
                worst = max(worst, window_layer_transient(geom, layer.index, seen_before, q))
            else:
                appended = seen_before * layer.residual_bytes_per_token  # the inputs being extended
                worst = max(
                    worst, appended, rebuilding_transient(layer, seen_before, q, self.budget, self.rebuild, turn_start)
                )
        return worst
