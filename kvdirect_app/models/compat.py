"""Every touch point with transformers' model internals and Cache API.

The Cache API moves between transformers releases; this module is the only
place that knows its names.  Written and tested against transformers 5.24
(`requirements.txt` pins the range).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)
from transformers.configuration_utils import PreTrainedConfig as PretrainedConfig
from transformers.initialization import no_init_weights as _no_init_weights

# The keyword that hands a model's forward, and `generate`, its cache (transformers 5 renamed `past_key_values`
# to `cache`; the old name is a deprecated alias until 6.0).
CACHE_KWARG = "cache"
GENERATE_CACHE = CACHE_KWARG

__all__ = [
    "CACHE_KWARG",
    "GENERATE_CACHE",
    "Cache",
    "CacheLayerMixin",
    "DynamicCache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "LayerSpec",
    "PretrainedConfig",
    "layer_specs",
    "decoder_layers",
    "attention_module",
    "rope_function",
    "Rotary",
    "rotary_for_layer",
    "forward_step",
]


@dataclass(frozen=True)
class LayerSpec:
    """What a cache needs to know about one decoder layer."""

    index: int
    layer_type: str  # "full_attention" | "sliding_attention" | ...
    sliding_window: int | None  # tokens a sliding layer attends to (None: global)

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_specs(config) -> list[LayerSpec]:
    """Per-layer type and window, exactly as transformers' `DynamicCache(config=...)` picks them."""
    cfg = text_config(config)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    specs = []
    for i, (layer_type, kw) in enumerate(zip(types, kwargs)):
        if layer_type not in ("full_attention", "sliding_attention", "chunked_attention"):
            raise ValueError(f"layer {i} has type {layer_type!r}; only attention layers are supported")
        window = kw.get("sliding_window") if layer_type != "full_attention" else None
        specs.append(LayerSpec(i, layer_type, window))
    return specs


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None) or model.base_model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder `layers` list; this family is not supported")
    return layers


def attention_module(layer: nn.Module) -> nn.Module:
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        raise ValueError(f"{type(layer).__name__} has no `self_attn`; this family is not supported")
    return attn


def rope_function(attn: nn.Module):
    """The family's own `apply_rotary_pos_emb`, or None for models without RoPE."""
    return getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)


def _rotary_module(model: nn.Module) -> nn.Module | None:
    base = getattr(model, "model", None) or model.base_model
    return getattr(base, "rotary_emb", None)


class Rotary:
    """The model's rotary embedding for layers of one type (Gemma 3: one base per type): `(x, position_ids) ->
    (cos, sin)`."""

    def __init__(self, module: nn.Module, layer_type: str):
        self.module = module
        self.layer_type = layer_type if "layer_type" in inspect.signature(module.forward).parameters else None

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_type is None:
            return self.module(x, position_ids)
        return self.module(x, position_ids, self.layer_type)


def rotary_for_layer(model: nn.Module, layer_type: str) -> Rotary | None:
    """The rotary embedding of layers of this type (`Rotary`); None for a model without one."""
    rotary = _rotary_module(model)
    return None if rotary is None else Rotary(rotary, layer_type)


def forward_step(model: nn.Module, input_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
    """One forward over `input_ids` (1, q) on top of `cache`; returns the last position's logits (vocab,) in fp32.

    Positions come from `cache.get_seq_length()` (tokens seen), as in `generate`.
    """
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def forward_rows(model: nn.Module, input_ids: torch.Tensor, cache: Cache, position_ids: torch.Tensor) -> torch.Tensor:
    """One forward over a batch of rows (N, q) at explicit positions (N, q); the last position's logits (N, vocab)
    in fp32."""
    out = model(input_ids=input_ids, cache=cache, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


def _modeling():
    """transformers' modeling and masking modules (its attention registry, its mask builders), imported once a
    model runs: the command line and the page start without them."""
    from transformers import masking_utils, modeling_utils  # lazy: ~2.5 s of import that only running a model needs

    return masking_utils, modeling_utils


def mask_function(layer_type: str):
    """The masking_utils builder a model's forward uses for layers of this type."""
    masking_utils, _ = _modeling()
    return {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        "chunked_attention": masking_utils.create_chunked_causal_mask,
    }[layer_type]


def input_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """The token embedding whose output is decoder layer 0's input (Gemma's includes its sqrt(d) scale)."""
    return model.get_input_embeddings()


def attention_function(attn: nn.Module, implementation: str | None = None):
    """The attention function the module calls for `implementation` (default: its config's now): from
    transformers' registry, else the family's own eager function."""
    _, modeling_utils = _modeling()
    eager = getattr(sys.modules[type(attn).__module__], "eager_attention_forward", None)
    registry = modeling_utils.ALL_ATTENTION_FUNCTIONS
    return registry.get_interface(implementation or attn.config._attn_implementation, eager)


def register_attention(name: str, fn):
    """Add an attention function under a new name (transformers' public registry; existing names untouched)."""
    _, modeling_utils = _modeling()
    if name not in modeling_utils.AttentionInterface._global_mapping:
        modeling_utils.AttentionInterface.register(name, fn)


@contextlib.contextmanager
def attention_implementation(config, name: str):
    """The config's attention implementation is `name` inside (the backing field, so nothing is re-resolved);
    the caller holds the model's lock, so no other forward sees it."""
    saved = config._attn_implementation_internal
    config._attn_implementation_internal = name
    try:
        yield
    finally:
        config._attn_implementation_internal = saved


def run_decoder_layer(
    layer: torch.nn.Module, hidden: torch.Tensor, mask, position_embeddings, position_ids, cache: Cache
) -> torch.Tensor:
    """One decoder layer called as the model's own forward calls it."""
    out = layer(
        hidden,
        attention_mask=mask,
        position_embeddings=position_embeddings,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
    )
    return out[0] if isinstance(out, tuple) else out


def no_init_weights():
    """transformers' context in which a model's modules are built without initialising their weights (the
    real-size checks fill every parameter themselves: a 4B model's own init takes minutes on two cores)."""
    return _no_init_weights()
