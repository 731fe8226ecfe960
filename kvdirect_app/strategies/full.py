"""The standard KV cache: the reference every other strategy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from ..models import compat
from ..models.geometry import ModelGeometry
from .base import WINDOW_SIZE_TENSOR_BYTES, FullLayer, SlidingLayer, Strategy, StrategyCache, window_layer_transient


def reference_layers(model) -> list:
    """One layer per decoder layer, as transformers' `DynamicCache(config=...)` builds them."""
    return [
        SlidingLayer(spec.sliding_window) if spec.is_sliding else FullLayer()
        for spec in compat.layer_specs(model.config)
    ]


@dataclass
class Full(Strategy):
    """Keys and values of every token at every layer (sliding layers: their last window - 1 tokens).

    Token for token the same as transformers' `DynamicCache`; no settings.
    """

    name = "full"
    exact = True
    kv_comparable = True

    def build_cache(self, model) -> StrategyCache:
        return StrategyCache(self, reference_layers(model))

    def formula_persistent(self, geom: ModelGeometry, seen: int, forwards: list | None = None) -> int:
        return geom.full_kv_bytes(seen) + WINDOW_SIZE_TENSOR_BYTES * sum(layer.is_sliding for layer in geom.layers)

    def formula_transient(
        self, geom: ModelGeometry, seen_before: int, q: int, turn_start: bool = False, forwards: list | None = None
    ) -> int:
        return max(
            (window_layer_transient(geom, layer.index, seen_before, q) for layer in geom.layers if layer.is_sliding),
            default=0,
        )
