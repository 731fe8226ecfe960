"""What every strategy shares: the registry the classes enter, the cache and its reference layers (parsing a spec
into an instance is `parsing.py`'s, so this module imports none of the families).

A strategy is a small dataclass (its settings, checked in `__post_init__`)
that builds a transformers `Cache` made of custom layers.  Subclasses register
themselves by their `name`, so a new strategy is one new file in this package.

A strategy only caches.  What it holds is measured from outside (`observe.py`:
the allocator's ledger, the clocks, the comparison with the full cache); what
it *lists* (`state_tensors`) and its formulas from the config alone
(`formula_persistent`, `formula_transient`...) are the cross-checks the
measurement is held to.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..models import compat
from ..models.compat import Cache, DynamicLayer
from ..models.geometry import ModelGeometry
from ..plain.errors import UserError


class Forward(typing.NamedTuple):
    """One forward of a lane, as the formulas see it: `q` tokens; `prompt`: part of a user turn's prompt (a
    prompt fed in pieces is several); `open`: more pieces of that prompt follow; `keep`: nothing is evicted in it
    (the question and answer read after a compressed context, kvpress's setting: `Engine.turn(question=...)`)."""

    q: int
    prompt: bool = False
    open: bool = False
    keep: bool = False


class StrategyError(UserError):
    """A strategy spec that cannot be built; the message names the setting and its allowed values."""


class ContractError(UserError):
    """A strategy broke what the engine relies on (its scores' shape, finite scores, its budget, masks that fit);
    one line naming the strategy, the rule and the step.  The run stops: a figure past it would not mean what it
    says."""


class FullLayer(DynamicLayer):
    """transformers' `DynamicLayer`: every token's K/V."""

    def token_states(self) -> list[str]:
        return ["kv"] * self.get_seq_length()

    def state_tensors(self) -> tuple:
        """Every tensor the layer holds between steps."""
        return self.keys, self.values


class SlidingLayer(compat.DynamicSlidingWindowLayer):
    """transformers' `DynamicSlidingWindowLayer`, with the kept window compacted.

    The base class keeps a view of the last `window - 1` tokens into the
    concatenated buffer; copying it makes the held bytes exactly the window.
    The tensors handed to attention are those of the base class.
    """

    def state_tensors(self) -> tuple:
        return self.keys, self.values, getattr(self, "_sliding_window_tensor", None)

    def token_states(self) -> list[str]:
        kept = 0 if self.keys is None else self.keys.shape[-2]
        return ["evicted"] * (self.cumulative_length - kept) + ["kv"] * kept

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.keys.untyped_storage().nbytes() > self.keys.numel() * self.keys.element_size():
            self.keys, self.values = self.keys.clone(), self.values.clone()
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
    """A transformers Cache of a strategy's layers; built by `Strategy.build_cache`."""

    def __init__(self, strategy: "Strategy", layers: list):
        super().__init__(layers=layers)
        self.strategy = strategy

    def state_tensors(self) -> tuple:
        """Every tensor the cache holds between steps (its layers', and a shared store's)."""
        return tuple(t for layer in self.layers for t in layer.state_tensors())

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

    def begin_step(self, ids: list[int], more_prompt: bool = False, keep: bool = False):
        """Called with the token ids of a forward, before it runs; `more_prompt`: this forward is a piece of a
        turn's prompt and more pieces follow (layers that evict wait for the last one); `keep`: layers that evict
        keep every token of this forward (`Forward.keep`)."""
        for layer in self.layers:
            if hasattr(layer, "prompt_open"):
                layer.prompt_open, layer.keep_all = more_prompt, keep

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

    model = None  # the model the cache was built for (set by whoever builds it: the engine, `strategy_cache`)

    def fork(self) -> "StrategyCache":
        """An independent copy of the state, the strategy's object included (whatever a strategy keeps on itself,
        in a module of its own too, is the copy's own).  Shared, not copied: the model's own modules, parameters
        and buffers wherever the cache reaches them (an AnchorKV store reaches the whole model through its
        replayer), model configs, and the run's kernels.  A cache built without its model (`model` None) shares
        no module: every module it reaches is copied."""
        memo = model_side(self, self.model)
        if self.kernels is not None:
            memo[id(self.kernels)] = self.kernels
        try:
            return copy.deepcopy(self, memo)
        except (TypeError, copy.Error, NotImplementedError, RecursionError) as e:  # e.g. an mmap it keeps
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ContractError(
                f"{self.strategy.label}: its state cannot be copied for a twin or a saved turn "
                f"({type(e).__name__}: {why}); allowed: state that copy.deepcopy can copy (tensors, "
                "numbers, lists, dicts, dataclasses), or a run without twins"
            ) from None


def model_side(root, model: torch.nn.Module | None) -> dict[int, object]:
    """The model-side objects of `root`, by id (a deepcopy memo that shares them): `model` with all its submodules,
    parameters and buffers, and each model config `root` reaches.  A module that is not the model's (a strategy's
    own, with state in its buffers) is not among them: a copy gets its own."""
    found: dict[int, object] = {}
    if model is not None:
        found.update((id(part), part) for part in (*model.modules(), *model.parameters(), *model.buffers()))
        found[id(model.config)] = model.config
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in found:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            stack.extend(vars(obj).values())  # its own state is copied; the model's modules it holds are shared
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


@dataclass
class Strategy:
    """Base of all strategies.  Subclasses set `name` and implement `build_cache` and the formulas."""

    name: ClassVar[str] = ""
    # A class from a file or module of one's own: "PATH.py:Class" or "module:Class" (`external.load`), its spec's head.
    _source: ClassVar[str | None] = None
    exact: ClassVar[bool] = False  # claims K/V bit-equal to the full cache (tests hold it to that)
    # Hands attention every token's K/V (kept or rebuilt), so they can be compared with the full cache's; an
    # eviction strategy hands fewer and is not compared.
    kv_comparable: ClassVar[bool] = False
    registry: ClassVar[dict[str, type["Strategy"]]] = {}
    # The settings under which this built-in strategy is its NVIDIA kvpress 0.5.5 press in kvpress's pipeline (the
    # context compressed once, the question read after): only those that differ from ours.  `bench tasks`' lanes at a
    # compression ratio run them (`parsing.kvpress_spec`); empty where ours already is, or kvpress has no press.
    kvpress: ClassVar[dict[str, object]] = {}

    def __init_subclass__(cls, **kwargs):
        """A class that names itself (`name` in its own body) is registered under that name, unless another class
        holds it: a subclass never takes a registered strategy's place (a file's `class Mine(Window)` that keeps
        the window's name, or names itself "window", is reached by its file spec, not by "window")."""
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__ and cls.name and Strategy.registry.get(cls.name, cls) is cls:
            Strategy.registry[cls.name] = cls
        cls._source = None  # set by `external.load` for the class it loads

    # --- settings ------------------------------------------------------------
    @classmethod
    def settings(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    def spec(self) -> str:
        """Canonical spec: name (or a file's or module's class: `PATH.py:Class`) then every non-default setting, e.g.
        `kvdirect:budget=64:mode=fast`."""
        parts = [self._source or self.name]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
        return ":".join(parts)

    def full_spec(self, without: tuple[str, ...] = ()) -> str:
        """The spec with every setting, defaults included (those in `without` left out), e.g.
        `snapkv:budget=64:window=32:kernel=5:pooling=avg:decode=grow`: what ran, whatever the defaults become."""
        parts = [self._source or self.name]
        for f in dataclasses.fields(self):
            if f.name not in without:
                value = getattr(self, f.name)
                parts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
        return ":".join(parts)

    @staticmethod
    def check_choice(strategy: str, field: str, value, allowed):
        if value not in allowed:
            raise StrategyError(
                f"{strategy}: {field}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}"
            )

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

    def formula_transient(
        self, geom: ModelGeometry, seen_before: int, q: int, turn_start: bool = False, forwards: list | None = None
    ) -> int:
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
