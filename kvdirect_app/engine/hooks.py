"""Forward hooks the engine puts on a shared model for one turn, and the per-model lock that guards them."""

from __future__ import annotations

import contextlib
import threading

import torch

from ..models import compat
from ..strategies import StrategyCache
from ..strategies.scored_attention import fit_mask

_MODEL_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.Lock:
    """One generation at a time per model object (hooks are per model).

    A plain Lock, not an RLock: a turn is a generator that a web server may
    advance from different worker threads, so the thread that releases the
    lock need not be the one that took it.
    """
    with _LOCKS_GUARD:
        return _MODEL_LOCKS.setdefault(id(model), threading.Lock())


class InputTap:
    """Forward hooks on every decoder layer and attention module: hand the decoder layer's input (the raw
    residual) to caches that replay from it, and the attention input to cache layers that keep it.  Installed
    for one turn and removed after it; they stand aside while a cache replays layers of the model for itself.

    Targets the rows of a pass (`target_rows`: each row's slice, copied, goes to that row's cache, in that
    row's owner's region), or one cache outside any pass (`target`: `strategy_cache`'s own forwards, whose
    deliveries run in `region()` when one is given).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.caches: list[StrategyCache] = []
        self.batch = None
        self.region = None
        self.wants: list[set[int]] = []
        self.layers: list[set[int]] = []
        self.device = device
        self.handles = []
        for i, layer in enumerate(compat.decoder_layers(model)):
            attn = compat.attention_module(layer)
            self.handles.append(layer.register_forward_pre_hook(self._residual(i), with_kwargs=True))
            self.handles.append(attn.register_forward_pre_hook(self._pre(i), with_kwargs=True))

    def _standing_aside(self) -> bool:
        return not self.caches or any(cache.replaying for cache in self.caches)

    def _each(self, wanted: list[set[int]], index: int, x: torch.Tensor, give):
        if self.batch is None:
            if index in wanted[0]:
                with self.region() if self.region is not None else contextlib.nullcontext():
                    give(self.caches[0], x.clone())  # a copy of its own, made in its region, as for a pass's rows
            return
        for i, cache in enumerate(self.caches):
            if index in wanted[i]:
                with self.batch.owned(i, "cache_update"):
                    give(cache, x[i : i + 1].clone())

    def _residual(self, index: int):
        def hook(module, args, kwargs):
            if not self._standing_aside():
                self._each(
                    self.layers,
                    index,
                    args[0] if args else kwargs["hidden_states"],
                    lambda cache, x: cache.before_layer(index, x),
                )

        return hook

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            if self._standing_aside():
                return
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self._each(self.wants, index, x, lambda cache, x: cache.layers[index].capture(x))
            if self.batch is None and kwargs.get("attention_mask") is not None:
                # One cache's own forward (`strategy_cache`, the model's own attention): the mask is sized by the
                # layer type's first layer; a layer holding fewer tokens takes its rightmost columns.
                keys = self.caches[0].layers[index].get_mask_sizes(x.shape[1])[0]
                return args, {
                    **kwargs,
                    "attention_mask": fit_mask(kwargs["attention_mask"], keys, self.caches[0].strategy.label, index),
                }

        return hook

    def target(self, cache: StrategyCache, region=None):
        self._target([cache], None)
        self.region = region

    def target_rows(self, batch):
        self._target([row.cache for row in batch.rows], batch)

    def clear(self):
        """Target nothing: every hook stands aside (a forward that is not the target's own hands it nothing)."""
        self._target([], None)

    def _target(self, caches: list[StrategyCache], batch):
        self.caches, self.batch, self.region = caches, batch, None
        self.wants = [set(cache.wants_inputs()) for cache in caches]
        self.layers = [set(cache.wants_layers()) for cache in caches]

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []
