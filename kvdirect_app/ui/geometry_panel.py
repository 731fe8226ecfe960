"""Bytes per token for the loaded model, from its config alone, beside the papers' claims."""

from __future__ import annotations

import html
import math

from ..geometry import ModelGeometry
from .views import fmt_bytes

# KV-Direct paper, Gemma 3-4B in bf16 (claims: quoted, not measured here).
PAPER_CLAIMS = [
    ("one residual per token", "5 KB"),
    ("full KV cache per token", "136 KB"),
    ("peak state over 20 turns", "42 MB (full cache: more than 103 MB)"),
    ("token match vs the full cache", "100% (H2O, StreamingLLM, SnapKV, TOVA, window: 5–28%)"),
    ("recompute vs reading cached K/V", "up to 5× faster"),
]
# Gemma 3-4B's published text config: 34 layers (every 6th global, the rest a 1,024-token window),
# hidden 2560, 4 KV heads of 256; bf16.  Our own arithmetic, to check the claims' first two lines.
GEMMA3_4B = dict(layers=34, global_layers=5, hidden=2560, kv_heads=4, head_dim=256, bytes=2, window=1024)


def _row(*cells, head=False) -> str:
    tag = "th" if head else "td"
    return "<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>"


def break_even(geom: ModelGeometry) -> tuple[int | None, str | None]:
    """The geometry module's break-even spacing s*, where this build has it: (s*, the variants in words)."""
    fn = getattr(geom, "break_even_spacing", None)
    if not callable(fn):
        return None, None
    variants = [("layer-0 anchor a residual", {}), ("layer-0 anchor a token id", {"token_id_anchor": True})]
    if len(geom.global_layers) < geom.num_layers:
        variants.append(("global layers' K/V only", {"global_only": True}))
    first, words = None, []
    for label, kwargs in variants:
        try:
            value = fn(**kwargs)
        except TypeError:
            continue
        first = value if not words else first
        words.append(f"<b>{'none' if value is None else value}</b> ({label})")
    return first, "; ".join(words) or None


def gemma_check() -> tuple[int, int, int]:
    g = GEMMA3_4B
    kv_layer = 2 * g["kv_heads"] * g["head_dim"] * g["bytes"]
    return g["layers"] * kv_layer, g["hidden"] * g["bytes"], g["global_layers"] * kv_layer


def geometry_html(name: str, geom: ModelGeometry, dtype_name: str) -> str:
    L, d, b = geom.num_layers, geom.hidden_size, geom.bytes_per_element
    first = geom.layers[0]
    kv_all = sum(layer.kv_bytes_per_token for layer in geom.layers)
    kv_global = sum(layer.kv_bytes_per_token for layer in geom.global_layers)
    residual = d * b
    r = d / (2 * first.num_kv_heads * first.head_dim)
    sliding = L - len(geom.global_layers)
    model_rows = [
        _row("layers", f"{L}" + (f" ({sliding} sliding-window, {L - sliding} global)" if sliding else "")),
        _row("hidden size d · KV heads × head dim", f"{d} · {first.num_kv_heads} × {first.head_dim}"),
        _row("dtype", f"{html.escape(dtype_name)} ({b} bytes)"),
        _row("r = d / (2·n_kv·d_h)", f"{r:.2f}" + (" (a residual costs more than one layer's K/V)" if r > 1 else "")),
        _row("<b>full KV, all layers</b>", f"<b>{fmt_bytes(kv_all)}</b>/token"),
        _row("full KV, global layers only (past the windows)", f"{fmt_bytes(kv_global)}/token") if sliding else "",
        _row("<b>one residual</b> (d·b)", f"<b>{fmt_bytes(residual)}</b>/token ({100 * residual / kv_all:.1f}% of full KV)"),
        _row("a residual at every global layer (KV-Direct here)", f"{fmt_bytes(residual * len(geom.global_layers))}/token"),
        _row("token id only (anchor at layer 0)", "4 B/token"),
    ]
    _, be = break_even(geom)
    model_rows.append(_row("break-even spacing s*", be or "<i>not exposed by this build's geometry module</i>"))
    counts = sorted({math.ceil(L / s) for s in range(1, L + 1)}, reverse=True)
    spacing_rows = [_row("spacing s", "anchors ⌈L/s⌉", "bytes/token", "with token-id anchor", "vs full KV",
                         "saves storage?", head=True)]
    for n in counts:
        s = min(s for s in range(1, L + 1) if math.ceil(L / s) == n)
        stored = n * residual
        saves = '<span class="kvd-good">yes</span>' if stored < kv_all else '<span class="kvd-bad">no</span>'
        spacing_rows.append(_row(str(s), str(n), fmt_bytes(stored), fmt_bytes(stored - residual + 4),
                                 f"{100 * stored / kv_all:.0f}%", saves))
    full, one, global_only = gemma_check()
    claims = [_row("claim (KV-Direct paper, Gemma 3-4B, bf16)", "paper says", head=True)]
    claims += [_row(what, html.escape(v)) for what, v in PAPER_CLAIMS]
    g = GEMMA3_4B
    check = (f"Our formula on Gemma 3-4B's published config ({g['layers']} layers, d={g['hidden']}, "
             f"{g['kv_heads']} KV heads × {g['head_dim']}, bf16): full KV {fmt_bytes(full)}/token, one residual "
             f"{fmt_bytes(one)}/token, the paper's first two figures.  But {g['layers'] - g['global_layers']} of its "
             f"{g['layers']} layers keep only a {g['window']:,}-token window, so past that window the full cache grows "
             f"by {fmt_bytes(global_only)}/token, not {fmt_bytes(full)}.")
    return (f'<div class="kvd-geom"><h3>{html.escape(name)}: bytes per token, from the config alone</h3>'
            f'<div class="kvd-geom-grid"><table class="kvd-table">{"".join(model_rows)}</table>'
            f'<table class="kvd-table">{"".join(spacing_rows)}</table>'
            f'<div class="kvd-geom-wide"><table class="kvd-table kvd-claims">{"".join(claims)}</table>'
            f'<p class="kvd-note">Paper claims are quoted, not measured here. {check}</p></div></div></div>')
