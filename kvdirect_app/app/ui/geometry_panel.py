"""Bytes per token for the loaded model, from its config alone, beside the papers' claims.

Drawn from plain facts (`service.geometry`); Gemma 3-4B's figures come from its public config, bundled in
`presets/configs/gemma-3-4b.json` (`service.config_geometry`), not from numbers written here.
"""

from __future__ import annotations

import html
import math

from ...claims.papers import CLAIMS
from ...plain.units import fmt_bytes
from .. import service

PAPER = "gemma-3-4b"  # the model of the KV-Direct paper's byte figures
QUOTED = ("bytes", "turns20", "agreement", "recompute")  # the claims about bytes and tokens, quoted here


def _row(*cells, head=False) -> str:
    tag = "th" if head else "td"
    return "<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>"


def _sums(facts: dict) -> dict:
    layers = facts["per_layer"]
    kv_all = sum(layer["kv_bytes_per_token"] for layer in layers)
    kv_global = sum(layer["kv_bytes_per_token"] for layer in layers if not layer["sliding"])
    windows = sorted({layer["window"] for layer in layers if layer["sliding"]})
    return {
        "kv_all": kv_all,
        "kv_global": kv_global,
        "residual": facts["hidden_size"] * facts["bytes_per_element"],
        "sliding": sum(layer["sliding"] for layer in layers),
        "windows": windows,
    }


def break_even_words(facts: dict) -> str:
    b = facts["break_even"]
    words = [
        f"<b>{'none' if b['residual'] is None else b['residual']}</b> (layer-0 anchor a residual)",
        f"<b>{'none' if b['token_id'] is None else b['token_id']}</b> (layer-0 anchor a token id)",
    ]
    if b.get("global_only") is not None:
        words.append(f"<b>{b['global_only']}</b> (global layers' K/V only)")
    return "; ".join(words)


def paper_check() -> str:
    """Our formula on the paper's model, from its bundled public config."""
    facts = service.config_geometry(PAPER, "bfloat16")
    s = _sums(facts)
    L, g = facts["layers"], facts["layers"] - s["sliding"]
    window = f"a {s['windows'][0]:,}-token window" if len(s["windows"]) == 1 else "a sliding window"
    return (
        f"Our formula on Gemma 3-4B's public config ({L} layers, d={facts['hidden_size']}, "
        f"{facts['per_layer'][0]['kv_heads']} KV heads × {facts['per_layer'][0]['head_dim']}, bf16): full KV "
        f"{fmt_bytes(s['kv_all'])}/token, one residual {fmt_bytes(s['residual'])}/token, the paper's first two "
        f"figures.  But {L - g} of its {L} layers keep only {window}, so past that window the full cache grows "
        f"by {fmt_bytes(s['kv_global'])}/token, not {fmt_bytes(s['kv_all'])}."
    )


def geometry_html(name: str, facts: dict, dtype_name: str) -> str:
    L, d, b = facts["layers"], facts["hidden_size"], facts["bytes_per_element"]
    first = facts["per_layer"][0]
    s = _sums(facts)
    kv_all, residual, sliding = s["kv_all"], s["residual"], s["sliding"]
    globals_ = L - sliding
    r = d / (2 * first["kv_heads"] * first["head_dim"])
    model_rows = [
        _row("layers", f"{L}" + (f" ({sliding} sliding-window, {globals_} global)" if sliding else "")),
        _row("hidden size d · KV heads × head dim", f"{d} · {first['kv_heads']} × {first['head_dim']}"),
        _row("dtype", f"{html.escape(dtype_name)} ({b} bytes)"),
        _row("r = d / (2·n_kv·d_h)", f"{r:.2f}" + (" (a residual costs more than one layer's K/V)" if r > 1 else "")),
        _row("<b>full KV, all layers</b>", f"<b>{fmt_bytes(kv_all)}</b>/token"),
        _row("full KV, global layers only (past the windows)", f"{fmt_bytes(s['kv_global'])}/token") if sliding else "",
        _row(
            "<b>one residual</b> (d·b)",
            f"<b>{fmt_bytes(residual)}</b>/token ({100 * residual / kv_all:.1f}% of full KV)",
        ),
        _row("a residual at every global layer (KV-Direct here)", f"{fmt_bytes(residual * globals_)}/token"),
        _row("token id only (anchor at layer 0)", "4 B/token"),
        _row("break-even spacing s*", break_even_words(facts)),
    ]
    counts = sorted({math.ceil(L / s) for s in range(1, L + 1)}, reverse=True)
    spacing_rows = [
        _row(
            "spacing s",
            "anchors ⌈L/s⌉",
            "bytes/token",
            "with token-id anchor",
            "vs full KV",
            "saves storage?",
            head=True,
        )
    ]
    for n in counts:
        spacing = min(s for s in range(1, L + 1) if math.ceil(L / s) == n)
        stored = n * residual
        saves = '<span class="kvd-good">yes</span>' if stored < kv_all else '<span class="kvd-bad">no</span>'
        spacing_rows.append(
            _row(
                str(spacing),
                str(n),
                fmt_bytes(stored),
                fmt_bytes(stored - residual + 4),
                f"{100 * stored / kv_all:.0f}%",
                saves,
            )
        )
    claims = [_row("claim", "paper", head=True)]
    claims += [
        _row(html.escape(CLAIMS[key].title), html.escape(f"{CLAIMS[key].paper}: {CLAIMS[key].quote}")) for key in QUOTED
    ]
    return (
        f'<div class="kvd-geom"><h3>{html.escape(name)}: bytes per token, from the config alone</h3>'
        f'<div class="kvd-geom-grid"><table class="kvd-table">{"".join(model_rows)}</table>'
        f'<table class="kvd-table">{"".join(spacing_rows)}</table>'
        f'<div class="kvd-geom-wide"><table class="kvd-table kvd-claims">{"".join(claims)}</table>'
        f'<p class="kvd-note">Paper claims are quoted, not measured here (the Claims tab measures them). '
        f"{paper_check()}</p></div></div></div>"
    )


def memory_words(name: str, facts: dict) -> dict[str, tuple[str, str]]:
    """What the exact strategies hold on this model, from its config alone: strategy -> (a few words for its pane,
    a sentence for the banner).  KV-Direct keeps a residual per global layer (more than the full cache when r > 1
    and every layer is global, as on SmolLM2); AnchorKV one every s layers (less from the break-even spacing on)."""
    s = _sums(facts)
    first = facts["per_layer"][0]
    r = facts["hidden_size"] / (2 * first["kv_heads"] * first["head_dim"])
    kvd = s["residual"] * (facts["layers"] - s["sliding"])
    more = "more" if kvd > s["kv_all"] else "less"
    least = facts["break_even"]["token_id"]
    return {
        "kvdirect": (
            f"holds {more} than the full cache on this model (r = {r:.2f})",
            f"On {name} (r = {r:.2f}) KV-Direct holds {more} than the full cache: "
            f"{fmt_bytes(kvd)} per old token against {fmt_bytes(s['kv_all'])} of K and V.",
        ),
        "anchorkv": (
            ("holds more at every spacing on this model", "AnchorKV holds more at every spacing.")
            if least is None
            else (
                f"holds less on this model from spacing {least} on",
                f"AnchorKV holds less from spacing s = {least} on (a residual every s layers).",
            )
        ),
    }


def memory_banner(name: str, facts: dict) -> str:
    """The header's line about memory on the loaded model (`memory_words`), in place of a general promise."""
    return " ".join(sentence for _, sentence in memory_words(name, facts).values())
