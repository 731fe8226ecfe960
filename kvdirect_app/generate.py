"""The strategies inside transformers' own `generate`: `strategy_cache(model, spec)`.

    from kvdirect_app import strategy_cache
    with strategy_cache(model, "anchorkv:spacing=8:budget=64") as cache:   # installs the input taps
        out = model.generate(ids, cache=cache, max_new_tokens=64, do_sample=False)
    print(cache.report())                                                  # taps removed on leaving

The cache is the strategy's own `StrategyCache` (a transformers `Cache`, the
public Cache API through `compat.py`), the same object the studio's engine
runs.  Inside the block, forward hooks on the model

* hand each decoder layer's input (the raw residual) and each attention
  module's input to the cache layers that keep them (`hooks.InputTap`),
* tell the cache where a forward begins and ends (`begin_step`/`end_step`:
  what a rebuild or a replay needs to know), and that a new turn starts when
  a forward of several tokens follows decode steps (`end_turn`: AnchorKV's
  and KV-Direct's `rebuild=turn` drop to their anchors or inputs, SnapKV
  compresses the new prompt),

and count what the cache holds after every forward.  Leaving the block removes
every hook; the model's modules and config are as they were.

Exact means bit-exact: with `full`, exact `kvdirect` and exact `anchorkv`,
greedy `generate` gives the same tokens as with transformers' `DynamicCache`,
because every K/V the cache hands attention has the bits the full cache's
would have (rebuilt with the original GEMM shapes; the row kernels are picked
and checked on entry, as the engine does in its native mode).

One strategy cache per model at a time: the hooks and the model's lock are
per model, so a second `strategy_cache` on the same model (or an engine turn
running on it) is refused with an error saying so; caches on different
models work independently.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from . import compat
from .errors import UserError
from .geometry import ModelGeometry
from .hooks import InputTap, model_lock
from .replay import check_rows_kernels
from .strategies import StrategyCache, parse_spec
from .strategies.base import Forward

OPS = ("recompute", "replay", "cache_update", "scoring", "compare")


class CacheInUse(UserError):
    """A second strategy cache (or an engine turn) on a model that already has one installed."""


@dataclass
class Ledger:
    """What the context manager counts of one cache, forward by forward."""

    forwards: list[Forward] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # bytes the cache's tensors hold after each forward
    formula: list[int] = field(default_factory=list)  # the same from the config alone
    transient: list[int] = field(default_factory=list)  # largest buffer of a layer beyond the state, per forward
    ops_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OPS, 0.0))
    forward_s: list[float] = field(default_factory=list)  # wall time of each forward (the model's whole pass)
    turns: int = 0
    decoding: bool = False  # the last forward was a one-token step
    starts_turn: bool = False  # the forward in progress is a turn's prompt
    started: float = 0.0


class GenerateCache:
    """Mixed into the strategy's cache class by `strategy_cache`: a report of what it held and did."""

    strategy = None
    ledger: Ledger
    geometry: ModelGeometry

    def end_turn(self):
        """A turn ended: the next forward starts a new one (called for you when a prompt follows decode steps)."""
        super().end_turn()
        self.ledger.decoding = False

    def report(self) -> dict:
        """What the cache held and did in this block.

        Bytes (int) of the cache's tensors after each forward, measured from their storages (`held`, what the
        allocator holds for them but its rounding) and by the strategy's formula from the config (`formula`):
        the last, the peak, and the peak with the largest transient buffer of a step (a lower bound of the
        step's peak; activations are not counted); `formula_between_turns`: what it keeps once the turn ends.  The allocator itself is traced by `kvdirect-bench run`
        (`--memory trace`), not here.  `rebuilt_token_layers`: K/V rebuilt (KV-Direct) or replayed (AnchorKV),
        in token x layer; `evicted_token_layers`: tokens a layer no longer holds in any form (the lossy
        strategies); `ms`: seconds per op inside the cache, and the forwards' wall time, in milliseconds.
        """
        led = self.ledger
        states = [layer.token_states() for layer in self.layers]
        peak_step = max((h + t for h, t in zip(led.held, led.transient)), default=0)
        return {
            "strategy": self.strategy.spec(),
            "exact": bool(self.strategy.claims_exact),
            "mode": getattr(self.strategy, "mode", None),
            "tokens_seen": self.get_seq_length(),
            "forwards": len(led.forwards),
            "turns": led.turns,
            "bytes": {
                "held_last": led.held[-1] if led.held else 0,
                "held_peak": max(led.held, default=0),
                "formula_last": led.formula[-1] if led.formula else 0,
                "formula_peak": max(led.formula, default=0),
                "formula_matches_held": led.formula == led.held,
                # What it keeps once the turn ends (AnchorKV's and KV-Direct's rebuild=turn drop to their anchors or
                # inputs then): by formula, for the tokens seen so far.
                "formula_between_turns": self.strategy.formula_between_turns(self.geometry, self.get_seq_length(),
                                                                             led.forwards),
                "peak_with_transient": peak_step,
            },
            "rebuilt_token_layers": sum(getattr(layer, "rebuilt_total", 0) for layer in self.layers),
            "evicted_token_layers": sum(s.count("evicted") for s in states),
            "ms": {**{op: 1e3 * s for op, s in led.ops_s.items()}, "forwards": 1e3 * sum(led.forward_s)},
        }


_CLASSES: dict[type, type] = {}


def _reporting(cache: StrategyCache) -> StrategyCache:
    """The same object, its class extended with `GenerateCache` (report, end_turn) for the block."""
    cls = type(cache)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (GenerateCache, cls), {"__module__": cls.__module__})
    cache.__class__ = _CLASSES[cls]
    return cache


def _ids(args, kwargs) -> torch.Tensor | None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids if isinstance(ids, torch.Tensor) else None


@contextlib.contextmanager
def strategy_cache(model: torch.nn.Module, spec: str) -> Iterator[StrategyCache]:
    """A KV-cache strategy for `model.generate(..., past_key_values=cache)`.

    Parameters
    ----------
    model : a causal LM of a supported family (llama, mistral, qwen2/3, gemma2/3, olmo2), on any device.
    spec : a strategy spec, `name[:key=value]...`, e.g. ``"kvdirect:budget=64"``,
        ``"anchorkv:spacing=8:budget=64"``, ``"h2o:budget=64"`` (`kvdirect-bench strategies` lists them).

    Yields the strategy's cache (a transformers `Cache`): pass it as `cache` to `generate` (transformers 5's
    name; `past_key_values`, the old one, is a deprecated alias) with batch
    size 1 (input_ids (1, T)), once per turn with the whole conversation so far; call `cache.report()` for
    what it held.  Leaving the block removes the hooks; the cache keeps its state (report it after).

    Raises `StrategyError` for a bad spec (one line naming the setting and its allowed values) and
    `CacheInUse` when the model already has a strategy cache (or an engine turn) on it.
    """
    strategy = parse_spec(spec)
    lock = model_lock(model)
    if not lock.acquire(blocking=False):
        raise CacheInUse(f"strategy_cache({spec!r}): this model already has a strategy cache (or an engine turn) "
                         "on it; leave that `with` block first (the input hooks are per model), or load a second "
                         "copy of the model")
    handles, tap = [], None
    try:
        device = next(model.parameters()).device
        check_rows_kernels(model)  # the row kernels a rebuild uses, picked (and checked) now
        cache = _reporting(strategy.build_cache(model))
        cache.ledger = led = Ledger()
        cache.geometry = geom = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
        tap = InputTap(model, device)
        tap.target(cache)

        def before(module, args, kwargs):
            if kwargs.get(compat.CACHE_KWARG) is not cache:
                return  # another cache's forward (or none): not ours to count
            ids = _ids(args, kwargs)
            if ids is None or ids.shape[0] != 1:
                raise UserError("strategy_cache: generate with input_ids of batch size 1 (one conversation); "
                                f"got {None if ids is None else tuple(ids.shape)}")
            q = ids.shape[1]
            led.starts_turn = not led.forwards or (q > 1 and led.decoding)
            if led.starts_turn and led.forwards:
                cache.end_turn()  # a prompt after decode steps: a new turn
            led.turns += led.starts_turn
            led.started = time.perf_counter()
            cache.begin_step(ids[0].tolist(), False)

        def after(module, args, kwargs, output):
            if kwargs.get(compat.CACHE_KWARG) is not cache:
                return
            q = _ids(args, kwargs).shape[1]
            cache.end_step()
            led.forward_s.append(time.perf_counter() - led.started)
            led.forwards.append(Forward(q, prompt=led.starts_turn))
            led.decoding = q == 1
            seen = cache.get_seq_length()
            led.held.append(cache.persistent_bytes())
            led.formula.append(strategy.formula_persistent(geom, seen, led.forwards))
            led.transient.append(cache.transient_bytes())
            for op, s in cache.take_timers().items():
                led.ops_s[op] = led.ops_s.get(op, 0.0) + s

        handles.append(model.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(model.register_forward_hook(after, with_kwargs=True))
        yield cache
    finally:
        for h in handles:
            h.remove()
        if tap is not None:
            tap.close()
        lock.release()
