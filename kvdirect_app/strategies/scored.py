"""What every eviction strategy shares: a fixed budget of tokens per global layer, kept by score.

An eviction strategy writes one method, `score(step)`: a number per candidate
token (higher is kept).  This module does the rest, the same way for all of
them:

* Candidates of a step are the tokens the layer holds plus the step's new
  tokens.  Attention always sees all of them (so a prefill chunk attends to
  itself in full, as in the papers); only afterwards does the layer keep the
  `budget` best-scored candidates, ties going to the newer token.
* A user turn's prompt is one prefill, whatever the pieces the engine feeds
  it in (`--prefill-chunk`): nothing is evicted until its last piece, whose
  forward scores every candidate once (SnapKV's observation window is the
  end of the whole prompt: the layer keeps the last `prompt_window` attention
  inputs of the prompt across pieces for it).  So the kept tokens and bytes
  do not depend on the piece size.
* Keys are stored post-RoPE exactly as the model produced them and are never
  re-rotated; every kept token keeps its original absolute position, stored as
  int32 (counted in the state bytes).  `get_seq_length()` counts tokens *seen*,
  so new tokens get the right positions.
* Mask sizes: transformers places queries at `q_offset = get_seq_length()` =
  seen and keys at `kv_offset + index`.  With `stored` tokens kept,
  `get_mask_sizes(q)` returns `(stored + q, seen - stored)`: every stored key
  lands before every query and the chunk's own keys line up with its queries,
  so the causal mask inside a prefill chunk stays right after eviction (an
  offset of 0 would let a chunk's queries see up to `seen - stored` of its
  future tokens).
* Budgets per layer: a strategy may give each global layer its own budget
  (`layer_budgets`: PyramidKV's shrink with depth) or leave the first layers
  whole (`compresses`: KNorm skips layers 0 and 1, kept as the full cache keeps
  them).  The mask is built once per layer type, sized by the first global
  layer; budgets never grow with depth and skipped layers come first, so that
  layer holds the most tokens, and a layer holding fewer takes the mask's
  rightmost columns (`scored_attention.fit_mask`, in
  `lockstep.lanes_attention`): its stored keys, all before the queries,
  visible, the chunk's own keys causal.  The invariant kernels' block
  attention reads each layer's own keys as positions end-T..end-1, which is
  the same rule.
* Selection is per KV head (`per_head = True`: each KV head keeps its own
  `budget` tokens, as H2O and SnapKV do) or per layer (`per_head = False`: all
  heads keep the same tokens).  Grouped-query heads: the attention of the
  query heads of one group is *averaged* onto their KV head.
* Attention weights, for the strategies that need them, are computed inside
  the cache layer, never by switching the model to eager attention:
  `softmax(q K^T * module.scaling + causal mask)` in fp32 over the
  candidates, with Gemma 2's logit soft-capping (`tanh(x / cap) * cap`) where
  the module has one.  The queries: the engine's pass, which holds them,
  splits `update` into `add` (the candidates, for attention) and
  `settle(queries)` (score, evict) and hands the layer its row's queries as
  the model computed them; elsewhere (`generate`) `QueryProjector`
  (`scored_attention.py`) rebuilds them from the attention input the engine
  hands the layer (`capture`: q_proj, q_norm where the family has one, RoPE
  at the original positions, as `replay.KVProjector` does for keys), the
  same bits.  SnapKV's window at the end of a prompt fed in pieces reaches
  back into earlier pieces: those queries are rebuilt.
* Sliding-window layers (Gemma 2/3, Mistral) are left exactly as the full
  cache keeps them.

Bytes (persistent, per global layer): the kept tokens' K/V (`min(seen, budget)`
for a strategy that holds its budget at every step; the layer's own budget where
they differ; every token's K/V on a skipped layer, as the full cache), plus
per kept token and per selection row (a KV head, or the layer) its int32
position and each fp32 score buffer of the strategy (H2O's accumulated
attention).  Transient: when a step evicts, the candidate K/V, positions and
buffers handed over and dropped after it.  The scoring scratch (rebuilt
queries and their fp32 attention probabilities) is not counted, like the
attention's own workspace.

Eviction layers hand attention fewer tokens than the full cache, so an
eviction cache is not compared with it (`kv_comparable` is False: `kv_exact`
is None).  `ScoredLayer.score` is the seam the engine's observer times as
scoring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from ..models import compat
from ..models.compat import CacheLayerMixin
from ..models.geometry import ModelGeometry
from .base import (
    ContractError,
    Forward,
    FullLayer,
    SlidingLayer,
    Strategy,
    StrategyCache,
    window_layer_bytes,
    window_layer_transient,
)
from .scored_attention import QueryProjector, attention_probs

POSITION_DTYPE = torch.int32
POSITION_BYTES = 4
BUFFER_DTYPE = torch.float32
BUFFER_BYTES = 4
DECODES = ("grow", "hold")  # while decoding: keep every new token until the next prompt, or hold the budget


def per_layer(values: tuple | list, rank: int):
    """The entry of evicting global layer `rank` in per-layer values; a single entry stands for every layer."""
    return values[rank if len(values) > 1 else 0]


def keep_top(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices (1, G, budget), ascending, of the `budget` highest scores per row; ties keep the newer token.

    scores (1, G, T) over candidates in position order (oldest first).
    """
    if scores.shape[-1] == budget + 1:  # a decode step at the budget: each row's lowest goes, the oldest of a tie
        kept = torch.arange(budget, device=scores.device)  # (what the sort keeps: argmin gives the first minimum)
        return kept + (kept >= scores.argmin(dim=-1, keepdim=True))
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :budget]  # newest first
    return (scores.shape[-1] - 1 - order).sort(dim=-1).values


def take(states: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The kept candidates of states (1, n_kv, T, d), keep (1, G, K) from `keep_top` (G 1: every head keeps the
    same; G n_kv: each its own): what ``states.gather(2, keep[..., None].expand(...))`` gives, the same copies, by
    one `index_select` (a gather through an expanded index reads ~3x slower here)."""
    _, n_kv, t, d = states.shape
    if keep.shape[1] == 1:
        return states.index_select(2, keep[0, 0])
    rows = keep[0] + torch.arange(0, n_kv * t, t, device=keep.device).view(n_kv, 1)
    return states.reshape(n_kv * t, d).index_select(0, rows.flatten()).view(1, n_kv, -1, d)


@dataclass
class Step:
    """What `score()` sees of one forward on one layer.

    positions : (1, G, T) original positions of the candidates (stored, then new), oldest first.
    keys : (1, n_kv, T, d_h) the candidates' keys, as the model produced them (post-RoPE), in the same order.
    seen : tokens seen after this step; the step's queries sit at positions seen - q .. seen - 1.
    q : new tokens in this step (a prefill chunk, or 1 when decoding).
    prefill : whether this forward belongs to a turn's prompt (then `evicts` only at its last piece).
    prompt_tokens : tokens of the turn's prompt so far, this forward's included (0 when decoding).
    evicts : whether candidates exceed the budget (some will be dropped).
    buffers : the strategy's per-token score buffers (1, G, T); new tokens start at 0.  Write the
        updated buffers back here; they are kept along with their tokens.
    state : per-layer values the strategy keeps between steps (plain Python numbers).
    """

    positions: torch.Tensor
    keys: torch.Tensor
    seen: int
    q: int
    prefill: bool
    evicts: bool
    prompt_tokens: int
    buffers: dict[str, torch.Tensor]
    state: dict
    _attend: Callable[[int], torch.Tensor] | None = field(default=None, repr=False)

    def attention(self, n: int) -> torch.Tensor:
        """Probabilities (1, n_kv, groups, n, T) of the last `n` queries over the candidates: this forward's,
        and at the end of a prompt fed in pieces up to the scorer's `prompt_window` of the prompt's earlier ones."""
        if self._attend is None:
            raise RuntimeError("this strategy does not capture attention inputs (needs_attention = False)")
        return self._attend(n)


class ScoredLayer(CacheLayerMixin):
    """A global-attention layer holding at most its budget of tokens, chosen by the strategy's `score()`.

    `rank` of `count`: its place among the strategy's evicting global layers (what a per-layer budget reads).
    Without `capture`, the engine hands it no attention input: the strategy scores without attention.
    """

    is_sliding = False

    def __init__(self, strategy: "Scored", projector: QueryProjector | None, rank: int = 0, count: int = 1):
        super().__init__()
        self.strategy, self.rank, self.count = strategy, rank, count
        self.projector = projector  # shared with the model, never copied (see StrategyCache.fork)
        self.positions: torch.Tensor | None = None  # (1, G, stored) int32
        self.buffers: dict[str, torch.Tensor] = {}  # name -> (1, G, stored) fp32
        self.state: dict = {}
        self.seen = 0
        self.prefill = True  # the next forward starts (or continues) a turn's prompt
        self.prompt_open = False  # set by the cache before a forward: more pieces of this prompt follow
        self.keep_all = False  # set by the cache before a forward: nothing is evicted in it (`Forward.keep`)
        self.prompt_tokens = 0
        self.prompt_tail: torch.Tensor | None = None  # (1, <= prompt_window, d): the open prompt's last inputs
        self.pending: torch.Tensor | None = None
        self.adding: tuple | None = None  # a forward's candidates between `add` and `settle`

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        _, n_kv, _, d_h = key_states.shape
        rows = n_kv if self.strategy.per_head else 1
        self.keys = key_states.new_zeros(1, n_kv, 0, d_h)
        self.values = value_states.new_zeros(1, n_kv, 0, value_states.shape[-1])
        self.positions = torch.zeros(1, rows, 0, dtype=POSITION_DTYPE, device=self.device)
        self.buffers = {
            name: torch.zeros(1, rows, 0, dtype=BUFFER_DTYPE, device=self.device)
            for name in self.strategy.token_buffers
        }
        self.is_initialized = True

    def _attend(self, keys, positions, x: torch.Tensor | None, earlier, given: torch.Tensor | None):
        def attend(n: int) -> torch.Tensor:
            start = self.seen - n
            if given is not None and n <= given.shape[2]:  # the forward's own queries, as the model computed them
                queries = given[:, :, -n:]
            else:
                if x is None:
                    raise RuntimeError(
                        f"{self.strategy.name}: the attention input was not handed over; "
                        "run the model through engine.InputTap"
                    )
                inputs = x if earlier is None or n <= x.shape[1] else torch.cat([earlier, x], dim=1)
                if n > inputs.shape[1]:
                    raise RuntimeError(f"{self.strategy.name}: {n} queries asked for, {inputs.shape[1]} kept")
                queries = self.projector.queries(inputs[:, -n:], start)
            query_positions = torch.arange(start, self.seen, device=keys.device)
            projector, causal = self.projector, n > 1  # one query: every candidate is at or before it
            return attention_probs(
                queries, keys, query_positions, positions, projector.scaling, projector.softcap, causal=causal
            )

        return attend

    def score(self, step: Step) -> torch.Tensor | None:
        """The strategy's scores of this step's candidates (`Scored.score`)."""
        return self.strategy.score(step)

    @property
    def takes_queries(self) -> bool:
        """Whether a caller that holds the forward's queries may call `add`, then `settle(queries)`, in place of
        `update`: a layer that scores with attention and whose class keeps this `update` (the engine's pass)."""
        return self.projector is not None and type(self).update is ScoredLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        candidates = self.add(key_states, value_states)
        self.settle()
        return candidates

    def add(self, key_states, value_states) -> tuple[torch.Tensor, torch.Tensor]:
        """`update`'s first half: the forward's candidates (the held tokens, then its new ones) for attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.adding is not None:
            raise RuntimeError(f"{self.strategy.name}: a forward's tokens were added before the last was settled")
        q, rows = key_states.shape[-2], self.positions.shape[1]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        new_positions = torch.arange(self.seen, self.seen + q, dtype=POSITION_DTYPE, device=self.device)
        positions = torch.cat([self.positions, new_positions.expand(1, rows, q)], dim=-1)
        buffers = {name: torch.cat([buf, buf.new_zeros(1, rows, q)], dim=-1) for name, buf in self.buffers.items()}
        self.seen += q
        self.prompt_tokens = self.prompt_tokens + q if self.prefill else 0
        self.adding = keys, values, positions, buffers, q
        return keys, values

    def settle(self, queries: torch.Tensor | None = None):
        """`update`'s second half: the candidates scored and the best kept.  `queries` (1, H, q, d_h): the forward's
        queries as the model computed them (post-RoPE), which `Step.attention` reads instead of rebuilding them."""
        (keys, values, positions, buffers, q), self.adding = self.adding, None
        x, self.pending = self.pending, None
        limits = self.strategy.limits(Forward(q, self.prefill, self.prompt_open, self.keep_all), self.seen, self.count)
        limit = None if limits is None else per_layer(limits, self.rank)
        evicts = limit is not None and keys.shape[-2] > limit
        earlier = self.prompt_tail
        attend = None if self.projector is None else self._attend(keys, positions, x, earlier, queries)
        step = Step(
            positions, keys, self.seen, q, self.prefill, evicts, self.prompt_tokens, buffers, self.state, attend
        )
        scores = self.score(step)
        self._check(scores, step, limit)
        window = self.strategy.prompt_window
        if self.prompt_open and window and x is not None:  # the end of this prompt may need these queries
            inputs = x if earlier is None else torch.cat([earlier, x], dim=1)
            self.prompt_tail = inputs[:, -window:].clone()
        else:
            self.prompt_tail = None
        self.prefill = self.prompt_open
        if evicts:
            keep = keep_top(scores, limit)  # (1, G, limit)
            self.keys, self.values = take(keys, keep), take(values, keep)
            self.positions = positions.gather(2, keep)
            self.buffers = {name: buf.gather(2, keep) for name, buf in step.buffers.items()}
        else:
            self.keys, self.values, self.positions, self.buffers = keys, values, positions, step.buffers

    def _where(self, step: Step) -> str:
        what = "a prompt piece" if step.prefill else "a decode step" if step.q == 1 else "a forward"
        return (
            f"evicting layer {self.rank + 1} of {self.count}, at {what} of {step.q} token(s) ending at token "
            f"{step.seen}"
        )

    def _check(self, scores, step: Step, limit: int | None):
        """The contract of `score()`, checked where it is cheap (every forward): one score per candidate and
        selection row, no NaN, and scores wherever the step evicts."""
        want = tuple(step.positions.shape)
        if scores is None:
            if step.evicts:
                raise ContractError(
                    f"{self.strategy.label}: score() returned None at {self._where(step)}, which "
                    f"evicts to {limit}; allowed: scores of shape {want} where the step evicts"
                )
            return
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != want:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ContractError(
                f"{self.strategy.label}: score() returned {got} at {self._where(step)}; allowed: "
                f"shape {want}, one score per candidate (1, selection rows, candidates)"
            )
        if scores.is_floating_point() and bool(torch.isnan(scores).any()):
            raise ContractError(
                f"{self.strategy.label}: score() returned NaN at {self._where(step)}; allowed: "
                "numbers, or +inf to protect a token"
            )

    def end_turn(self):
        self.prefill, self.prompt_open, self.prompt_tokens, self.prompt_tail = True, False, 0, None

    def token_states(self) -> list[str]:
        """ "kv" for a token some KV head still holds, "evicted" otherwise."""
        kept = set() if self.positions is None else set(self.positions.flatten().tolist())
        return ["kv" if t in kept else "evicted" for t in range(self.seen)]

    def state_tensors(self) -> tuple:
        return self.keys, self.values, self.positions, self.prompt_tail, *self.buffers.values()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = 0 if self.keys is None else self.keys.shape[-2]
        return stored + query_length, self.seen - stored

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class AttentionScoredLayer(ScoredLayer):
    """A scored layer whose strategy needs attention weights: the engine hands it the attention input."""

    def capture(self, x: torch.Tensor):
        """Receives the attention input (1, q, d) of this forward, just before `update`."""
        self.pending = x


@dataclass
class Scored(Strategy):
    """Base of the eviction strategies: `budget` tokens kept per global layer, chosen by `score()`.

    Subclasses set `name`, `per_head`, `needs_attention`, `token_buffers` and
    write `score(step) -> (1, G, T)` scores (higher is kept; `inf` protects);
    `holds`, `compresses` and `layer_budgets` say when and where a budget holds
    and how large it is per layer.
    """

    budget: int = 64

    exact = False
    per_head: ClassVar[bool] = False  # one selection per KV head (True) or per layer (False)
    needs_attention: ClassVar[bool] = False  # score() calls step.attention()
    token_buffers: ClassVar[tuple[str, ...]] = ()  # fp32 per-token buffers kept with their tokens

    def scored_queries(self, q: int) -> int:
        """How many of a forward's `q` queries `score()` asks attention for at most (the memory guard's bound)."""
        return q

    @property
    def prompt_window(self) -> int:
        """Attention inputs of an open prompt kept across its pieces: the queries `score()` asks for at its end."""
        return 0

    def __post_init__(self):
        self.check_min(self.name, "budget", self.budget, 1)

    def holds(self, prefill: bool) -> bool:
        """Whether a finished forward (the first of a turn when `prefill`) holds the layer to its budget; False
        keeps every candidate (SnapKV while decoding)."""
        return True

    def compresses(self, index: int) -> bool:
        """Whether the global layer at decoder index `index` evicts; False keeps it whole, as the full cache."""
        return True

    def layer_budgets(self, count: int, seen: int) -> tuple[int, ...]:
        """Tokens each of the `count` evicting global layers (shallowest first) keeps after a forward that ends at
        `seen` tokens, or a single entry for all of them (`per_layer`).  Never larger for a deeper layer: the first
        global layer sizes the mask (module docstring)."""
        return (self.budget,)

    def limits(self, forward: Forward, seen: int, count: int = 1) -> tuple[int, ...] | None:
        """`layer_budgets` after `forward`, which ends at `seen` tokens; None keeps every candidate (a prompt piece
        that more pieces follow, a forward that keeps everything, or one the strategy does not hold)."""
        if forward.open or forward.keep or not self.holds(forward.prompt):
            return None
        return self.layer_budgets(count, seen)

    def score(self, step: Step) -> torch.Tensor | None:
        """Scores (1, G, T) of the candidates, higher kept; may return None when `step.evicts` is False."""
        raise NotImplementedError

    # --- the cache -----------------------------------------------------------
    def global_layer(self, projector: QueryProjector | None = None, rank: int = 0, count: int = 1) -> ScoredLayer:
        if self.needs_attention:
            return AttentionScoredLayer(self, projector, rank, count)
        return ScoredLayer(self, None, rank, count)

    def slots(self, layers) -> dict[int, tuple[int, int]]:
        """Decoder index -> (rank, count) of each evicting global layer, from specs or geometry layers (`index`,
        `is_sliding`); the other global layers are kept whole."""
        evicting = [layer.index for layer in layers if not layer.is_sliding and self.compresses(layer.index)]
        return {index: (rank, len(evicting)) for rank, index in enumerate(evicting)}

    def build_cache(self, model) -> StrategyCache:
        specs = compat.layer_specs(model.config)
        slots = self.slots(specs)
        layers = []
        for spec in specs:
            if spec.is_sliding:
                layers.append(SlidingLayer(spec.sliding_window))
            elif spec.index not in slots:
                layers.append(FullLayer())
            else:
                projector = QueryProjector(model, spec) if self.needs_attention else None
                layers.append(self.global_layer(projector, *slots[spec.index]))
        return StrategyCache(self, layers)

    # --- bytes ---------------------------------------------------------------
    def _token_bytes(self, layer) -> int:
        """Bytes one kept token costs on a global layer: K/V, its position and buffers per selection row."""
        rows = layer.num_kv_heads if self.per_head else 1
        return layer.kv_bytes_per_token + rows * (POSITION_BYTES + BUFFER_BYTES * len(self.token_buffers))

    def stored(self, seen: int, forwards: list | None, count: int = 1) -> list[int]:
        """Tokens each of the `count` evicting global layers holds after `forwards` (`base.Forward` each: a
        prompt's pieces are held until its last one), as `layer_budgets` gives them (`per_layer`); without
        `forwards`, the budget-holding rule."""
        if forwards is None:
            return [min(seen, budget) for budget in self.layer_budgets(count, seen)]
        held, grown, total = [0] * len(self.layer_budgets(count, seen)), 0, 0
        for f in forwards:
            total += f.q
            limits = self.limits(f, total, count)
            grown += f.q  # added to every layer at the next limit (decoding steps that keep everything: at the end)
            if limits is not None:
                held, grown = [min(h + grown, b) for h, b in zip(held, limits)], 0
        return [h + grown for h in held]

    def _tail(self, forwards: list | None) -> int:
        """Attention inputs held for the end of an open prompt (`prompt_window`) after `forwards`."""
        if not forwards or not forwards[-1].open or not self.prompt_window:
            return 0
        tokens = 0
        for f in reversed(forwards):
            if not f.prompt:
                break
            tokens += f.q
        return min(tokens, self.prompt_window)

    def formula_persistent(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        total, tail, slots = 0, self._tail(forwards), self.slots(geom.layers)
        held = self.stored(seen, forwards, len(slots))
        for layer in geom.layers:
            if layer.is_sliding:
                total += window_layer_bytes(geom, layer.index, seen)
            elif layer.index not in slots:
                total += seen * layer.kv_bytes_per_token
            else:
                held_here = per_layer(held, slots[layer.index][0])
                total += held_here * self._token_bytes(layer) + tail * geom.residual_bytes
        return total

    def formula_transient(
        self, geom: ModelGeometry, seen_before: int, q: int, turn_start: bool = False, forwards: list | None = None
    ) -> int:
        before = forwards[:-1] if forwards else forwards
        this = forwards[-1] if forwards else Forward(q, prompt=turn_start)
        worst, slots = 0, self.slots(geom.layers)
        held, limits = self.stored(seen_before, before, len(slots)), self.limits(this, seen_before + q, len(slots))
        for layer in geom.layers:
            if layer.is_sliding:
                worst = max(worst, window_layer_transient(geom, layer.index, seen_before, q))
                continue
            if layer.index not in slots:  # kept whole: the full cache's layer, no buffer beyond its state
                continue
            rank = slots[layer.index][0]
            # While the candidates are concatenated, the held tensors are still alive beside them; when the step
            # evicts, the kept ones are gathered while both are.
            held_here = per_layer(held, rank)
            candidates = held_here + q
            evicts = limits is not None and candidates > per_layer(limits, rank)
            worst = max(worst, (held_here + (candidates if evicts else 0)) * self._token_bytes(layer))
        return worst
