"""Claim 1, bytes per token: one residual against every layer's K/V, computed from the configs."""

from __future__ import annotations

from ..render import figure_text
from .common import paper_figure, plural, section_cells, times


def build(results: dict) -> dict:
    rows = []
    for c in section_cells(results, "bytes"):
        j = c["json"]
        rows.append(
            {
                "source": j["source"].rsplit("/", 1)[-1].removesuffix(".json"),
                "layers": j["layers"],
                "kv_bytes_per_token": j["kv_bytes_per_token"],
                "residual_bytes": j["residual_bytes_per_layer"],
                "ratio_r": j["ratio_r"],
                "break_even_spacing": j["break_even_spacing"],
                "break_even_token_id": j["break_even_spacing_token_id_anchor"],
            }
        )
    out = {
        "rows": rows,
        "basis": "computed from the config",
        "model": "Gemma 3-4B's config, bf16",
        "ours": {"residual": None, "full_kv": None},
    }
    gemma = next((r for r in rows if r["source"] == "gemma-3-4b"), None)
    if gemma is None:
        return {
            **out,
            "notes": ["no Gemma 3-4B config among the cells"],
            "why": "no Gemma 3-4B config is among the cells",
        }
    out["gemma_ratio"] = gemma["kv_bytes_per_token"] / gemma["residual_bytes"]
    out["ours"] = {"residual": gemma["residual_bytes"] / 1024, "full_kv": gemma["kv_bytes_per_token"] / 1024}
    out["scope"] = [plural(gemma["layers"], "layer")]
    out["why"] = (
        f"Gemma 3-4B's config in bf16 gives {figure_text(out['ours']['residual'], 'KiB')} for one residual "
        f"and {figure_text(out['ours']['full_kv'], 'KiB')} of K/V per token over its {gemma['layers']} "
        f"layers, against the paper's {paper_figure('bytes', 'residual')} and "
        f"{paper_figure('bytes', 'full_kv')}"
    )
    out["notes"] = [
        f"the paper's KB read as KiB; its 5 KB is one residual against all {gemma['layers']} layers' K/V "
        f"({times(out['gemma_ratio'])}), but one residual replaces one layer's K/V only: a residual per "
        f"layer costs r = {times(gemma['ratio_r'])} the K/V, so residuals save bytes from spacing s* = "
        f"{gemma['break_even_spacing']} on"
    ]
    return out
