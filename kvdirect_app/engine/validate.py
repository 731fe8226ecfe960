"""Every setting of a run, checked in one place: the CLI, the `compare` endpoint and the UI handlers call this.

Two stages.  `request()` checks what needs no model (names, numbers, text
lengths, device, dtype, strategies) and is cheap; `against_model()` checks
what needs the loaded model's tokenizer and geometry (the conversation's
length with the chat template and every earlier turn, each strategy's
budget and spacing against the model).  Each error is one `UserError`
whose message starts with the setting's name and says its allowed values;
nothing reaches the model unchecked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..models.geometry import ModelGeometry
from ..models.loading import (
    DTYPES,
    LoadedModel,
    available_devices,
    offered_presets,
    presets,
    resolve_device,
    unavailable_reason,
)
from ..models.prompts import Prompter
from ..plain.hosted import hosted
from ..plain.limits import HOSTED, LOCAL, Limits, SettingError, integer, limits, text  # noqa: F401  (the checks' one door)
from ..strategies import Strategy, parse_specs, registry

MAX_THREADS = 1024


def threads(value, setting: str = "threads") -> int | None:
    """A thread count a caller gave (None: the caller's default, resolved where it runs): a whole number >= 1,
    never silently replaced (0 or -1 is an error, not "the default")."""
    return None if value is None else integer(setting, value, 1, MAX_THREADS, "torch threads")


@dataclass(frozen=True)
class Request:
    """A run's settings after the first stage: every value of an allowed type and range."""

    model: str
    device: str
    dtype: str
    strategies: tuple[Strategy, ...]
    max_new_tokens: int
    turns: tuple[str, ...]
    raw: bool = False

    @property
    def specs(self) -> tuple[str, ...]:
        return tuple(s.label for s in self.strategies)


def model_name(value) -> str:
    """A preset, or outside hosted mode a local folder or a Hub id; never executed, in hosted mode never a path."""
    if not isinstance(value, str) or not value.strip():
        raise SettingError(
            f"model: empty; allowed: a preset ({', '.join(offered_presets())})"
            + ("" if hosted() else ", a Hub id (org/name) or a local folder")
        )
    name = value.strip()
    if name in presets():
        if name not in offered_presets():
            raise SettingError(
                f"model: {name} is not offered here: {unavailable_reason(name)}; "
                f"allowed: {', '.join(offered_presets())}"
            )
        return name
    if hosted():
        raise SettingError(
            f"model: {name[:80]!r} is not offered here; allowed: {', '.join(offered_presets())} "
            "(hosted mode: presets only)"
        )
    if len(name) > 512 or any(ch in name for ch in "\x00\n\r"):
        raise SettingError("model: not a usable name; allowed: a preset, a Hub id (org/name) or a local folder")
    return name


@functools.cache
def dtype_works(device: str, dtype: str) -> bool:
    """Whether a matmul and a softmax in `dtype` run on `device` (asked once per pair, on the device itself)."""
    try:
        x = torch.ones(4, 4, dtype=DTYPES[dtype], device=device)
        torch.softmax(x @ x, dim=-1).sum().item()
        return True
    except (RuntimeError, TypeError):
        return False


def device_dtype(device, dtype) -> tuple[str, str]:
    if device not in available_devices():
        raise SettingError(
            f"device: {str(device)[:40]!r} is not available here; allowed: {', '.join(available_devices())}"
        )
    if dtype not in DTYPES:
        raise SettingError(f"dtype: {str(dtype)[:40]!r} is not supported; allowed: {', '.join(DTYPES)}")
    resolved = str(resolve_device(device))
    if not dtype_works(resolved, dtype):
        works = [d for d in DTYPES if dtype_works(resolved, d)]
        raise SettingError(f"dtype: {dtype} does not run on {resolved}; allowed there: {', '.join(works)}")
    return device, dtype


def strategies(value, cap: Limits) -> tuple[Strategy, ...]:
    specs = ",".join(value) if isinstance(value, (list, tuple)) else value
    if not isinstance(specs, str) or not specs.strip():
        raise SettingError(f"strategies: none given; allowed: {', '.join(registry())}")
    parsed = parse_specs(specs)
    if len(parsed) > cap.max_strategies:
        raise SettingError(f"strategies: {len(parsed)} given; allowed: 1..{cap.max_strategies}")
    return tuple(parsed)


def request(
    model, device, dtype, specs, max_new_tokens, turns, raw: bool = False, cap: Limits | None = None
) -> Request:
    """First stage: everything that needs no model."""
    cap = cap or limits()
    name = model_name(model)
    device, dtype = device_dtype(device, dtype)
    parsed = strategies(specs, cap)
    new = integer("max_new_tokens", max_new_tokens, 1, cap.max_new_tokens)
    if not isinstance(turns, (list, tuple)) or not turns:
        raise SettingError("prompt: no message given; type a message")
    if len(turns) > cap.max_turns:
        raise SettingError(
            f"turns: {len(turns)} in this conversation; allowed: 1..{cap.max_turns} (press Clear to start a new one)"
        )
    checked = tuple(text("prompt", t, cap) for t in turns)
    return Request(name, device, dtype, parsed, new, checked, bool(raw))


def conversation_tokens(loaded: LoadedModel, turns: tuple[str, ...] | list[str], raw: bool, max_new_tokens: int) -> int:
    """The most tokens the conversation can reach: every turn with its chat template, every reply at its cap."""
    prompter = Prompter(loaded, raw)
    total = len(prompter.first(turns[0])) + max_new_tokens
    for turn in turns[1:]:
        total += len(prompter.next(turn, None)) + max_new_tokens
    return total


def against_model(
    req: Request, loaded: LoadedModel, cap: Limits | None = None, prompt_tokens: int | None = None
) -> int:
    """Second stage: the conversation fits the model's context (and the session cap); every strategy's settings
    fit the model.  Returns the most tokens the run can reach.  `prompt_tokens`: a first turn given as ids."""
    cap = cap or limits()
    context = loaded.max_context
    geom = ModelGeometry.from_config(loaded.config, loaded.dtype)
    for strategy in req.strategies:
        check_strategy(strategy, geom, context)
    if prompt_tokens is not None:
        total = prompt_tokens + req.max_new_tokens
    else:
        total = conversation_tokens(loaded, req.turns, req.raw, req.max_new_tokens)
    ceiling = min(context, cap.max_total_tokens or context)
    if total > ceiling:
        where = "the model's context" if ceiling == context else "this demo's cap per conversation"
        raise SettingError(
            f"prompt: the conversation would reach {total:,} tokens (every turn with the chat template, each reply "
            f"up to max_new_tokens={req.max_new_tokens}); allowed: up to {ceiling:,} ({where}); shorten the message, "
            "lower max_new_tokens or press Clear"
        )
    return total


def check_strategy(strategy: Strategy, geom: ModelGeometry, context: int):
    """A strategy's budget and layer settings against the model (spacing 1..L, anchors below L)."""
    name = strategy.name
    budget = getattr(strategy, "budget", None)
    if budget is not None and not 1 <= budget <= context:
        raise SettingError(f"{name}: budget={budget} is out of range; allowed: 1..{context} (the model's context)")
    spacing = getattr(strategy, "spacing", None)
    if spacing is not None and not 1 <= spacing <= geom.num_layers:
        raise SettingError(
            f"{name}: spacing={spacing} is out of range; allowed: 1..{geom.num_layers} (the model's layers)"
        )
    if hasattr(strategy, "anchor_layers"):
        strategy.anchor_layers(geom)  # anchors below L (a StrategyError naming them otherwise)
