"""Bytes per token from a model config alone: the formula docs/measurement.md's "Bytes: the allocator the tensors
live in" checks the measurement against.

Notation: `L` layers, hidden size `d`, `n_kv` key/value heads of size `d_h`,
`b` bytes per element.  A layer that owns a cache holds `2 * n_kv * d_h * b`
bytes of K/V per token; a stored residual costs `d * b` bytes; a token id
costs 4 bytes (int32).

* `r = d / (2 * n_kv * d_h)`: above 1, a residual at every layer costs more
  than the K/V it replaces.
* Break-even spacing `s*`: the smallest `s` with `ceil(L/s) * d < sum_l 2 n_kv d_h`
  (strict; layer 0 counted as a stored residual), and the same with the
  layer-0 anchor stored as a token id.
* Sliding-window layers never hold more than their window, so for an
  interleaved model anchors only need to serve the global layers:
  `place_anchors` is an exact dynamic programme over anchor sets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from ..plain.catalog import PRESETS_DIR, presets
from . import compat
from .loading import gguf_location

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
TOKEN_ID_BYTES = 4


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
            LayerGeometry(s.index, s.layer_type, s.sliding_window, d, n_kv, d_h, b) for s in compat.layer_specs(cfg)
        )
        return cls(layers, d, b)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def global_layers(self) -> list[LayerGeometry]:
        return [layer for layer in self.layers if not layer.is_sliding]

    @property
    def residual_bytes(self) -> int:
        return self.hidden_size * self.bytes_per_element

    @property
    def kv_bytes_per_token(self) -> int:
        """Every layer counted as global: the papers' per-token figure."""
        return sum(layer.kv_bytes_per_token for layer in self.layers)

    @property
    def global_kv_bytes_per_token(self) -> int:
        return sum(layer.kv_bytes_per_token for layer in self.global_layers)

    @property
    def ratio_r(self) -> float:
        layer = self.layers[0]
        return self.hidden_size / (2 * layer.num_kv_heads * layer.head_dim)

    def full_kv_bytes(self, tokens: int) -> int:
        """What transformers' DynamicCache holds after `tokens` tokens (sliding layers keep window - 1)."""
        return sum(layer.kv_bytes_per_token * self.kept_by(layer, tokens) for layer in self.layers)

    def window_bytes(self, tokens: int) -> int:
        """K/V held by the sliding layers alone after `tokens` tokens."""
        return sum(layer.kv_bytes_per_token * self.kept_by(layer, tokens) for layer in self.layers if layer.is_sliding)

    @staticmethod
    def kept_by(layer: LayerGeometry, tokens: int) -> int:
        return min(tokens, layer.sliding_window - 1) if layer.is_sliding else tokens

    # --- anchors ---------------------------------------------------------------
    def uniform_anchors(self, spacing: int) -> list[int]:
        return list(range(0, self.num_layers, spacing))

    def anchor_bytes_per_token(self, anchors: list[int], token_id_anchor: bool) -> int:
        first = TOKEN_ID_BYTES if token_id_anchor and 0 in anchors else self.residual_bytes
        return (len(anchors) - 1) * self.residual_bytes + first if 0 in anchors else len(anchors) * self.residual_bytes

    def break_even_spacing(self, token_id_anchor: bool = False, global_only: bool = False) -> int | None:
        """Smallest uniform spacing whose anchors cost strictly less per token than the K/V they replace."""
        kv = self.global_kv_bytes_per_token if global_only else self.kv_bytes_per_token
        for s in range(1, self.num_layers + 1):
            if self.anchor_bytes_per_token(self.uniform_anchors(s), token_id_anchor) < kv:
                return s
        return None

    def replay_passes(self, anchors: list[int], cascade: bool = True) -> int:
        """Decoder-layer passes to rebuild every global layer's K/V from `anchors`.

        A pass through the layer that owns the K/V counts (its projection is
        run); cascade runs each segment once up to its last global layer, naive
        restarts from the anchor for every global layer.
        """
        total = 0
        bounds = sorted(anchors) + [self.num_layers]
        for a, end in zip(bounds, bounds[1:]):
            targets = [layer.index for layer in self.global_layers if a <= layer.index < end]
            if targets:
                total += (max(targets) - a + 1) if cascade else sum(g - a + 1 for g in targets)
        return total

    def place_anchors(self, max_passes: int | None = None, token_id_anchor: bool = True) -> tuple[list[int], int, int]:
        """Exact DP: the anchor set (layer 0 always in it) with the fewest bytes per token whose cascade
        replay of every global layer takes at most `max_passes` layer passes (None: no bound).

        Returns (anchors, bytes_per_token, passes).  Ties go to fewer passes.
        """
        L = self.num_layers
        globals_ = [layer.index for layer in self.global_layers]
        bound = max_passes if max_passes is not None else L * L

        def seg_passes(a: int, end: int) -> int:
            targets = [g for g in globals_ if a <= g < end]
            return (max(targets) - a + 1) if targets else 0

        # best[(j, p)] = (bytes, anchors) for a prefix of segments ending at layer j using p passes.
        first = TOKEN_ID_BYTES if token_id_anchor else self.residual_bytes
        best: dict[int, dict[int, tuple[int, list[int]]]] = {0: {0: (0, [])}}
        for a in range(L):
            if a not in best:
                continue
            cost_a = first if a == 0 else self.residual_bytes
            for p, (bytes_, chosen) in list(best[a].items()):
                for end in range(a + 1, L + 1):
                    q = p + seg_passes(a, end)
                    if q > bound:
                        break
                    cand = (bytes_ + cost_a, chosen + [a])
                    slot = best.setdefault(end, {})
                    if q not in slot or cand[0] < slot[q][0]:
                        slot[q] = cand
        options = best.get(L, {})
        if not options:
            raise ValueError(f"no anchor placement replays every global layer within {max_passes} passes")
        passes, (bytes_, anchors) = min(options.items(), key=lambda kv: (kv[1][0], kv[0]))
        return anchors, bytes_, passes


def load_config(source, dtype: torch.dtype | None = None):
    """A transformers config from a dict, a config.json path, or a model name (preset, Hub id, local path)."""
    if isinstance(source, dict):
        data = {k: v for k, v in source.items() if not k.startswith("_")}
        return AutoConfig.for_model(data.pop("model_type"), **data)
    path = Path(source)
    if path.is_file():
        return load_config(json.loads(path.read_text()))
    bundled = PRESETS_DIR / "configs" / f"{source}.json"
    if bundled.is_file():
        return load_config(json.loads(bundled.read_text()))
    preset = presets().get(source)
    if preset is not None and preset["kind"] == "tiny":
        return load_config(dict(preset["config"]))
    if preset is not None:
        location = gguf_location(preset)
        if location is not None:
            return AutoConfig.from_pretrained(str(location[0]), gguf_file=location[1])
        return AutoConfig.from_pretrained(preset["hub_id"])
    return AutoConfig.from_pretrained(str(source))


def breakeven_report(geom: ModelGeometry, context: int = 32768, max_passes: int | None = None) -> dict:
    """Everything `bench breakeven` prints, as plain data."""
    layer = geom.layers[0]
    per_spacing = []
    for s in range(1, geom.num_layers + 1):
        anchors = geom.uniform_anchors(s)
        per_spacing.append(
            {
                "spacing": s,
                "anchors": anchors,
                "anchor_bytes_per_token": geom.anchor_bytes_per_token(anchors, token_id_anchor=False),
                "anchor_bytes_per_token_token_id_anchor": geom.anchor_bytes_per_token(anchors, token_id_anchor=True),
                "cascade_passes": geom.replay_passes(anchors, cascade=True),
                "naive_passes": geom.replay_passes(anchors, cascade=False),
            }
        )
    report = {
        "layers": geom.num_layers,
        "hidden_size": geom.hidden_size,
        "num_kv_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "bytes_per_element": geom.bytes_per_element,
        "kv_bytes_per_token": geom.kv_bytes_per_token,
        "residual_bytes_per_layer": geom.residual_bytes,
        "ratio_r": geom.ratio_r,
        "break_even_spacing": geom.break_even_spacing(token_id_anchor=False),
        "break_even_spacing_token_id_anchor": geom.break_even_spacing(token_id_anchor=True),
        "per_spacing": per_spacing,
        "layer_types": [lg.layer_type for lg in geom.layers],
        "global_layers": [lg.index for lg in geom.global_layers],
    }
    if any(lg.is_sliding for lg in geom.layers):
        anchors, bytes_, passes = geom.place_anchors(max_passes=max_passes)
        uniform = []
        for row in per_spacing:
            dp_anchors, dp_bytes, dp_passes = geom.place_anchors(max_passes=row["cascade_passes"])
            uniform.append(
                {
                    "spacing": row["spacing"],
                    "bytes_per_token": row["anchor_bytes_per_token_token_id_anchor"],
                    "cascade_passes": row["cascade_passes"],
                    "dp_anchors": dp_anchors,
                    "dp_bytes_per_token": dp_bytes,
                    "dp_passes": dp_passes,
                }
            )
        report["windowed"] = {
            "context": context,
            "global_kv_bytes_per_token": geom.global_kv_bytes_per_token,
            "kv_bytes_per_token_at_context": geom.full_kv_bytes(context) / context,
            "window_bytes_per_session": geom.window_bytes(context),
            "break_even_spacing_global_only": geom.break_even_spacing(token_id_anchor=False, global_only=True),
            "break_even_spacing_global_only_token_id_anchor": geom.break_even_spacing(
                token_id_anchor=True, global_only=True
            ),
            "dp_placement": {
                "max_passes": max_passes,
                "anchors": anchors,
                "bytes_per_token": bytes_,
                "cascade_passes": passes,
            },
            "uniform": uniform,
        }
    return report
