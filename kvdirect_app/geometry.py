"""Bytes per token from a model config alone (DESIGN.md, "The mathematics").

Notation: `L` layers, hidden size `d`, `n_kv` key/value heads of size `d_h`,
`b` bytes per element.  A layer that owns a cache holds `2 * n_kv * d_h * b`
bytes of K/V per token; a stored residual costs `d * b` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import compat

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class LayerGeometry:
    index: int
    layer_type: str
    sliding_window: int | None
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    bytes_per_element: int

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def residual_bytes_per_token(self) -> int:
        return self.hidden_size * self.bytes_per_element


@dataclass(frozen=True)
class ModelGeometry:
    layers: tuple[LayerGeometry, ...]
    hidden_size: int
    bytes_per_element: int

    @classmethod
    def from_config(cls, config, dtype: torch.dtype = torch.float32) -> "ModelGeometry":
        cfg = compat.text_config(config)
        b = DTYPE_BYTES[dtype]
        d = cfg.hidden_size
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d_h = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
        layers = tuple(
            LayerGeometry(s.index, s.layer_type, s.sliding_window, d, n_kv, d_h, b)
            for s in compat.layer_specs(cfg)
        )
        return cls(layers, d, b)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def global_layers(self) -> list[LayerGeometry]:
        return [layer for layer in self.layers if not layer.is_sliding]

    def full_kv_bytes(self, tokens: int) -> int:
        """What transformers' DynamicCache holds after `tokens` tokens (sliding layers keep window - 1)."""
        total = 0
        for layer in self.layers:
            kept = min(tokens, layer.sliding_window - 1) if layer.is_sliding else tokens
            total += kept * layer.kv_bytes_per_token
        return total
