"""Claim 8, residual patching: KL and max |dlogit| per layer, counted for the models whose control could
fail."""

from __future__ import annotations

from ..render import number
from .common import paper_figure, plural, section_cells


def build(results: dict) -> dict:
    """Claim 8: KL and max |dlogit| per layer, counted only for models whose control (the last position patched
    alone) moved the distribution at every layer: there the measurement could fail."""
    runs = [c["json"] for c in section_cells(results, "patching")]
    rows = [
        {
            "model": j["model"],
            "dtype": j["dtype"],
            "tokens": j["tokens"],
            "layers": j["layers"],
            "max_kl": j["max_kl"],
            "max_abs_dlogit": j["max_abs_dlogit"],
            "min_control_kl": j["min_control_kl"],
            "zero_layers": sum(1 for r in j["rows"] if r["kl"] == 0 and r["max_abs_dlogit"] == 0),
        }
        for j in runs
    ]
    counted = [r for r in rows if r["min_control_kl"] > 0]
    out = {
        "rows": rows,
        "runs": runs,
        "basis": "measured",
        "counted": len(counted),
        "ours": {"kl": None, "dlogit": None},
    }
    notes = []
    out["why"] = (
        "no residual-patching cell is in this report"
        if not rows
        else "no model's control (its last position patched alone) moved the distribution at every layer, so "
        "the measurement could not fail"
    )
    if counted:
        out["ours"] = {"kl": max(r["max_kl"] for r in counted), "dlogit": max(r["max_abs_dlogit"] for r in counted)}
        out["model"] = f"{plural(len(counted), 'model')}: {', '.join(r['model'] for r in counted)}"
        out["scope"] = [
            ", ".join(sorted({r["dtype"] for r in counted})),
            f"{', '.join(map(str, sorted({r['tokens'] for r in counted})))} tokens",
            f"{sum(r['layers'] for r in counted)} layers in all",
        ]
        out["why"] = (
            f"with the donor's residual stream patched in at every position of every layer of "
            f"{plural(len(counted), 'model')}, the largest KL was {number(out['ours']['kl'])} and the "
            f"largest |logit difference| {number(out['ours']['dlogit'])} (the paper: KL "
            f"{paper_figure('patching', 'kl')}), "
            f"while the last position patched alone moved the distribution at every layer (least KL "
            f"{number(min(r['min_control_kl'] for r in counted))})"
        )
        zero = sum(1 for r in counted if r["zero_layers"] == r["layers"])
        notes.append(
            f"{zero} of {len(counted)} models with KL 0 and equal logits at every layer "
            f"({', '.join(r['model'] for r in counted)}); donor and recipient prompts of different tasks, "
            f"cut to the same length ({', '.join(sorted({str(r['tokens']) for r in counted}))} tokens)"
        )
        notes.append(
            "control, the donor's residual at the last position only: smallest KL over layers "
            + ", ".join(f"{r['model']} {number(r['min_control_kl'])}" for r in counted)
            + " (above 0: the measurement can fail)"
        )
    uncounted = [r for r in rows if r not in counted]
    if uncounted:
        notes.append(
            f"not counted, the control left the distribution unchanged at some layer (the measurement could "
            f"not fail there): {', '.join(r['model'] for r in uncounted)}"
        )
    if not rows:
        notes.append("no residual-patching cell in this report")
    return {**out, "notes": notes}
