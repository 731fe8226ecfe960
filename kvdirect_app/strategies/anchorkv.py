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

* ``replay=cascade`` (default) runs the old tokens through each layer once,
  interleaved with the step's own forward: just before decoder layer `j`
  runs, the old tokens' hidden states go through layer `j` (chunk by chunk,
  as originally computed), its K/V wait for layer `j`'s attention, which
  drops them when done; at each anchor the hidden states restart from the
  stored anchor.  A rebuilding step so holds about one hidden state per old
  token and one layer's K/V, not the whole model's.  ``replay=naive``
  replays from the anchor up to each global layer when that layer asks.
  Both count decoder-layer passes.
* ``spacing=s`` puts anchors at 0, s, 2s, ...; ``anchors=0-8-16`` lists them;
  ``anchors=dp`` takes the exact dynamic programme of `geometry.place_anchors`
  with the replay cost of uniform spacing `s` as the bound (for interleaved
  sliding-window models, whose sliding layers keep their window as the full
  cache does and need no anchors).
* spacing=1 is KV-Direct's per-layer form (raw residuals); spacing=L with a
  token-id anchor is full recomputation from token ids: 4 bytes per token.
* ``mode=fast`` replays all old tokens as one chunk (not bit-exact; measured).
* ``rebuild=turn`` (default) rebuilds once per turn or resume and keeps full
  K/V while the turn lasts: anchors *plus* full K/V during a turn;
  ``rebuild=step`` replays at every step: bounded peak (the anchors, the hot
  window, one layer's K/V and the carried hidden states), and a replay of all
  old tokens per generated token.

Everything the replay allocates is the lane's, by the allocator's ledger, and
counted in the step's measured peak; the formula's transient bytes are the
carried hidden states plus one layer's K/V buffer.  `carry` and `rebuild_all`
are the seams the engine's observer times as replay.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..kernels.invariant import native
from ..kernels.replay import LayerReplayer
from ..models import compat
from ..models.geometry import ModelGeometry
from ..plain import rss
from .base import SlidingLayer, Strategy, StrategyCache, StrategyError, window_layer_bytes, window_layer_transient
from .rebuild import (
    MODES,
    REBUILDS,
    REPLAY_ROWS,
    RebuildingLayer,
    chunks_of,
    covered,
    rebuilding_persistent,
    rebuilding_transient,
    record_run,
)

REPLAYS = ("cascade", "naive")
# A cascade step that replays this many old tokens hands the heap's freed pages back to the OS after each layer:
# its buffers (chunk activations, tens of MiB) are freed layer after layer in a pattern that spreads glibc's heap,
# and without it the process's RSS rose ~120 MiB during a step whose live peak was 39 MiB (SmolLM2, 2,500 old
# tokens); with it, ~40 MiB, at ~5-10% of the step's time (rss.py).
RELEASE_FROM = 256


class AnchorStore:
    """Per-session anchors (token ids and raw residuals) and the replay of old tokens' K/V from them.

    With ``replay=cascade`` the replay is interleaved with the step's own
    forward: at each decoder layer (handed over by the engine's input tap
    before the layer runs) the old tokens' hidden states go through that one
    layer, chunk by chunk as originally computed, and the layer's K/V wait in
    a buffer for its attention, which drops them when done.  A step so holds
    one hidden state per old token and one layer's K/V at a time.  At each
    anchor the hidden states restart from the stored anchor.  ``replay=naive``
    replays from the anchor up to each global layer when that layer asks.
    """

    def __init__(
        self,
        replayer: LayerReplayer,
        anchors: list[int],
        token_id_anchor: bool,
        mode: str,
        replay: str,
        global_layers: list[int],
    ):
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
        self.last_target = {a: max(t) for a, t in self.targets.items() if t}
        self.anchor_of = [max(a for a in anchors if a <= j) for j in range(len(replayer.specs))]
        # Layers a cascade step runs the old tokens through: from each anchor up to its segment's last global layer.
        self.carried = {j for j, a in enumerate(self.anchor_of) if a in self.last_target and j <= self.last_target[a]}
        self.replaying = False
        # Per step: the span to rebuild, the carried hidden states and the K/V waiting for their layer.
        self.span: tuple[int, int] = (0, 0)
        self.hidden: torch.Tensor | None = None
        self.ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def one_chunk(self) -> bool:
        """Replay all old tokens as one chunk: the fast mode's approximation."""
        return self.mode == "fast"

    def _kernels(self):
        """The fast mode replays with the model's own kernels (one chunk, its GEMMs and attention), whatever the
        run's: its error against the exact replay is measured, not promised."""
        return native() if self.one_chunk else contextlib.nullcontext()

    def _chunks(self, end: int) -> list[tuple[int, int]]:
        """How a replay of tokens 0..end-1 is called: the original forwards' shapes (native kernels), calls of
        `REPLAY_ROWS` tokens (invariant kernels: the same bits whatever the grouping), or one call (fast)."""
        return chunks_of(
            self.runs,
            end,
            one_chunk=self.one_chunk,
            rows=REPLAY_ROWS if self.replayer.invariant and not self.one_chunk else None,
        )

    def begin_step(self, ids: list[int], device, span: tuple[int, int]):
        """Before a forward of `ids`: store the ids; `span` = (old tokens to rebuild, rows attention reads)."""
        if self.token_id_anchor:
            new = torch.tensor([ids], dtype=torch.int32, device=device)
            self.token_ids = new if self.token_ids is None else torch.cat([self.token_ids, new], dim=1)
        self.span = span
        self.chunks = self._chunks(span[0])
        self.cover = covered(self.chunks)
        record_run(self.runs, self.seen, len(ids))
        self.seen += len(ids)

    def end_step(self):
        self.hidden, self.ready = None, {}
        self.replayer.forget_inputs()

    def before_layer(self, j: int, x: torch.Tensor):
        """Decoder layer `j` of this session's forward is about to run on `x` (1, q, d), its new tokens' input."""
        end, total = self.span
        if end and self.replay_kind == "cascade" and j in self.carried:
            self.carry(j, end, total)
        if j in self.residuals:
            held = self.residuals[j]
            self.residuals[j] = x if held is None else torch.cat([held, x], dim=1)

    def carry(self, j: int, end: int, total: int):
        """The old tokens' hidden states through decoder layer `j` (cascade replay), its K/V kept for its
        attention."""
        a = self.anchor_of[j]
        self.replaying = True
        try:
            if j == a:
                self.hidden = self.start_hidden(a, self.cover)
            last = self.last_target[a]
            with self._kernels():
                kv = self.replayer.replay_layer(
                    j, self.hidden, self.chunks, total if j in self.segment_of else None, carry=j < last
                )
            if j in self.segment_of:
                self.ready[j] = kv
            if j == last:
                self.hidden = None
        finally:
            self.replaying = False
        if end >= RELEASE_FROM:
            rss.release()

    def start_hidden(self, anchor: int, end: int) -> torch.Tensor:
        """Hidden states (1, end, d) entering layer `anchor` for tokens 0..end-1, a fresh tensor (the replay
        writes each layer's output over it)."""
        if anchor == 0 and self.token_id_anchor:
            return self.replayer.embed(self.token_ids[:, :end].long())
        return self.residuals[anchor][:, :end].clone()

    def tensors(self) -> tuple:
        return self.token_ids, *self.residuals.values()

    def old_kv(self, layer: int, end: int, capacity: int):
        """K/V buffers of global `layer`, tokens 0..end-1 filled: carried up this step, or replayed now."""
        if layer in self.ready:
            return self.ready.pop(layer)
        anchor = self.segment_of[layer]
        chunks = self._chunks(end)
        self.replaying = True
        try:
            hidden = self.start_hidden(anchor, covered(chunks))
            with self._kernels():
                return self.replayer.replay(hidden, anchor, [layer], chunks, capacity)[layer]
        finally:
            self.replaying = False

    def rebuild_all(self, end: int, replay: str | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """K/V of tokens 0..end-1 at every global layer from the anchors alone, outside a forward, segment by
        segment (``cascade``: each segment once; ``naive``: from the anchor again for every global layer)."""
        chunks = self._chunks(end)
        out = {}
        self.replaying = True
        try:
            for anchor, targets in self.targets.items():
                groups = [targets] if (replay or self.replay_kind) == "cascade" else [[g] for g in targets]
                for group in groups:
                    if group:
                        hidden = self.start_hidden(anchor, covered(chunks))
                        with self._kernels():
                            out.update(self.replayer.replay(hidden, anchor, group, chunks, end))
        finally:
            self.replaying = False
            self.replayer.forget_inputs()
        return out


class AnchoredLayer(RebuildingLayer):
    """A global layer whose old K/V come from the anchor store."""

    rebuild_op = "replay"

    def __init__(self, store: AnchorStore, index: int, budget: int, rebuild: str):
        super().__init__(budget, rebuild)
        self.store = store
        self.index = index

    def rebuild_old(self, end: int, capacity: int):
        return self.store.old_kv(self.index, end, capacity)

    def token_states(self) -> list[str]:
        """Old tokens: "anchor" at an anchor layer (it stores their residual, or at layer 0 their ids), else
        "replayed" (nothing of them is held here; their K/V come from the anchor below)."""
        return super().token_states("anchor" if self.index in self.store.anchors else "replayed")


class AnchorCache(StrategyCache):
    def __init__(self, strategy, layers, store: AnchorStore):
        super().__init__(strategy, layers)
        self.store = store
        self.globals = [layer for layer in layers if isinstance(layer, AnchoredLayer)]

    @property
    def replaying(self) -> bool:
        return self.store.replaying

    def begin_step(self, ids: list[int], more_prompt: bool = False, keep: bool = False):
        super().begin_step(ids, more_prompt, keep)
        span = self.globals[0].rebuild_span(len(ids)) if self.globals else (0, 0)
        self.store.begin_step(ids, self.device, span)

    def end_step(self):
        self.store.end_step()

    def wants_layers(self) -> list[int]:
        return list(range(len(self.layers)))

    def use_kernels(self, kernels):
        super().use_kernels(kernels)
        self.store.replayer.invariant = kernels.invariant

    def before_layer(self, index: int, x: torch.Tensor):
        self.store.before_layer(index, x)

    def state_tensors(self) -> tuple:
        return (*super().state_tensors(), *self.store.tensors())

    def resume(self):
        """``rebuild=turn``: every global layer's K/V, replayed once from the anchors, held for the turn."""
        if self.strategy.rebuild != "turn" or self.store.seen == 0 or not self.globals:
            return
        kv = self.store.rebuild_all(self.store.seen)
        for layer in self.globals:
            layer.active = kv.pop(layer.index)


def rebuild_all(cache: AnchorCache, replay: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """K/V of every seen token at every global layer from the anchors alone, with `replay` (cascade|naive)."""
    return cache.store.rebuild_all(cache.store.seen, replay)


def _parse_anchors(text: str) -> list[int] | str:
    if text in ("", "uniform", "dp"):
        return text
    try:
        anchors = sorted({int(part) for part in text.split("-")})
    except ValueError:
        raise StrategyError(
            f"anchorkv: anchors={text!r} is not allowed; allowed: a dash-separated list of layer "
            "indices starting at 0 (e.g. 0-8-16), 'uniform' or 'dp'"
        ) from None
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
    kv_comparable = True

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
            SlidingLayer(spec.sliding_window)
            if spec.is_sliding
            else AnchoredLayer(store, spec.index, self.budget, self.rebuild)
            for spec in compat.layer_specs(model.config)
        ]
        cache = AnchorCache(self, layers, store)
        cache.device = next(model.parameters()).device
        return cache

    def store_bytes_per_token(self, geom: ModelGeometry) -> int:
        anchors = self.anchor_layers(geom)
        return geom.anchor_bytes_per_token(anchors, self.token_id_anchor)

    def formula_between_turns(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        return self.formula_persistent(geom, seen, ended=True)

    def formula_persistent(
        self, geom: ModelGeometry, seen: int, forwards: list | None = None, parked: bool = False, ended: bool = False
    ) -> int:
        total = seen * self.store_bytes_per_token(geom)
        for layer in geom.layers:
            if layer.is_sliding:
                total += window_layer_bytes(geom, layer.index, seen)
            elif not parked:
                total += rebuilding_persistent(geom, layer, seen, self.budget, "step" if ended else self.rebuild)
        return total

    def formula_parked(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        return self.formula_persistent(geom, seen, parked=True)

    def formula_transient(
        self, geom: ModelGeometry, seen_before: int, q: int, turn_start: bool = False, forwards: list | None = None
    ) -> int:
        old = seen_before - min(seen_before, self.budget)
        rebuilds = old > 0 and (self.rebuild == "step" or turn_start)
        hidden = old * geom.residual_bytes if rebuilds else 0  # the old tokens' hidden states, carried up
        worst = seen_before * geom.residual_bytes if len(self.anchor_layers(geom)) > 1 else 0  # an anchor extended
        for layer in geom.layers:
            if layer.is_sliding:
                worst = max(worst, window_layer_transient(geom, layer.index, seen_before, q))
            else:
                worst = max(
                    worst, hidden + rebuilding_transient(layer, seen_before, q, self.budget, self.rebuild, turn_start)
                )
        return worst
