"""Forward hooks the engine puts on a shared model for one turn, and the per-model lock that guards them."""

from __future__ import annotations

import threading

import torch

from . import compat
from .metrics import clock
from .strategies import StrategyCache


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
    residual) to caches that replay from it, the attention input to cache layers that keep it, and time the
    attention modules.  Installed for one turn and removed after it; they stand aside while a cache
    replays layers of the model for itself."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cache: StrategyCache | None = None
        self.wants: set[int] = set()
        self.layers: set[int] = set()
        self.device = device
        self.attention_s = 0.0
        self._t0 = 0.0
        self.handles = []
        for i, layer in enumerate(compat.decoder_layers(model)):
            attn = compat.attention_module(layer)
            self.handles.append(layer.register_forward_pre_hook(self._residual(i), with_kwargs=True))
            self.handles.append(attn.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(attn.register_forward_hook(self._post))

    def _residual(self, index: int):
        def hook(module, args, kwargs):
            if index in self.layers and not self.cache.replaying:  # layers is empty until target()
                self.cache.before_layer(index, args[0] if args else kwargs["hidden_states"])

        return hook

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            if self.cache is None or self.cache.replaying:
                return
            if index in self.wants:
                x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                self.cache.layers[index].capture(x)
            self._t0 = clock(self.device)

        return hook

    def _post(self, module, args, output):
        if self.cache is not None and not self.cache.replaying:
            self.attention_s += clock(self.device) - self._t0

    def target(self, cache: StrategyCache):
        self.cache = cache
        self.wants = set(cache.wants_inputs())
        self.layers = set(cache.wants_layers())
        self.attention_s = 0.0

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []
