"""The cache layer shared by KV-Direct and AnchorKV: K/V of the last `budget`
tokens are stored, K/V of older tokens are rebuilt on demand.

Subclasses say how old K/V are rebuilt (`rebuild_old`); this layer does the
rest: the hot window, once-per-turn rebuilding, parking, timing and byte
accounting.

* ``rebuild="step"``: old K/V are rebuilt at every step, into one buffer that
  attention reads and that is dropped when the layer's attention is done, so
  a step holds one layer's full K/V at a time (bounded peak, more compute).
* ``rebuild="turn"``: rebuilt once when a turn starts (or when a parked
  session resumes), then full K/V held while the turn lasts (fast; memory of
  the inputs or anchors *plus* full K/V during the turn); `end_turn()` keeps
  the last `budget` tokens and drops the rest.
* `park()` drops every K/V; only what the subclass keeps persistently
  (inputs, anchors, token ids) stays.  `resume()` rebuilds all K/V once for
  ``rebuild="turn"`` (the turn then uses them, nothing is rebuilt twice); for
  ``rebuild="step"`` it does nothing, since the next step rebuilds every
  token anyway.

Forward chunks are recorded as runs `[start, length, is_rows]` (a prefill
chunk, or a run of one-token decode steps) so a rebuild can repeat the
original GEMM shapes.  `rebuild_old` is the seam the engine's observer times
(as `rebuild_op`) and counts tokens of.
"""

from __future__ import annotations

import torch

from ..models.compat import CacheLayerMixin

MODES = ("exact", "fast")
REBUILDS = ("step", "turn")


def record_run(runs: list[list], seen: int, q: int):
    """Append a forward of `q` tokens starting at `seen`; one-token steps extend a rows run."""
    last = runs[-1] if runs else None
    if q == 1 and last is not None and last[2] and last[0] + last[1] == seen:
        last[1] += 1
    else:
        runs.append([seen, q, q == 1])


# Under invariant kernels a replay may group old tokens any way: it takes them this many at a time, so its
# transient (a layer's MLP activations and attention buffers for the rows of one call) stays small beside the
# K/V it rebuilds; a GEMM of this many rows runs near this CPU's peak throughput already.
REPLAY_ROWS = 64


def chunks_of(runs: list[list], end: int, one_chunk: bool = False, rows: int | None = None) -> list[tuple[int, int]]:
    """The original forward chunks (start, n) covering tokens 0..end-1; decode rows one token each.
    A prefill chunk that straddles `end` is kept whole (its shape is what the original computed).
    `one_chunk`: every token in one call (the fast mode's approximation); `rows`: calls of that many tokens
    (invariant kernels, where any grouping gives the same bits)."""
    if one_chunk:
        return [(0, end)]
    if rows is not None:
        return [(s, min(rows, end - s)) for s in range(0, end, rows)]
    chunks = []
    for start, n, is_rows in runs:
        if start >= end:
            break
        if is_rows:
            chunks.extend((start + i, 1) for i in range(min(n, end - start)))
        else:
            chunks.append((start, n))
    return chunks


def covered(chunks: list[tuple[int, int]]) -> int:
    """Tokens the chunks span (past `end` when the last prefill chunk straddles it)."""
    return chunks[-1][0] + chunks[-1][1] if chunks else 0


class RebuildingLayer(CacheLayerMixin):
    """K/V of the last `budget` tokens kept; older ones rebuilt by `rebuild_old`."""

    is_sliding = False
    rebuild_op = "recompute"  # what a rebuild is, in the latency rows: "recompute" or "replay"

    def __init__(self, budget: int, rebuild: str):
        super().__init__()
        self.budget = budget
        self.rebuild = rebuild
        self.seen = 0
        self.active: tuple[torch.Tensor, torch.Tensor] | None = None  # every token's K/V during a turn

    # --- what subclasses provide ---------------------------------------------
    def rebuild_old(self, end: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V buffers (1, n_kv, capacity, d_h) whose first `end` rows are tokens 0..end-1, rebuilt exactly as
        the subclass promises; the caller fills the rest."""
        raise NotImplementedError

    def held_tensors(self) -> tuple:
        """The subclass's persistent store (inputs, anchors...) owned by this layer."""
        return ()

    def before_update(self, q: int):
        """Called at the start of every update (e.g. to store this forward's inputs)."""

    # --- what a step will rebuild --------------------------------------------
    @property
    def hot(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def rebuild_span(self, q: int) -> tuple[int, int]:
        """(old tokens to rebuild, K/V rows attention will read) for a forward of `q` new tokens."""
        if self.active is not None:
            return 0, self.seen + q
        return self.seen - self.hot, self.seen + q

    # --- the Cache layer API -------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        self.before_update(q)
        end, total = self.rebuild_span(q)
        if self.active is not None:
            keys = torch.cat([self.active[0], key_states], dim=-2)
            values = torch.cat([self.active[1], value_states], dim=-2)
        elif end == 0:
            keys = key_states if self.keys is None else torch.cat([self.keys, key_states], dim=-2)
            values = value_states if self.values is None else torch.cat([self.values, value_states], dim=-2)
        else:
            keys, values = self.rebuild_old(end, total)
            if self.keys is not None:
                keys[..., end : self.seen, :] = self.keys
                values[..., end : self.seen, :] = self.values
            keys[..., self.seen :, :] = key_states
            values[..., self.seen :, :] = value_states
        self.seen += q
        if self.rebuild == "turn":
            self.active = (keys, values)
            self.keys = self.values = None  # the hot window is cut from `active` when the turn ends
        else:
            # A copy, so the hot window never pins the step's larger buffer.
            self.keys = keys[..., -self.budget :, :].clone()
            self.values = values[..., -self.budget :, :].clone()
        return keys, values

    def end_turn(self):
        if self.active is not None:
            self.keys = self.active[0][..., -self.budget :, :].clone()
            self.values = self.active[1][..., -self.budget :, :].clone()
            self.active = None

    def park(self):
        self.active = None
        self.keys = self.values = None

    def resume(self):
        """After a park: ``rebuild=turn`` rebuilds every token's K/V now and holds them for the turn that
        follows; ``rebuild=step`` waits for the next step, which rebuilds every token."""
        if self.rebuild != "turn" or self.active is not None or self.seen == 0:
            return
        self.active = self.rebuild_old(self.seen, self.seen)

    def token_states(self, old_state: str = "residual") -> list[str]:
        held = self.seen if self.active is not None else self.hot
        return [old_state] * (self.seen - held) + ["kv"] * held

    def state_tensors(self) -> tuple:
        return (self.keys, self.values, *(self.active or ()), *self.held_tensors())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


def rebuilding_persistent(geom, layer, seen: int, budget: int, rebuild: str) -> int:
    """K/V bytes a RebuildingLayer holds after `seen` tokens (not counting its store); `rebuild` "turn" while a
    turn is active, else "step" (what is held between turns)."""
    if rebuild == "turn":
        return seen * layer.kv_bytes_per_token  # every token's K/V while the turn lasts
    return min(seen, budget) * layer.kv_bytes_per_token


def rebuilding_transient(layer, seen_before: int, q: int, budget: int, rebuild: str, turn_start: bool) -> int:
    """The largest K/V buffer of one RebuildingLayer update beyond what it holds after the step: the rebuilt
    buffer that attention reads (``rebuild=step``), the turn's K/V being extended (``rebuild=turn``), or the
    hot window being replaced.  A lower bound of the layer's transient bytes (activations are not counted)."""
    kv = layer.kv_bytes_per_token
    if rebuild == "step" and seen_before > budget:
        return (seen_before + q) * kv
    if rebuild == "turn" and not turn_start:
        return seen_before * kv
    return min(seen_before, budget) * kv
