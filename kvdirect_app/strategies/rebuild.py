"""The cache layer shared by KV-Direct and AnchorKV: K/V of the last `budget`
tokens are stored, K/V of older tokens are rebuilt on demand.

Subclasses say how old K/V are rebuilt (`rebuild_old(end)`); this layer does
the rest: the hot window, once-per-turn rebuilding, parking, timing and byte
accounting.

* ``rebuild="step"``: old K/V rebuilt at every step (bounded memory).
* ``rebuild="turn"``: rebuilt once when a turn starts (or after a park), then
  full K/V held while the turn lasts; `end_turn()` drops them.
* `park()`: drops every K/V; only what the subclass keeps persistently
  (inputs, anchors, token ids) stays.  `resume()` rebuilds every old token's
  K/V once and refills the hot window, so a resumed session continues exactly
  as if it had never been parked.

Forward chunks are recorded as runs `[start, length, is_rows]` (a prefill
chunk, or a run of one-token decode steps) so a rebuild can repeat the
original GEMM shapes.
"""

from __future__ import annotations

import time

import torch

from ..compat import CacheLayerMixin
from .base import MeasuredLayer, storage_bytes

MODES = ("exact", "fast")
REBUILDS = ("step", "turn")


def record_run(runs: list[list], seen: int, q: int):
    """Append a forward of `q` tokens starting at `seen`; one-token steps extend a rows run."""
    last = runs[-1] if runs else None
    if q == 1 and last is not None and last[2] and last[0] + last[1] == seen:
        last[1] += 1
    else:
        runs.append([seen, q, q == 1])


class RebuildingLayer(MeasuredLayer, CacheLayerMixin):
    """K/V of the last `budget` tokens kept; older ones rebuilt by `rebuild_old`."""

    is_sliding = False

    def __init__(self, budget: int, rebuild: str):
        super().__init__()
        self.budget = budget
        self.rebuild = rebuild
        self.seen = 0
        self.active: tuple[torch.Tensor, torch.Tensor] | None = None
        self.recompute_s = 0.0
        self.init_measures()

    # --- what subclasses provide ---------------------------------------------
    def rebuild_old(self, end: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """K/V (1, n_kv, end, d_h) of tokens 0..end-1, rebuilt exactly as the subclass promises."""
        raise NotImplementedError

    def held_bytes(self) -> int:
        """Bytes of the subclass's persistent store (inputs, anchors...) owned by this layer."""
        return 0

    def before_update(self, q: int):
        """Called at the start of every update (e.g. to store this forward's inputs)."""

    # --- the Cache layer API -------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        t0 = time.perf_counter()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        self.before_update(q)
        old_k = old_v = None
        rebuild_s = 0.0
        if self.active is not None:
            keys = torch.cat([self.active[0], key_states], dim=-2)
            values = torch.cat([self.active[1], value_states], dim=-2)
        else:
            hot = 0 if self.keys is None else self.keys.shape[-2]
            t1 = time.perf_counter()
            old_k, old_v = self.rebuild_old(self.seen - hot)
            rebuild_s = time.perf_counter() - t1
            keys = torch.cat([t for t in (old_k, self.keys, key_states) if t is not None], dim=-2)
            values = torch.cat([t for t in (old_v, self.values, value_states) if t is not None], dim=-2)
        if self.rebuild == "turn":
            self.active = (keys, values)
        # The hot window is a copy, so it never pins a larger buffer.
        self.keys = keys[..., -self.budget:, :].clone()
        self.values = values[..., -self.budget:, :].clone()
        self.seen += q
        self.transient = storage_bytes(old_k, old_v) + (0 if self.active is not None else storage_bytes(keys, values))
        self.recompute_s += rebuild_s
        self.cache_update_s += time.perf_counter() - t0 - rebuild_s
        self.compare(keys, values)
        return keys, values

    def end_turn(self):
        self.active = None

    def park(self):
        self.active = None
        self.keys = self.values = None

    def resume(self):
        """Rebuild the hot window after a park (every old token's K/V is rebuilt once, then dropped)."""
        if self.keys is not None or self.seen == 0:
            return
        t0 = time.perf_counter()
        old_k, old_v = self.rebuild_old(self.seen)
        self.keys = old_k[..., -self.budget:, :].clone()
        self.values = old_v[..., -self.budget:, :].clone()
        self.transient = storage_bytes(old_k, old_v)
        self.recompute_s += time.perf_counter() - t0

    def token_states(self, old_state: str = "residual") -> list[str]:
        hot = 0 if self.keys is None else self.keys.shape[-2]
        return [old_state] * (self.seen - hot) + ["kv"] * hot

    def state_bytes(self) -> int:
        active = self.active or (None, None)
        return storage_bytes(self.keys, self.values, *active) + self.held_bytes()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


def rebuilding_persistent(geom, layer, seen: int, budget: int, rebuild: str) -> int:
    """K/V bytes a RebuildingLayer holds after `seen` tokens (not counting its store)."""
    total = min(seen, budget) * layer.kv_bytes_per_token
    if rebuild == "turn":
        total += seen * layer.kv_bytes_per_token  # full K/V while the turn lasts
    return total


def rebuilding_transient(layer, seen_before: int, q: int, budget: int, rebuild: str, turn_start: bool,
                         old_factor: int = 1) -> int:
    """Transient bytes of one RebuildingLayer update: rebuilt K/V (times `old_factor` when rebuilt K/V of
    several layers wait together) plus, per step, the K/V handed to attention."""
    old = seen_before - min(seen_before, budget)
    if rebuild == "turn":
        return (old * old_factor if turn_start else 0) * layer.kv_bytes_per_token
    return (old * old_factor + seen_before + q) * layer.kv_bytes_per_token
