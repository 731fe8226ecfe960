"""The model's side of `strategy_cache` (`integration.py`): the hooks that tie one strategy cache to its model for
the `with` block, and what they count of it.

`CacheHooks` holds everything the block puts on the model: a forward pre-hook and a forward hook on the model
(`before`, `after`: recognise a forward of this cache under any name or position, check it, tell the cache where it
begins and ends and where a turn starts, and measure it), wrappers of `generate`'s prefill and of
`generate_batch` on the model instance (`prefill`: a prompt fed in pieces is one prompt; `generate_batch`: the
paged cache refused), and the `InputTap` that hands the cache's layers their inputs (`hooks.py`).  `install` puts
them in place, `remove` takes every one of them away.  What they count of the cache, forward by forward, is its
`Ledger`; a way in that the cache cannot serve exactly raises `UnsupportedCall` before the cache changes.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from ..measure.observe import Observer, Owner
from ..models.geometry import ModelGeometry
from ..plain.errors import UserError
from ..strategies import Strategy, StrategyCache
from ..strategies.base import Forward
from .hooks import InputTap

CACHE = Owner("strategy_cache", "lane")  # the cache's work, in its observer's regions
_MISSING = object()  # an attribute the model's own __dict__ did not hold before the block


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
    keep: bool = False  # nothing is evicted in the forward in progress (`question_after`, once the context is in)
    context_done: bool = False  # `question_after`: the context (the first prompt, all its pieces) has been fed
    prompt_total: int = 0  # tokens of the prompt `generate`'s prefill feeds, while it runs (else 0)
    prompt_left: int = 0  # of those, the tokens not yet fed
    q: int = 0  # tokens of the forward in progress
    step: set[int] | None = None  # layers updated by the forward in progress; None: none of this cache's runs
    broken: bool = False  # a forward raised part-way: the layers are out of step
    started: float = 0.0


def _carries(cache, args, kwargs) -> bool:
    """Whether a forward was handed `cache`, under any name or position."""
    return any(v is cache for v in kwargs.values()) or any(a is cache for a in args)


def _check_call(call: dict, seen: int) -> int:
    """The token count of a forward of the cache (`call`: its arguments by name), or `UnsupportedCall` naming
    what to change; `seen`: tokens the cache has seen."""
    ids = call.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise UnsupportedCall(
            "strategy_cache: pass input_ids (1, T) to a forward of the cache (not inputs_embeds: "
            "the anchors and replays start from token ids)"
        )
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise UnsupportedCall(
            "strategy_cache: generate with input_ids of batch size 1 (one conversation) and at "
            f"least one token; got {tuple(ids.shape)}"
        )
    q = ids.shape[1]
    if call.get("use_cache") is False:
        raise UnsupportedCall(
            "strategy_cache: use_cache=False re-feeds the whole sequence at every step; leave "
            "use_cache on (the default) to generate with a strategy cache"
        )
    positions = call.get("position_ids")
    if positions is not None:
        want = torch.arange(seen, seen + q, device=positions.device).view(1, q)
        if tuple(positions.shape) != (1, q) or not bool((positions == want).all()):
            raise UnsupportedCall(
                f"strategy_cache: position_ids must be the next positions {seen}..{seen + q - 1} "
                "(the cache has seen "
                f"{seen} tokens); leave them out, or feed only the tokens the cache has not seen"
            )
    _check_mask(call.get("attention_mask"))
    return q


def _check_mask(mask):
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.all())):
        raise UnsupportedCall(
            "strategy_cache: attention_mask must be all ones (one unpadded conversation, 2-D) or left out"
        )


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


class CacheHooks:
    """The hooks and wrappers one `strategy_cache` block puts on its model, and the state they share.

    `model`, `cache` (its `ledger` is what the hooks count), `strategy` (its formula after each forward),
    `observer` (the cache's regions, its held bytes and peaks), `geometry` (the formula's), `device` (the input
    tap's).  Nothing is on the model until `install`; `remove` takes away whatever `install` put there, also after
    it stopped part-way.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StrategyCache,
        strategy: Strategy,
        observer: Observer,
        geometry: ModelGeometry,
        device: torch.device,
        question_after: bool = False,
    ):
        self.model, self.cache, self.strategy = model, cache, strategy
        self.question_after = question_after  # kvpress's setting: the context compressed, the rest read, kept
        self.observer, self.geometry = observer, geometry
        self.ledger: Ledger = cache.ledger
        self.signature = inspect.signature(model.forward)
        # The name of the forward's **kwargs, whose entries are arguments by name too (None: it has none).
        self.var_kw = next((p.name for p in self.signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        self.prefill_of_model = getattr(model, "_prefill", None)  # `generate`'s prefill, as the model had it
        self.batch_of_model = getattr(model, "generate_batch", None)  # continuous batching, as the model had it
        self.wrapped: dict[str, object] = {}  # attribute -> what the model's __dict__ held before (or _MISSING)
        self.handles: list = []  # the forward hooks registered on the model
        self.tap = InputTap(model, device)  # hands the cache's layers their inputs, during its forwards only

    # --- on and off the model -------------------------------------------------------------------------------
    def install(self):
        """The wrappers of the model's `_prefill` and `generate_batch` (where it has them), then the forward
        hooks."""
        for name, wrapper, original in (
            ("_prefill", self.prefill, self.prefill_of_model),
            ("generate_batch", self.generate_batch, self.batch_of_model),
        ):
            if original is not None:
                self.wrapped[name] = self.model.__dict__.get(name, _MISSING)
                object.__setattr__(self.model, name, wrapper)
        self.handles.append(self.model.register_forward_pre_hook(self.before, with_kwargs=True))
        self.handles.append(self.model.register_forward_hook(self.after, with_kwargs=True, always_call=True))

    def remove(self):
        """The model as it was: its attributes back, every hook removed, the input tap closed."""
        for name, previous in self.wrapped.items():
            if previous is _MISSING:
                object.__delattr__(self.model, name)
            else:
                object.__setattr__(self.model, name, previous)
        for h in self.handles:
            h.remove()
        self.tap.close()

    # --- the forward hooks ----------------------------------------------------------------------------------
    def named(self, args, kwargs) -> dict:
        """A forward's arguments by name (TypeError: arguments the forward itself refuses)."""
        call = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        return {**call, **call.pop(self.var_kw, {})} if self.var_kw else call

    def before(self, module, args, kwargs):
        """Before a forward of the model: where it carries this cache, checked, counted and begun on the cache."""
        cache, led, observer = self.cache, self.ledger, self.observer
        if not _carries(cache, args, kwargs):
            return  # another cache's forward (or none): not ours to count
        if led.broken or led.step is not None:
            raise UnsupportedCall(
                "strategy_cache: an earlier forward (or generate's prompt fed in pieces) on this "
                "cache did not finish (it raised part-way, or this one runs inside it), so its "
                "layers are out of step; open a new strategy_cache for this conversation"
            )
        try:
            call = self.named(args, kwargs)
        except TypeError:
            return  # arguments the forward itself refuses: it raises before any layer runs
        q = _check_call(call, led.tokens)
        ids = call["input_ids"]
        if led.prompt_total:  # a piece of the prompt `generate`'s prefill feeds (the whole of it, unchunked)
            if q > led.prompt_left:
                raise UnsupportedCall(
                    f"strategy_cache: generate's prefill fed a forward of {q} tokens where its "
                    f"prompt had {led.prompt_left} of {led.prompt_total} left; pass "
                    "prefill_chunk_size=None"
                )
            first = led.prompt_left == led.prompt_total
            # Each generate call's prompt of several new tokens is a turn's, however many pieces feed it.
            starts = first and (not led.forwards or led.prompt_total > 1)
            prompt, more = starts or not first, q < led.prompt_left
        else:  # a direct forward: a prompt after decode steps starts a new turn
            starts = not led.forwards or (q > 1 and led.decoding)
            prompt, more = starts, False
        keep = self.question_after and led.context_done
        if keep and led.turns == 1 and not led.decoding:  # the question read after the context: the same turn
            starts, prompt = False, True
        if starts and led.forwards:
            cache.end_turn()
        led.starts_turn, led.prompt, led.more_prompt, led.keep = starts, prompt, more, keep
        led.turns += starts
        led.q, led.step = q, set()
        led.started = time.perf_counter()
        self.tap.target(cache, region=lambda: observer.region(CACHE, "cache_update"))
        observer.reset_peaks([CACHE])
        with observer.region(CACHE, "other"):
            cache.begin_step(ids[0].tolist(), more, keep)

    def after(self, module, args, kwargs, output):
        """After a forward of the model (also one that raised): where it was this cache's, ended on the cache and
        measured; a layer it left out breaks the cache."""
        cache, led, observer = self.cache, self.ledger, self.observer
        if led.step is None or not _carries(cache, args, kwargs):
            return
        self.tap.clear()
        if output is None:  # the forward raised (this hook is always called): some layers moved, some not
            led.broken, led.step = True, None
            return
        missed = sorted(set(range(len(cache.layers))) - led.step)
        led.step = None
        if missed:
            led.broken = True
            raise UnsupportedCall(
                f"strategy_cache: a forward left layers {missed} of the cache out (a model "
                "that skips layers); run every decoder layer, and open a new strategy_cache"
            )
        q = led.q
        with observer.region(CACHE, "other"):
            cache.end_step()
        led.tokens += q
        led.forward_s.append(time.perf_counter() - led.started)
        led.forwards.append(Forward(q, prompt=led.prompt, open=led.more_prompt, keep=led.keep))
        if self.question_after and led.prompt and not led.more_prompt:
            led.context_done = True  # the context's last piece is in: from here on nothing is evicted
        if led.prompt_total:
            led.prompt_left -= q
            led.decoding = led.prompt_total == 1  # as the unchunked prompt would leave it
        else:
            led.decoding = q == 1
        seen = cache.get_seq_length()
        led.held.append(observer.held(CACHE))
        led.peak.append(observer.peak(CACHE))
        led.declared.append(observer.declared(cache))
        led.formula.append(self.strategy.formula_persistent(self.geometry, seen, led.forwards))

    # --- the wrappers on the model --------------------------------------------------------------------------
    def prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        """`generate`'s prefill: tells `before` how many prompt tokens it feeds (in pieces, with
        `prefill_chunk_size`), and checks after it that they were all fed."""
        cache, led = self.cache, self.ledger
        if not _carries(cache, (), model_kwargs) or led.step is not None or led.prompt_total:
            return self.prefill_of_model(input_ids, generation_config, model_kwargs, *args, **kwargs)
        _check_mask(model_kwargs.get("attention_mask"))  # the whole prompt's, before a piece changes the cache
        total = max(0, _prompt_tokens(input_ids, generation_config, model_kwargs, cache.get_seq_length()))
        led.prompt_total = led.prompt_left = total
        try:
            out = self.prefill_of_model(input_ids, generation_config, model_kwargs, *args, **kwargs)
        except BaseException:
            # Refused or raised after some pieces: they wait for a last one that will not come.
            led.broken |= led.prompt_left < led.prompt_total
            led.prompt_total = led.prompt_left = 0
            raise
        left, led.prompt_total, led.prompt_left = led.prompt_left, 0, 0
        if left:  # its last piece never came: the layers wait for it
            led.broken = True
            raise UnsupportedCall(
                f"strategy_cache: generate's prefill fed {total - left} of its prompt's {total} "
                "tokens, so the cache's layers are out of step; pass prefill_chunk_size=None "
                "and open a new strategy_cache"
            )
        return out

    def generate_batch(self, *args, **kwargs):
        """Continuous batching (`cache_implementation="paged"`) refused where it is handed this cache."""
        if _carries(self.cache, args, kwargs):
            raise UnsupportedCall(
                "strategy_cache: cache_implementation='paged' (continuous batching) runs a "
                "paged cache of its own and ignores this one; leave cache_implementation unset "
                "to generate with a strategy cache"
            )
        return self.batch_of_model(*args, **kwargs)
