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

Here: `strategy_cache` itself and the cache's side (`GenerateCache`, mixed
into the strategy's cache class for the block: the guards on the Cache API
and the report).  The model's side, the hooks and wrappers the block puts on
the model and what they count, is `cache_hooks.py` (`CacheHooks`, `Ledger`);
`verify=True`'s check is `verifier.py`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..kernels.replay import check_rows_kernels
from ..measure import ledger, meters
from ..measure.observe import Observer, watch
from ..measure.timing import OPS
from ..models.geometry import ModelGeometry
from ..plain.errors import UserError
from ..strategies import StrategyCache, parse_spec
from .cache_hooks import CACHE, CacheHooks, Ledger, UnsupportedCall
from .hooks import model_lock
from .verifier import Verifier

__all__ = ["CacheInUse", "UnsupportedCall", "Verifier", "strategy_cache"]


class CacheInUse(UserError):
    """A second strategy cache (or an engine turn) on a model that already has one installed."""


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
            raise UnsupportedCall(
                "strategy_cache: the cache was used outside a forward of its model inside the "
                "`with` block (its inner model, a layer or `.forward` called directly, or after "
                "the block); call `model(input_ids, cache=cache)` or `model.generate(..., "
                "cache=cache)` inside the block"
            )
        if layer_idx in led.step:
            raise UnsupportedCall(
                f"strategy_cache: layer {layer_idx} was updated twice in one forward; run each "
                "decoder layer once per forward (the model's own forward), with a new forward "
                "for new tokens"
            )
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
        self.verifier.check(
            len(led.forwards),
            layer_idx,
            keys,
            values,
            expected,
            self.observer.rebuilt[CACHE.label] - before,
            led.tokens + led.q,
        )
        return keys, values

    is_croppable = False  # assisted decoding asks after its first forward, and transformers refuses it then

    def _refuse(self, what: str):
        raise UnsupportedCall(
            f"strategy_cache: {what} is not supported (it would reorder, repeat or cut the "
            "cache's tokens); generate one sequence (greedy or sampled, no beams, no assistant)"
        )

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
        raise UnsupportedCall(
            "strategy_cache: reset() is not supported (the strategy's stores and the report "
            "would keep the old tokens); open a new strategy_cache for a new conversation"
        )

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
        cache's time per op (`timing.OPS`: its update, rebuild, replay, scoring, setup), and the forwards' wall
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
                "formula_between_turns": self.strategy.formula_between_turns(
                    self.geometry, self.get_seq_length(), led.forwards
                ),
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


@contextlib.contextmanager
def strategy_cache(
    model: torch.nn.Module, spec: str, verify: bool = False, question_after: bool = False
) -> Iterator[StrategyCache]:
    """A KV-cache strategy for `model.generate(..., cache=cache)` and `model(input_ids, cache=cache)`.

    Parameters
    ----------
    model : a causal LM of a supported family (llama, mistral, qwen2/3, gemma2/3, olmo2), on any device.
    spec : a strategy spec, `name[:key=value]...`, e.g. ``"kvdirect:budget=64"``,
        ``"anchorkv:spacing=8:budget=64"``, ``"h2o:budget=64"`` (`kvdirect-bench strategies` lists them).
    verify : check every K/V the cache hands attention against a shadow full cache fed the same new K/V
        (`Verifier`): `report()["verified"]` says what was checked and what differed.  Costs a full cache's
        memory and a compare per layer and forward; off, nothing is checked (`"verified": None`).
    question_after : kvpress's setting (its pipeline, and `bench tasks --question after`): the first prompt the
        cache is fed (a forward, or `generate`'s prompt in one or more pieces) is the context and is compressed as
        usual; every token after it (the question, then the answer, and any later turn) is read with nothing
        evicted.  Feed the context alone first (``model(context_ids, cache=cache)``), then ``generate`` with the
        context and the question: the question continues the context's turn, as in the engine.

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
        raise CacheInUse(
            f"strategy_cache({spec!r}): this model already has a strategy cache (or an engine turn) "
            "on it; leave that `with` block first (the input hooks are per model), or load a second "
            "copy of the model"
        )
    hooks, verifier, observer = None, None, None
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
        cache.ledger = Ledger()
        cache.geometry = geometry = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
        cache.verifier = verifier = Verifier(model) if verify else None
        hooks = CacheHooks(model, cache, strategy, observer, geometry, device, question_after=question_after)
        hooks.install()
        yield cache
    finally:
        if hooks is not None:
            hooks.remove()
        if verifier is not None:
            verifier.close()
        if observer is not None:
            observer.close()
        lock.release()
