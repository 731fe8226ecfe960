"""AnchorKV: residuals only at anchor layers; the layers in between are replayed.

AnchorKV (2026).  Every token keeps its decoder-layer input (raw residual
`r_a`, before the input norm: the block adds it back, so replay needs it raw)
at the anchor layers `a` only; the anchor at layer 0 is the token embedding,
which the token id reproduces exactly, so with ``token_id_anchor=true``
(default) it costs 4 bytes.  The last `budget` tokens also keep K/V at every
global layer.  K/V of older tokens are rebuilt by replaying the decoder
layers from the nearest anchor at or below, as a causal prefill over the old
tokens that repeats the original chunking (each prefill chunk as one pass,
each decoded token as its own row): bit-equal (`torch.equal`) to the full
cache.

* ``replay=cascade`` runs each segment once and collects K/V at every global
  layer it passes; ``replay=naive`` restarts from the anchor for each target
  layer.  Both count decoder-layer passes.
* ``spacing=s`` puts anchors at 0, s, 2s, ...; ``anchors=0-8-16`` lists them;
  ``anchors=dp`` takes the exact dynamic programme of `geometry.place_anchors`
  with the replay cost of uniform spacing `s` as the bound (for interleaved
  sliding-window models, whose sliding layers keep their window as the full
  cache does and need no anchors).
* spacing=1 is KV-Direct's per-layer form (raw residuals); spacing=L with a
  token-id anchor is full recomputation from token ids: 4 bytes per token.
* ``mode=fast`` replays all old tokens as one chunk (not bit-exact; measured).
* ``rebuild=turn`` (default) rebuilds once per turn or resume and keeps full
  K/V while the turn lasts; ``rebuild=step`` replays at every step (bounded
  memory, very slow: a prefill of all old tokens per step).

Not counted in state bytes: the replay's own working buffers (its per-layer
K/V and hidden states), freed before the layer returns; they show in process
RSS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import compat
from ..geometry import ModelGeometry
from ..replay import LayerReplayer
from .base import SlidingLayer, Strategy, StrategyCache, StrategyError, storage_bytes, window_layer_bytes, window_layer_transient
from .rebuild import MODES, REBUILDS, RebuildingLayer, record_run, rebuilding_persistent, rebuilding_transient

REPLAYS = ("cascade", "naive")


class AnchorStore:
    """Per-session anchors (token ids and raw residuals) and the replay of segments on demand."""

    def __init__(self, replayer: LayerReplayer, anchors: list[int], token_id_anchor: bool, mode: str, replay: str,
                 global_layers: list[int]):
        self.replayer = replayer
        self.anchors = anchors
        self.token_id_anchor = token_id_anchor
        self.mode = mode
        self.replay_kind = replay
        self.token_ids: torch.Tensor | None = None  # (1, seen) int32, kept when layer 0 is a token-id anchor
        self.residuals: dict[int, torch.Tensor | None] = {a: None for a in anchors if a or not token_id_anchor}
        self.runs: list[list] = []
        self.seen = 0
        self.segment_of = {g: max(a for a in anchors if a <= g) for g in global_layers}
        self.targets = {a: [g for g in global_layers if self.segment_of[g] == a] for a in anchors}
        self.scratch: dict[int, dict[int, tuple]] = {}
        self.replaying = False

    def begin_step(self, ids: list[int], device):
        if self.token_id_anchor:
            new = torch.tensor([ids], dtype=torch.int32, device=device)
            self.token_ids = new if self.token_ids is None else torch.cat([self.token_ids, new], dim=1)
        record_run(self.runs, self.seen, len(ids))
        self.seen += len(ids)
        self.scratch = {}

    def capture_residual(self, anchor: int, x: torch.Tensor):
        held = self.residuals[anchor]
        self.residuals[anchor] = x if held is None else torch.cat([held, x], dim=1)

    def bytes(self) -> int:
        return storage_bytes(self.token_ids, *self.residuals.values())

    def scratch_bytes(self) -> int:
        return sum(storage_bytes(k, v) for kv in self.scratch.values() for k, v in kv.values())

    def _chunks(self, end: int) -> list[tuple[int, int]]:
        if self.mode == "fast":
            return [(0, end)]
        chunks = []
        for start, n, is_rows in self.runs:
            if start >= end:
                break
            if is_rows:
                chunks.extend((start + i, 1) for i in range(min(n, end - start)))
            else:
                chunks.append((start, n))
        return chunks

    def _start_hidden(self, anchor: int):
        if anchor == 0 and self.token_id_anchor:
            return lambda start, n: self.replayer.embed(self.token_ids[:, start:start + n].long())
        return lambda start, n: self.residuals[anchor][:, start:start + n]

    def old_kv(self, layer: int, end: int):
        """K/V of tokens 0..end-1 at global `layer`, replayed from its anchor."""
        anchor = self.segment_of[layer]
        if layer not in self.scratch.get(anchor, {}):
            targets = self.targets[anchor] if self.replay_kind == "cascade" else [layer]
            self.replaying = True
            try:
                rebuilt = self.replayer.replay(self._start_hidden(anchor), anchor, targets, self._chunks(end))
            finally:
                self.replaying = False
            # Copies when cut, so a rebuilt tensor never pins the replay's larger buffer.
            cut = lambda t: t if t.shape[-2] == end else t[..., :end, :].clone()
            self.scratch[anchor] = {g: (cut(k), cut(v)) for g, (k, v) in rebuilt.items()}
        return self.scratch[anchor].pop(layer)


class AnchoredLayer(RebuildingLayer):
    """A global layer whose old K/V come from the anchor store."""

    def __init__(self, store: AnchorStore, index: int, budget: int, rebuild: str):
        super().__init__(budget, rebuild)
        self.store = store
        self.index = index

    def rebuild_old(self, end: int):
        if end <= 0:
            return None, None
        return self.store.old_kv(self.index, end)

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.transient += self.store.scratch_bytes()  # rebuilt K/V of later layers of the segment, waiting
        return keys, values

    def token_states(self) -> list[str]:
        return super().token_states("anchor")


class AnchorCache(StrategyCache):
    def __init__(self, strategy, layers, store: AnchorStore):
        super().__init__(strategy, layers)
        self.store = store

    @property
    def replaying(self) -> bool:
        return self.store.replaying

    def begin_step(self, ids: list[int]):
        self.store.begin_step(ids, self.device)

    def wants_residuals(self) -> list[int]:
        return [a for a in self.store.residuals]

    def capture_residual(self, index: int, x: torch.Tensor):
        self.store.capture_residual(index, x)

    def persistent_bytes(self) -> int:
        return super().persistent_bytes() + self.store.bytes()

    def replay_counts(self) -> dict:
        return {"layer_passes": self.store.replayer.passes, "layer_calls": self.store.replayer.calls}


def rebuild_all(cache: AnchorCache, replay: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """K/V of every seen token at every global layer from the anchors alone, with `replay` (cascade|naive)."""
    store = cache.store
    saved, store.replay_kind, store.scratch = store.replay_kind, replay, {}
    try:
        return {g: store.old_kv(g, store.seen) for g in store.segment_of}
    finally:
        store.replay_kind, store.scratch = saved, {}


def _parse_anchors(text: str) -> list[int] | str:
    if text in ("", "uniform", "dp"):
        return text
    try:
        anchors = sorted({int(part) for part in text.split("-")})
    except ValueError:
        raise StrategyError(f"anchorkv: anchors={text!r} is not allowed; allowed: a dash-separated list of layer "
                            "indices starting at 0 (e.g. 0-8-16), 'uniform' or 'dp'") from None
    if anchors[0] != 0:
        raise StrategyError(f"anchorkv: anchors={text!r} must include layer 0 (the token-id anchor)")
    return anchors


@dataclass
class AnchorKV(Strategy):
    """AnchorKV with anchors every `spacing` layers (or a list, or the DP placement) and a hot window."""

    spacing: int = 4
    budget: int = 64
    anchors: str = "uniform"
    token_id_anchor: bool = True
    replay: str = "cascade"
    mode: str = "exact"
    rebuild: str = "turn"

    name = "anchorkv"

    def __post_init__(self):
        self.check_min(self.name, "spacing", self.spacing, 1)
        self.check_min(self.name, "budget", self.budget, 1)
        self.check_choice(self.name, "replay", self.replay, REPLAYS)
        self.check_choice(self.name, "mode", self.mode, MODES)
        self.check_choice(self.name, "rebuild", self.rebuild, REBUILDS)
        _parse_anchors(self.anchors)

    @property
    def claims_exact(self) -> bool:
        return self.mode == "exact"

    def anchor_layers(self, geom: ModelGeometry) -> list[int]:
        """The anchor layers for this model (the formulas ask at every step: computed once per geometry)."""
        cache = self.__dict__.setdefault("_anchors", {})
        if geom not in cache:
            cache[geom] = self._place(geom)
        return cache[geom]

    def _place(self, geom: ModelGeometry) -> list[int]:
        L = geom.num_layers
        parsed = _parse_anchors(self.anchors)
        if isinstance(parsed, list):
            if parsed[-1] >= L:
                raise StrategyError(f"anchorkv: anchors={self.anchors} has a layer >= the model's {L} layers")
            return parsed
        if self.spacing > L:
            raise StrategyError(f"anchorkv: spacing={self.spacing} must be between 1 and L={L}")
        uniform = geom.uniform_anchors(self.spacing)
        if parsed == "dp":
            bound = geom.replay_passes(uniform, cascade=True)
            return geom.place_anchors(max_passes=bound, token_id_anchor=self.token_id_anchor)[0]
        return uniform

    def build_cache(self, model) -> StrategyCache:
        geom = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
        anchors = self.anchor_layers(geom)
        globals_ = [layer.index for layer in geom.global_layers]
        store = AnchorStore(LayerReplayer(model), anchors, self.token_id_anchor, self.mode, self.replay, globals_)
        layers = [
            SlidingLayer(spec.sliding_window) if spec.is_sliding else AnchoredLayer(store, spec.index, self.budget, self.rebuild)
            for spec in compat.layer_specs(model.config)
        ]
        cache = AnchorCache(self, layers, store)
        cache.device = next(model.parameters()).device
        return cache

    def store_bytes_per_token(self, geom: ModelGeometry) -> int:
        anchors = self.anchor_layers(geom)
        return geom.anchor_bytes_per_token(anchors, self.token_id_anchor)

    def formula_between_turns(self, geom: ModelGeometry, seen: int) -> int:
        return self.formula_persistent(geom, seen, ended=True)

    def formula_persistent(self, geom: ModelGeometry, seen: int, parked: bool = False, ended: bool = False) -> int:
        total = seen * self.store_bytes_per_token(geom)
        for layer in geom.layers:
            if layer.is_sliding:
                total += window_layer_bytes(geom, layer.index, seen)
            elif not parked:
                total += rebuilding_persistent(geom, layer, seen, self.budget, "step" if ended else self.rebuild)
        return total

    def formula_parked(self, geom: ModelGeometry, seen: int) -> int:
        return self.formula_persistent(geom, seen, parked=True)

    def formula_transient(self, geom: ModelGeometry, seen_before: int, q: int, turn_start: bool = False) -> int:
        anchors = self.anchor_layers(geom)
        worst = 0
        for layer in geom.layers:
            if layer.is_sliding:
                worst = max(worst, window_layer_transient(geom, layer.index, seen_before, q))
                continue
            anchor = max(a for a in anchors if a <= layer.index)
            waiting = sum(1 for g in geom.global_layers if max(a for a in anchors if a <= g.index) == anchor)
            factor = waiting if self.replay == "cascade" else 1
            worst = max(worst, rebuilding_transient(layer, seen_before, q, self.budget, self.rebuild, turn_start, factor))
        return worst
