"""The strategies inside transformers' own `generate` and forward: `strategy_cache(model, spec)`.

    from kvdirect_app import strategy_cache
    with strategy_cache(model, "anchorkv:spacing=8:budget=64", verify=True) as cache:   # installs the hooks
        out = model.generate(ids, cache=cache, max_new_tokens=64, do_sample=False)
    print(cache.report())                                       # hooks removed on leaving; "verified": what was checked

The cache is the strategy's own `StrategyCache` (a transformers `Cache`, the
public Cache API through `compat.py`), the same object the studio's engine
runs.  Every way into it goes through the model's own forward, and inside the
block forward hooks on the model

* recognise a forward of this cache whatever carries it: `generate(...,
  cache=cache)` or `past_key_values=cache` (transformers renames the old
  name before the forward), or a direct `model(ids, cache=cache)`,
  `model(ids, past_key_values=cache)` or the cache as a positional argument;
* tell the cache where that forward begins and ends (`begin_step` /
  `end_step`: what a rebuild or a replay needs to know), and where a turn
  starts (`end_turn`: AnchorKV's and KV-Direct's `rebuild=turn` drop to their
  anchors or inputs, SnapKV compresses the new prompt): at each `generate`
  call whose prompt has several new tokens, and at a direct forward of several
  tokens after one-token steps (call `cache.end_turn()` yourself for any other
  boundary);
* serve a prompt that `generate` feeds in pieces (`prefill_chunk_size`) as
  one prompt: `generate`'s prefill (`_prefill`, wrapped on the model for the
  block) says how many prompt tokens it feeds, and every piece but the last
  is begun with `more_prompt=True`, so the eviction strategies evict nothing
  until the last piece and keep the tokens and bytes of the unchunked prompt;
* hand each decoder layer's input (the raw residual) and each attention
  module's input to the cache layers that keep them (`hooks.InputTap`), during
  this cache's forwards only: a forward of the same model with another cache
  (or none) inside the block leaves this one untouched;

and measure, from outside the strategy's code as the engine does
(`observe.py`): every piece of the cache's work runs in a region of the
cache's owner, so the allocator (the CPU allocator's ledger, CUDA's caching
allocator) counts what it holds after every forward and the highest it went
during it, and the clocks time each op.  Leaving the block removes every
hook; the model's modules and config are as they were.

Never silently something else: what the cache cannot serve exactly raises
`UnsupportedCall` (a `UserError`, one line saying what to do) before the
cache changes: input_ids of batch size 1 only (no inputs_embeds, no beam
search), no padding in `attention_mask`, `position_ids` (if given) the next
positions, `use_cache` left on; the cache's K/V reached outside a forward of
this model inside the block (its inner model, a layer or `.forward` called
directly, or after the block), a layer updated twice in one forward or not at
all, or a forward that raised part-way (the cache is then out of step and
refuses every later forward); and the Cache API's batch, crop and
past-recording operations (beam search, assisted decoding with an assistant
model, prompt lookup or early exit, contrastive decoding), and
`cache_implementation="paged"` (continuous batching, which would ignore the
cache).  `generate`'s other options leave what the cache sees alone (sampling
and logits processors, stopping criteria, `return_dict_in_generate` and the
`output_*` flags, streamers, classifier-free guidance, whose unconditional pass
runs on a cache of its own); `cache_implementation` beside `cache=` is refused
by transformers itself before any forward.

Exact means bit-exact: with `full`, exact `kvdirect` and exact `anchorkv`,
every K/V the cache hands attention has the bits the full cache's would have
(rebuilt with the original GEMM shapes; the row kernels are picked and checked
on entry, as the engine does in its native mode), so greedy `generate` gives
the same tokens as with transformers' `DynamicCache`.  `report()["claims_exact"]`
is that promise, the strategy's; `verify=True` checks it: a `Verifier` feeds
a shadow `DynamicCache` the same new K/V the model computes at every layer and
compares, bit for bit and row by row, what the cache hands attention with
what the shadow hands (the full cache's K/V of this very run), and
`report()["verified"]` says what it checked and what differed.  Without
`verify` nothing is checked (`"verified": None`) and nothing is paid.

One strategy cache per model at a time: the hooks and the model's lock are
per model, so a second `strategy_cache` on the same model (or an engine turn
running on it) is refused with an error saying so; caches on different
models work independently.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..kernels.replay import check_rows_kernels
from ..measure import ledger, meters
from ..measure.memory import harness
from ..measure.metrics import OPS
from ..measure.observe import Observer, Owner, watch
from ..models import compat
from ..models.geometry import ModelGeometry
from ..plain.errors import UserError
from ..strategies import StrategyCache, parse_spec
from ..strategies.base import Forward
from .hooks import InputTap, model_lock

CACHE = Owner("strategy_cache", "lane")  # the cache's work, in its observer's regions


class CacheInUse(UserError):
    """A second strategy cache (or an engine turn) on a model that already has one installed."""


class UnsupportedCall(UserError):
    """A way into a strategy cache that it cannot serve exactly; the message says what to do instead."""


@dataclass
class Ledger:
    """What the context manager counts of one cache, forward by forward."""

    forwards: list[Forward] = field(default_factory=list)
    held: list[int | None] = field(default_factory=list)  # bytes the allocator holds for the cache after each forward
    peak: list[int | None] = field(default_factory=list)  # ... the highest during each forward
    declared: list[int] = field(default_factory=list)  # bytes of the tensors the cache lists after each forward
    formula: list[int] = field(default_factory=list)  # the same from the config alone
    forward_s: list[float] = field(default_factory=list)  # wall time of each forward (the model's whole pass)
    turns: int = 0
    tokens: int = 0  # tokens the cache's forwards have fed so far
    decoding: bool = False  # the last forward (or `generate` prompt) was a one-token step
    starts_turn: bool = False  # the forward in progress is a turn's prompt (its first piece, when in pieces)
    prompt: bool = False  # the forward in progress is a turn's prompt or a piece of it
    more_prompt: bool = False  # more pieces of this prompt follow the forward in progress
    prompt_total: int = 0  # tokens of the prompt `generate`'s prefill feeds, while it runs (else 0)
    prompt_left: int = 0  # of those, the tokens not yet fed
    q: int = 0  # tokens of the forward in progress
    step: set[int] | None = None  # layers updated by the forward in progress; None: none of this cache's runs
    broken: bool = False  # a forward raised part-way: the layers are out of step
    started: float = 0.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its width (so -0.0 differs from 0.0 and a NaN equals its own bits)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _rows_differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(T,) True where token row t of a and b (1, H, T, d) differs in any bit."""
    return (_bits(a) != _bits(b)).any(dim=-1).any(dim=1)[0]


class Verifier:
    """Checks what a cache hands attention against what a full cache would hand it in the same run.

    A shadow `DynamicCache` (the model's own layer types: sliding layers keep their window) is fed the new
    K/V the model computes at each layer, the same tensors the strategy gets; what it hands attention is the
    full cache's K/V of this run, old tokens included.  Each layer's handed K/V are compared with it bit for
    bit, token row by token row.  Equal at every layer of every forward means attention read exactly what it
    would have read with the full cache, so the run is the full cache's run.

    A layer that hands attention fewer rows than the full cache (an eviction strategy once it has evicted)
    cannot be lined up row by row: its rows are counted as missing, none of them as checked (they are the
    stored K/V of the tokens it kept: nothing there was rebuilt).  Costs a full cache's K/V (dropped when the
    block ends) and one compare per layer and forward, on its own timer.
    """

    def __init__(self, model: torch.nn.Module):
        self.shadow = compat.DynamicCache(config=model.config)
        self.checked = self.rebuilt = self.mismatched = self.missing = 0
        self.first_mismatch: dict | None = None
        self.seconds = 0.0

    def expect(self, key_states: torch.Tensor, value_states: torch.Tensor, layer: int):
        """The full cache's K/V for this layer after this forward's new `key_states`/`value_states`."""
        t0 = time.perf_counter()
        with harness():
            out = self.shadow.update(key_states, value_states, layer)
        self.seconds += time.perf_counter() - t0
        return out

    def check(self, forward: int, layer: int, keys: torch.Tensor, values: torch.Tensor, expected, rebuilt: int,
              end: int):
        """`keys`/`values` (1, H, T, d) handed to attention at `layer` in forward `forward`, whose first `rebuilt`
        rows were rebuilt or replayed; `end`: tokens seen after this forward (row T-1 is token end-1)."""
        t0 = time.perf_counter()
        rk, rv = expected
        with harness():
            if keys.shape != rk.shape or values.shape != rv.shape:
                heads_dims = keys.shape[:-2] == rk.shape[:-2] and keys.shape[-1] == rk.shape[-1]
                if heads_dims and values.shape[-2] == keys.shape[-2] < rk.shape[-2]:  # fewer rows: evicted
                    self.missing += rk.shape[-2] - keys.shape[-2]
                else:
                    self.mismatched += rk.shape[-2]
                    self._first(forward, layer, None, False, f"shape {tuple(keys.shape)} != {tuple(rk.shape)}")
            else:
                rows = rk.shape[-2]
                self.checked += rows
                self.rebuilt += rebuilt
                if not (torch.equal(_bits(keys), _bits(rk)) and torch.equal(_bits(values), _bits(rv))):
                    bad = _rows_differing(keys, rk) | _rows_differing(values, rv)
                    self.mismatched += int(bad.sum())
                    row = int(bad.nonzero()[0, 0])
                    dk = float((keys[..., row, :].float() - rk[..., row, :].float()).abs().max())
                    dv = float((values[..., row, :].float() - rv[..., row, :].float()).abs().max())
                    self._first(forward, layer, end - rows + row, row < rebuilt, f"max |dK| {dk:g}, max |dV| {dv:g}")
        self.seconds += time.perf_counter() - t0

    def _first(self, forward: int, layer: int, token: int | None, rebuilt: bool, what: str):
        if self.first_mismatch is None:
            self.first_mismatch = {"forward": forward, "layer": layer, "token": token, "rebuilt": rebuilt,
                                   "what": what}

    def close(self):
        """Drop the shadow (a full cache's K/V); the counts stay for `report`."""
        self.shadow = None

    def report(self) -> dict:
        return {
            "checked_token_layers": self.checked,
            "rebuilt_token_layers": self.rebuilt,
            "mismatched_token_layers": self.mismatched,
            "missing_token_layers": self.missing,
            "exact": self.checked > 0 and self.mismatched == 0 and self.missing == 0,
            "first_mismatch": self.first_mismatch,
        }


class GenerateCache:
    """Mixed into the strategy's cache class by `strategy_cache`: the guards on every way in, and a report."""

    strategy = None
    ledger: Ledger
    geometry: ModelGeometry
    observer: Observer
    instrument: str = ""
    verifier: Verifier | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """The Cache API's update, only from a layer of this cache's forward, once per layer; checked under
        `verify`."""
        led = self.ledger
        if led.step is None:
            raise UnsupportedCall("strategy_cache: the cache was used outside a forward of its model inside the "
                                  "`with` block (its inner model, a layer or `.forward` called directly, or after "
                                  "the block); call `model(input_ids, cache=cache)` or `model.generate(..., "
                                  "cache=cache)` inside the block")
        if layer_idx in led.step:
            raise UnsupportedCall(f"strategy_cache: layer {layer_idx} was updated twice in one forward; run each "
                                  "decoder layer once per forward (the model's own forward), with a new forward "
                                  "for new tokens")
        led.step.add(layer_idx)
        # A copy, made in the cache's region, as the engine hands each lane its own: what the cache keeps of it is
        # then the cache's to the allocator (the model's own tensor is the forward's, and freed with it).
        if self.verifier is None:
            with self.observer.region(CACHE, "cache_update"):
                return super().update(key_states.clone(), value_states.clone(), layer_idx, *args, **kwargs)
        expected = self.verifier.expect(key_states, value_states, layer_idx)
        before = self.observer.rebuilt[CACHE.label]
        with self.observer.region(CACHE, "cache_update"):
            keys, values = super().update(key_states.clone(), value_states.clone(), layer_idx, *args, **kwargs)
        self.verifier.check(len(led.forwards), layer_idx, keys, values, expected,
                            self.observer.rebuilt[CACHE.label] - before, led.tokens + led.q)
        return keys, values

    is_croppable = False  # assisted decoding asks after its first forward, and transformers refuses it then

    def _refuse(self, what: str):
        raise UnsupportedCall(f"strategy_cache: {what} is not supported (it would reorder, repeat or cut the "
                              "cache's tokens); generate one sequence (greedy or sampled, no beams, no assistant)")

    def crop(self, *args, **kwargs):
        self._refuse("cropping the cache (assisted or contrastive decoding)")

    def batch_repeat_interleave(self, *args, **kwargs):
        self._refuse("a batch of copies (beam search, num_return_sequences)")

    def batch_select_indices(self, *args, **kwargs):
        self._refuse("selecting batch rows (contrastive search)")

    def reorder_cache(self, *args, **kwargs):
        self._refuse("reordering the batch (beam search)")

    def activate_past_recording(self, *args, **kwargs):
        # Assisted decoding asks for it before its first forward, which would feed the draft tokens into the cache.
        self._refuse("assisted decoding (assistant_model, prompt_lookup_num_tokens, assistant_early_exit)")

    def reset(self, *args, **kwargs):
        raise UnsupportedCall("strategy_cache: reset() is not supported (the strategy's stores and the report "
                              "would keep the old tokens); open a new strategy_cache for a new conversation")

    def end_turn(self):
        """A turn ended: the next forward starts a new one (called for you when a prompt follows decode steps)."""
        with self.observer.region(CACHE, "other"):
            super().end_turn()
        self.ledger.decoding = False

    def report(self) -> dict:
        """What the cache held and did in this block.

        Bytes (int) after each forward, measured by the allocator the tensors live in (`instrument`: the CPU
        allocator's ledger, CUDA's caching allocator; None where none can be read, and `instrument` says why):
        what it holds for the cache's work (`held`) and the highest that went during each forward (`peak`: the
        cache's state and its own buffers, not the model's activations); beside them, what the cache's tensors
        list (`declared`) and the strategy's formula from the config (`formula`): the last, the peak;
        `formula_matches_held`: measured and formula equal after every forward (a copy the strategy keeps and
        does not count makes it False); `formula_between_turns`: what it keeps once the turn ends.
        `rebuilt_token_layers`: K/V rebuilt (KV-Direct) or replayed (AnchorKV), in token x layer;
        `evicted_token_layers`: tokens a layer no longer holds in any form (the lossy strategies); `ms`: the
        cache's time per op (`metrics.OPS`: its update, rebuild, replay, scoring, setup), and the forwards' wall
        time, in milliseconds.  `claims_exact`: whether the strategy promises the full cache's bits (its class's
        promise, not a check); `verified`: what `verify=True` checked (`Verifier.report`), None when nothing was
        checked.
        """
        led = self.ledger
        states = [layer.token_states() for layer in self.layers]
        ops = {op: 0.0 for op in OPS if op not in ("attention", "shared")}
        for (owner, op), sec in self.observer.parts.items():
            if owner == CACHE:
                ops[op] = ops.get(op, 0.0) + sec
        ms = {**{op: 1e3 * sec for op, sec in ops.items()}, "forwards": 1e3 * sum(led.forward_s)}
        if self.verifier is not None:
            ms["verify"] = 1e3 * self.verifier.seconds
        measured = [h for h in led.held if h is not None]
        peaks = [p for p in led.peak if p is not None]
        return {
            "strategy": self.strategy.spec(),
            "claims_exact": bool(self.strategy.claims_exact),
            "verified": None if self.verifier is None else self.verifier.report(),
            "mode": getattr(self.strategy, "mode", None),
            "tokens_seen": self.get_seq_length(),
            "forwards": len(led.forwards),
            "turns": led.turns,
            "bytes": {
                "instrument": self.instrument,
                "held_last": led.held[-1] if led.held else None,
                "held_peak": max(measured) if measured else None,
                "peak": max(peaks) if peaks else None,
                "declared_last": led.declared[-1] if led.declared else 0,
                "formula_last": led.formula[-1] if led.formula else 0,
                "formula_peak": max(led.formula, default=0),
                "formula_matches_held": bool(measured) and led.formula == led.held,
                "declared_matches_formula": led.formula == led.declared,
                # What it keeps once the turn ends (AnchorKV's and KV-Direct's rebuild=turn drop to their anchors or
                # inputs then): by formula, for the tokens seen so far.
                "formula_between_turns": self.strategy.formula_between_turns(self.geometry, self.get_seq_length(),
                                                                             led.forwards),
            },
            "rebuilt_token_layers": self.observer.rebuilt[CACHE.label],
            "evicted_token_layers": sum(s.count("evicted") for s in states),
            "ms": ms,
        }


_CLASSES: dict[type, type] = {}


def _reporting(cache: StrategyCache) -> StrategyCache:
    """The same object, its class extended with `GenerateCache` (guards, report, end_turn) for the block."""
    cls = type(cache)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (GenerateCache, cls), {"__module__": cls.__module__})
    cache.__class__ = _CLASSES[cls]
    return cache


def _carries(cache, args, kwargs) -> bool:
    """Whether a forward was handed `cache`, under any name or position."""
    return any(v is cache for v in kwargs.values()) or any(a is cache for a in args)


def _check_call(call: dict, seen: int) -> int:
    """The token count of a forward of the cache (`call`: its arguments by name), or `UnsupportedCall` naming
    what to change; `seen`: tokens the cache has seen."""
    ids = call.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise UnsupportedCall("strategy_cache: pass input_ids (1, T) to a forward of the cache (not inputs_embeds: "
                              "the anchors and replays start from token ids)")
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise UnsupportedCall("strategy_cache: generate with input_ids of batch size 1 (one conversation) and at "
                              f"least one token; got {tuple(ids.shape)}")
    q = ids.shape[1]
    if call.get("use_cache") is False:
        raise UnsupportedCall("strategy_cache: use_cache=False re-feeds the whole sequence at every step; leave "
                              "use_cache on (the default) to generate with a strategy cache")
    positions = call.get("position_ids")
    if positions is not None:
        want = torch.arange(seen, seen + q, device=positions.device).view(1, q)
        if tuple(positions.shape) != (1, q) or not bool((positions == want).all()):
            raise UnsupportedCall(f"strategy_cache: position_ids must be the next positions {seen}..{seen + q - 1} "
                                  "(the cache has seen "
                                  f"{seen} tokens); leave them out, or feed only the tokens the cache has not seen")
    _check_mask(call.get("attention_mask"))
    return q


def _check_mask(mask):
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.all())):
        raise UnsupportedCall("strategy_cache: attention_mask must be all ones (one unpadded conversation, 2-D) or "
                              "left out")


def _prompt_tokens(input_ids, generation_config, model_kwargs: dict, past: int) -> int:
    """Tokens `generate`'s prefill (transformers 5.24's `GenerationMixin._prefill`) feeds, in one forward or in pieces
    of `prefill_chunk_size`: the tokens of `input_ids` after the `past` ones the cache has seen when the attention
    mask covers exactly `input_ids` (the whole conversation passed), else all of `input_ids` (only the new tokens
    passed, the mask covering the conversation).  0 when it feeds embeddings (the forward's check refuses them)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or model_kwargs.get("inputs_embeds") is not None:
        return 0
    mask = model_kwargs.get("attention_mask")
    mask_length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
    return input_ids.shape[1] - past if mask_length == input_ids.shape[1] else input_ids.shape[1]


_MISSING = object()


@contextlib.contextmanager
def strategy_cache(model: torch.nn.Module, spec: str, verify: bool = False) -> Iterator[StrategyCache]:
    """A KV-cache strategy for `model.generate(..., cache=cache)` and `model(input_ids, cache=cache)`.

    Parameters
    ----------
    model : a causal LM of a supported family (llama, mistral, qwen2/3, gemma2/3, olmo2), on any device.
    spec : a strategy spec, `name[:key=value]...`, e.g. ``"kvdirect:budget=64"``,
        ``"anchorkv:spacing=8:budget=64"``, ``"h2o:budget=64"`` (`kvdirect-bench strategies` lists them).
    verify : check every K/V the cache hands attention against a shadow full cache fed the same new K/V
        (`Verifier`): `report()["verified"]` says what was checked and what differed.  Costs a full cache's
        memory and a compare per layer and forward; off, nothing is checked (`"verified": None`).

    Yields the strategy's cache (a transformers `Cache`): pass it as `cache` (transformers 5's name) or
    `past_key_values` (the deprecated alias) to `generate` or to the model's forward, with batch size 1
    (input_ids (1, T)): `generate` once per turn with the whole conversation so far (its prompt in one forward,
    or in pieces with `prefill_chunk_size`: the same tokens and bytes), or forwards of the new tokens only; call
    `cache.report()` for what it held.  Leaving the block removes the hooks (and the model's `_prefill` and
    `generate_batch` wrappers); the cache keeps its state (report it after) and refuses further forwards.

    Raises `StrategyError` for a bad spec (one line naming the setting and its allowed values), `CacheInUse`
    when the model already has a strategy cache (or an engine turn) on it, and `UnsupportedCall` (from a
    forward or a Cache method) for any use the cache cannot serve exactly (the module's docstring lists them).
    """
    strategy = parse_spec(spec)
    lock = model_lock(model)
    if not lock.acquire(blocking=False):
        raise CacheInUse(f"strategy_cache({spec!r}): this model already has a strategy cache (or an engine turn) "
                         "on it; leave that `with` block first (the input hooks are per model), or load a second "
                         "copy of the model")
    handles, tap, verifier, wrapped, observer = [], None, None, {}, None
    try:
        device = next(model.parameters()).device
        check_rows_kernels(model)  # the row kernels a rebuild uses, picked (and checked) now
        try:
            meter, instrument = meters.for_device(device), None
            instrument = meter.name
        except ledger.Unavailable as e:
            meter, instrument = None, f"none: {e}"
        observer = Observer(device, meter)
        observer.register(CACHE)
        with observer.region(CACHE, "other"):
            cache = _reporting(watch(strategy.build_cache(model)))
        cache.model = model
        cache.observer, cache.instrument = observer, instrument
        cache.ledger = led = Ledger()
        cache.geometry = geom = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
        cache.verifier = verifier = Verifier(model) if verify else None
        tap = InputTap(model, device)
        signature = inspect.signature(model.forward)
        var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

        def named(args, kwargs) -> dict:
            call = dict(signature.bind_partial(*args, **kwargs).arguments)
            return {**call, **call.pop(var_kw, {})} if var_kw else call

        def before(module, args, kwargs):
            if not _carries(cache, args, kwargs):
                return  # another cache's forward (or none): not ours to count
            if led.broken or led.step is not None:
                raise UnsupportedCall("strategy_cache: an earlier forward (or generate's prompt fed in pieces) on this "
                                      "cache did not finish (it raised part-way, or this one runs inside it), so its "
                                      "layers are out of step; open a new strategy_cache for this conversation")
            try:
                call = named(args, kwargs)
            except TypeError:
                return  # arguments the forward itself refuses: it raises before any layer runs
            q = _check_call(call, led.tokens)
            ids = call["input_ids"]
            if led.prompt_total:  # a piece of the prompt `generate`'s prefill feeds (the whole of it, unchunked)
                if q > led.prompt_left:
                    raise UnsupportedCall(f"strategy_cache: generate's prefill fed a forward of {q} tokens where its "
                                          f"prompt had {led.prompt_left} of {led.prompt_total} left; pass "
                                          "prefill_chunk_size=None")
                first = led.prompt_left == led.prompt_total
                # Each generate call's prompt of several new tokens is a turn's, however many pieces feed it.
                starts = first and (not led.forwards or led.prompt_total > 1)
                prompt, more = starts or not first, q < led.prompt_left
            else:  # a direct forward: a prompt after decode steps starts a new turn
                starts = not led.forwards or (q > 1 and led.decoding)
                prompt, more = starts, False
            if starts and led.forwards:
                cache.end_turn()
            led.starts_turn, led.prompt, led.more_prompt = starts, prompt, more
            led.turns += starts
            led.q, led.step = q, set()
            led.started = time.perf_counter()
            tap.target(cache, region=lambda: observer.region(CACHE, "cache_update"))
            observer.reset_peaks([CACHE])
            with observer.region(CACHE, "other"):
                cache.begin_step(ids[0].tolist(), more)

        def after(module, args, kwargs, output):
            if led.step is None or not _carries(cache, args, kwargs):
                return
            tap.clear()
            if output is None:  # the forward raised (this hook is always called): some layers moved, some not
                led.broken, led.step = True, None
                return
            missed = sorted(set(range(len(cache.layers))) - led.step)
            led.step = None
            if missed:
                led.broken = True
                raise UnsupportedCall(f"strategy_cache: a forward left layers {missed} of the cache out (a model "
                                      "that skips layers); run every decoder layer, and open a new strategy_cache")
            q = led.q
            with observer.region(CACHE, "other"):
                cache.end_step()
            led.tokens += q
            led.forward_s.append(time.perf_counter() - led.started)
            led.forwards.append(Forward(q, prompt=led.prompt, open=led.more_prompt))
            if led.prompt_total:
                led.prompt_left -= q
                led.decoding = led.prompt_total == 1  # as the unchunked prompt would leave it
            else:
                led.decoding = q == 1
            seen = cache.get_seq_length()
            led.held.append(observer.held(CACHE))
            led.peak.append(observer.peak(CACHE))
            led.declared.append(observer.declared(cache))
            led.formula.append(strategy.formula_persistent(geom, seen, led.forwards))

        prefill_of_model = getattr(model, "_prefill", None)
        batch_of_model = getattr(model, "generate_batch", None)

        def prefill(input_ids, generation_config, model_kwargs, *args, **kwargs):
            """`generate`'s prefill: tells `before` how many prompt tokens it feeds (in pieces, with
            `prefill_chunk_size`), and checks after it that they were all fed."""
            if not _carries(cache, (), model_kwargs) or led.step is not None or led.prompt_total:
                return prefill_of_model(input_ids, generation_config, model_kwargs, *args, **kwargs)
            _check_mask(model_kwargs.get("attention_mask"))  # the whole prompt's, before a piece changes the cache
            total = max(0, _prompt_tokens(input_ids, generation_config, model_kwargs, cache.get_seq_length()))
            led.prompt_total = led.prompt_left = total
            try:
                out = prefill_of_model(input_ids, generation_config, model_kwargs, *args, **kwargs)
            except BaseException:
                # Refused or raised after some pieces: they wait for a last one that will not come.
                led.broken |= led.prompt_left < led.prompt_total
                led.prompt_total = led.prompt_left = 0
                raise
            left, led.prompt_total, led.prompt_left = led.prompt_left, 0, 0
            if left:  # its last piece never came: the layers wait for it
                led.broken = True
                raise UnsupportedCall(f"strategy_cache: generate's prefill fed {total - left} of its prompt's {total} "
                                      "tokens, so the cache's layers are out of step; pass prefill_chunk_size=None "
                                      "and open a new strategy_cache")
            return out

        def generate_batch(*args, **kwargs):
            if _carries(cache, args, kwargs):
                raise UnsupportedCall("strategy_cache: cache_implementation='paged' (continuous batching) runs a "
                                      "paged cache of its own and ignores this one; leave cache_implementation unset "
                                      "to generate with a strategy cache")
            return batch_of_model(*args, **kwargs)

        for name, wrapper, original in (("_prefill", prefill, prefill_of_model),
                                        ("generate_batch", generate_batch, batch_of_model)):
            if original is not None:
                wrapped[name] = model.__dict__.get(name, _MISSING)
                object.__setattr__(model, name, wrapper)
        handles.append(model.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(model.register_forward_hook(after, with_kwargs=True, always_call=True))
        yield cache
    finally:
        for name, previous in wrapped.items():
            if previous is _MISSING:
                object.__delattr__(model, name)
            else:
                object.__setattr__(model, name, previous)
        for h in handles:
            h.remove()
        if tap is not None:
            tap.close()
        if verifier is not None:
            verifier.close()
        if observer is not None:
            observer.close()
        lock.release()
