"""What every strategy shares: the registry, spec parsing, and a measured Cache.

A strategy is a small dataclass (its settings, checked in `__post_init__`)
that builds a transformers `Cache` made of custom layers.  Subclasses register
themselves by their `name`, so a new strategy is one new file in this package.

Byte accounting (DESIGN.md, "Metrics"):

* persistent bytes: the storage of every tensor a cache layer holds between
  steps, measured as distinct `untyped_storage()` sizes, so a view that pins a
  larger buffer is counted at the buffer's size;
* transient bytes: buffers a layer builds during a step and drops after it
  (rebuilt K/V, and the K/V handed to attention when that is not a stored
  tensor); a step's peak is persistent after the step plus the largest
  layer's transient;
* each strategy also gives both numbers by formula from the config alone, and
  tests check that formula and measurement agree exactly.
"""

from __future__ import annotations

from ..errors import UserError
import copy
import dataclasses
import time
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import compat
from ..compat import Cache, DynamicLayer
from ..geometry import ModelGeometry
from ..instruments import COUNTS
from ..memory import harness


class Forward(typing.NamedTuple):
    """One forward of a lane, as the formulas see it: `q` tokens; `prompt`: part of a user turn's prompt (a
    prompt fed in pieces is several); `open`: more pieces of that prompt follow."""

    q: int
    prompt: bool = False
    open: bool = False


class StrategyError(UserError):
    """A strategy spec that cannot be built; the message names the setting and its allowed values."""


def storage_sizes(*tensors: torch.Tensor | None) -> dict[int, int]:
    """Address -> bytes of the distinct storages behind `tensors` (a view counts its whole buffer, once)."""
    out = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            out.setdefault(s.data_ptr(), s.nbytes())
    return out


def storage_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts its whole buffer, once)."""
    return sum(storage_sizes(*tensors).values())


class MeasuredLayer:
    """Mixin for cache layers: bytes held, transient bytes of the last update, optional comparison.

    When `reference` is set (a layer of the full cache that has already processed
    the same step on the same history), every update compares what this layer
    hands to attention with what the reference holds.
    """

    reference = None
    keep_handed = False  # set for one pass: keep the positions of what this layer hands attention (a snapshot)

    def handed_positions(self, count: int, end: int, device) -> torch.Tensor:
        """(1, 1, count) original positions of the `count` keys this layer handed attention in the pass that ended
        at position `end` (exclusive): the last `count` positions, for a layer that keeps every token or a window."""
        return torch.arange(end - count, end, device=device).view(1, 1, count)

    def init_measures(self):
        self.transient = 0
        self.rebuilt_compared = 0  # token-layers rebuilt while a reference was compared
        self.shape_mismatches = 0
        self.compare_s = 0.0
        self.cache_update_s = 0.0
        self.scoring_s = 0.0
        self.max_dk = 0.0
        self.max_dv = 0.0
        self.kv_equal = True
        self.compared = 0

    def state_tensors(self) -> tuple:
        """Every tensor the layer holds between steps."""
        return self.keys, self.values

    def state_bytes(self) -> int:
        return storage_bytes(*self.state_tensors())

    def compare(self, keys: torch.Tensor, values: torch.Tensor):
        """What this layer hands attention against what the reference layer holds after the same step.

        Shapes must match: a global layer that hands attention fewer (or more) tokens than the full cache
        holds is not equal, whatever its values.  Runs as measurement work (`memory.harness`): what it
        allocates is nobody's state.
        """
        ref = self.reference
        if ref is None or ref.keys is None:
            return
        t0 = time.perf_counter()
        COUNTS["compare"] += 1
        with harness():
            rk, rv = ref.keys, ref.values
            self.compared += 1
            if rk.shape != keys.shape or rv.shape != values.shape:
                self.kv_equal = False
                self.shape_mismatches += 1
            elif not (torch.equal(keys, rk) and torch.equal(values, rv)):
                self.kv_equal = False
                self.max_dk = max(self.max_dk, float((keys.float() - rk.float()).abs().max()))
                self.max_dv = max(self.max_dv, float((values.float() - rv.float()).abs().max()))
        self.compare_s += time.perf_counter() - t0


class FullLayer(MeasuredLayer, DynamicLayer):
    """transformers' `DynamicLayer`, measured."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.init_measures()

    def token_states(self) -> list[str]:
        return ["kv"] * self.get_seq_length()

    def update(self, key_states, value_states, *args, **kwargs):
        t0 = time.perf_counter()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.transient = 0
        self.cache_update_s += time.perf_counter() - t0
        self.compare(keys, values)
        return keys, values


class SlidingLayer(MeasuredLayer, compat.DynamicSlidingWindowLayer):
    """transformers' `DynamicSlidingWindowLayer`, measured, with the kept window compacted.

    The base class keeps a view of the last `window - 1` tokens into the
    concatenated buffer; copying it makes the held bytes exactly the window.
    The tensors handed to attention are those of the base class.
    """

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.init_measures()

    def state_tensors(self) -> tuple:
        return self.keys, self.values, getattr(self, "_sliding_window_tensor", None)

    def token_states(self) -> list[str]:
        kept = 0 if self.keys is None else self.keys.shape[-2]
        return ["evicted"] * (self.cumulative_length - kept) + ["kv"] * kept

    def update(self, key_states, value_states, *args, **kwargs):
        t0 = time.perf_counter()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.keys.untyped_storage().nbytes() > self.keys.numel() * self.keys.element_size():
            self.keys, self.values = self.keys.clone(), self.values.clone()
        # What attention reads here is a fresh concatenation of window and new tokens.
        fresh = keys.untyped_storage().data_ptr() != self.keys.untyped_storage().data_ptr()
        self.transient = storage_bytes(keys, values) if fresh else 0
        self.cache_update_s += time.perf_counter() - t0
        self.compare(self.keys, self.values)
        return keys, values


# transformers' DynamicSlidingWindowLayer keeps its window size as an int64 tensor: 8 bytes the allocator sees.
WINDOW_SIZE_TENSOR_BYTES = 8


def window_layer_bytes(geom: ModelGeometry, index: int, tokens: int) -> int:
    """Bytes a sliding layer holds after seeing `tokens` tokens (its last window - 1, and its window size)."""
    layer = geom.layers[index]
    return min(tokens, layer.sliding_window - 1) * layer.kv_bytes_per_token + WINDOW_SIZE_TENSOR_BYTES


def window_layer_transient(geom: ModelGeometry, index: int, seen_before: int, q: int) -> int:
    """A sliding layer hands attention a fresh concatenation once the window overflows."""
    layer = geom.layers[index]
    if seen_before + q <= layer.sliding_window - 1:
        return 0
    return (min(seen_before, layer.sliding_window - 1) + q) * layer.kv_bytes_per_token


class StrategyCache(Cache):
    """A transformers Cache whose layers are measured; built by `Strategy.build_cache`."""

    def __init__(self, strategy: "Strategy", layers: list):
        super().__init__(layers=layers)
        self.strategy = strategy

    # --- measurement -------------------------------------------------------
    def state_tensors(self) -> tuple:
        """Every tensor the cache holds between steps (its layers', and a shared store's)."""
        return tuple(t for layer in self.layers for t in layer.state_tensors())

    def persistent_bytes(self) -> int:
        return sum(layer.state_bytes() for layer in self.layers)

    def storage_sizes(self) -> list[int]:
        """Bytes of each distinct storage the cache holds (what a per-tensor allocator rounds)."""
        return list(storage_sizes(*self.state_tensors()).values())

    def transient_bytes(self) -> int:
        """Largest transient buffer of any layer during the last step."""
        return max((layer.transient for layer in self.layers), default=0)

    def take_timers(self) -> dict[str, float]:
        """Seconds spent per op inside the cache during the last step (then reset)."""
        out = {"recompute": 0.0, "replay": 0.0, "cache_update": 0.0, "scoring": 0.0, "compare": 0.0}
        for layer in self.layers:
            for key in out:
                attr = key + "_s"
                if hasattr(layer, attr):
                    out[key] += getattr(layer, attr)
                    setattr(layer, attr, 0.0)
        return out

    def compare_with(self, reference: Cache | None):
        for i, layer in enumerate(self.layers):
            layer.reference = None if reference is None else reference.layers[i]

    def kv_report(self) -> dict:
        compared = [layer for layer in self.layers if layer.compared]
        if not compared:
            return {"kv_exact": None, "max_abs_dk": None, "max_abs_dv": None, "layers_compared": 0,
                    "rebuilt_token_layers": 0, "shape_mismatches": 0}
        return {
            "layers_compared": len(compared),
            "kv_exact": all(layer.kv_equal for layer in compared),
            "max_abs_dk": max(layer.max_dk for layer in compared),
            "max_abs_dv": max(layer.max_dv for layer in compared),
            "rebuilt_token_layers": sum(layer.rebuilt_compared for layer in compared),
            "shape_mismatches": sum(layer.shape_mismatches for layer in compared),
        }

    kernels = None  # the run's `kernels.Kernels`; None: the model's own (native) kernels

    def use_kernels(self, kernels):
        """The run's kernels: under invariant kernels a rebuild or replay is one GEMM (one chunk) per layer."""
        self.kernels = kernels
        for layer in self.layers:
            if hasattr(layer, "use_kernels"):
                layer.use_kernels(kernels)

    # --- life cycle ----------------------------------------------------------
    replaying = False  # True while a cache replays layers of the model for itself (hooks stand aside)

    def wants_inputs(self) -> list[int]:
        """Layer indices whose attention input must be handed over before `update`."""
        return [i for i, layer in enumerate(self.layers) if hasattr(layer, "capture")]

    def wants_layers(self) -> list[int]:
        """Decoder-layer indices whose input (the raw residual) must be handed to `before_layer` before they run."""
        return []

    def before_layer(self, index: int, x: torch.Tensor):
        """Decoder layer `index` is about to run on `x` (1, q, d)."""

    def begin_step(self, ids: list[int], more_prompt: bool = False):
        """Called with the token ids of a forward, before it runs; `more_prompt`: this forward is a piece of a
        turn's prompt and more pieces follow (layers that evict wait for the last one)."""
        for layer in self.layers:
            if hasattr(layer, "prompt_open"):
                layer.prompt_open = more_prompt

    def end_step(self):
        """Called after a forward: drop whatever the step needed and the next one does not."""

    def park(self):
        """Keep only the persistent state (what the strategy promises to rebuild from)."""
        for layer in self.layers:
            if hasattr(layer, "park"):
                layer.park()

    def resume(self):
        """Rebuild what `park` dropped, exactly."""
        for layer in self.layers:
            if hasattr(layer, "resume"):
                layer.resume()

    def end_turn(self):
        for layer in self.layers:
            if hasattr(layer, "end_turn"):
                layer.end_turn()

    def fork(self) -> "StrategyCache":
        """An independent copy of the state.  Shared, not copied: the strategy, the reference's layers, and
        every model-side object the cache reaches, however deep (modules with their parameters and buffers,
        configs: an AnchorKV store reaches the whole model through its replayer)."""
        memo = model_side(self)
        for layer in self.layers:
            reference = getattr(layer, "reference", None)
            if reference is not None:
                memo[id(reference)] = reference
        memo[id(self.strategy)] = self.strategy
        if self.kernels is not None:
            memo[id(self.kernels)] = self.kernels
        twin = copy.deepcopy(self, memo)
        for layer in twin.layers:
            layer.reference = None
            layer.init_measures()
        return twin


def model_side(root) -> dict[int, object]:
    """Every model-side object reachable from `root`, by id (a deepcopy memo that shares them): each
    `nn.Module` with all its submodules, parameters and buffers, and each model config.  Tensors are leaves
    (a cache's own state); the walk follows containers and plain objects' attributes."""
    found: dict[int, object] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in found:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for part in (*obj.modules(), *obj.parameters(), *obj.buffers()):
                found[id(part)] = part
        elif isinstance(obj, compat.PretrainedConfig):
            found[id(obj)] = obj
        elif isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None), type)):
            continue
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found


def _coerce(value: str, typ, field: str, strategy: str):
    try:
        if typ is bool:
            if value.lower() in ("true", "1", "yes", "on"):
                return True
            if value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        return typ(value)
    except ValueError:
        raise StrategyError(f"{strategy}: setting {field}={value!r} is not a valid {typ.__name__}") from None


@dataclass
class Strategy:
    """Base of all strategies.  Subclasses set `name` and implement `build_cache` and the formulas."""

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = False  # claims K/V bit-equal to the full cache (tests hold it to that)
    registry: ClassVar[dict[str, type["Strategy"]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            Strategy.registry[cls.name] = cls

    # --- settings ------------------------------------------------------------
    @classmethod
    def settings(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    def spec(self) -> str:
        """Canonical spec: name then every non-default setting, e.g. `kvdirect:budget=64:mode=fast`."""
        parts = [self.name]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
        return ":".join(parts)

    @staticmethod
    def check_choice(strategy: str, field: str, value, allowed):
        if value not in allowed:
            raise StrategyError(f"{strategy}: {field}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")

    @staticmethod
    def check_min(strategy: str, field: str, value, minimum):
        if value < minimum:
            raise StrategyError(f"{strategy}: {field}={value} must be >= {minimum}")

    # --- the cache -----------------------------------------------------------
    def build_cache(self, model: torch.nn.Module) -> StrategyCache:
        raise NotImplementedError

    # The formulas take the config's geometry, the tokens seen and, for strategies whose state depends on how
    # the conversation was chunked (SnapKV compresses each prompt), `forwards`: a `Forward` for every forward so
    # far.
    def formula_persistent(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        """Bytes held after `seen` tokens, from the config alone."""
        raise NotImplementedError

    def formula_transient(self, geom: ModelGeometry, seen_before: int, q: int, turn_start: bool = False,
                          forwards: list | None = None) -> int:
        """Largest buffer of a layer beyond the state during a step of `q` tokens after `seen_before`: a lower
        bound of the step's transient bytes (activations are not counted)."""
        raise NotImplementedError

    def formula_between_turns(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        """Bytes held after a turn has ended (what a live session keeps while it waits for the user)."""
        return self.formula_persistent(geom, seen, forwards)

    def formula_parked(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        """Bytes held after `park()`; strategies that drop nothing hold what they always hold."""
        return self.formula_persistent(geom, seen, forwards)

    @property
    def label(self) -> str:
        """The spec as the user wrote it (parse_spec keeps it), else the canonical spec."""
        return getattr(self, "_label", None) or self.spec()

    @property
    def claims_exact(self) -> bool:
        """Whether this instance promises K/V bit-equal to the full cache."""
        return self.exact

    @property
    def notes(self) -> list[str]:
        """Settings adapted to fit each other (shown with the results, never silent)."""
        return []


def parse_spec(text: str) -> Strategy:
    """`name[:key=value]...` -> a Strategy instance; one clear error line on bad input."""
    from . import available  # noqa: F401  (imports every strategy module so the registry is full)

    text = text.strip()
    if not text:
        raise StrategyError(f"empty strategy spec; known strategies: {', '.join(sorted(Strategy.registry))}")
    name, *pairs = text.split(":")
    cls = Strategy.registry.get(name)
    if cls is None:
        raise StrategyError(f"unknown strategy {name!r}; known strategies: {', '.join(sorted(Strategy.registry))}")
    fields = cls.settings()
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise StrategyError(f"{name}: setting {pair!r} is not of the form key=value")
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise StrategyError(f"{name}: unknown setting {key!r}; allowed: {allowed}")
        kwargs[key] = _coerce(value, hints[key], key, name)
    strategy = cls(**kwargs)
    strategy._label = text
    return strategy


def parse_specs(text: str) -> list[Strategy]:
    """Comma-separated specs; duplicates are an error."""
    out, seen = [], set()
    for part in text.split(","):
        strategy = parse_spec(part)
        if strategy.spec() in seen:
            raise StrategyError(f"strategy {strategy.spec()!r} is listed twice")
        seen.add(strategy.spec())
        out.append(strategy)
    return out
