"""Claim 6, reactivatable sessions: how many parked AnchorKV sessions fit in the full cache's memory, by
spacing, counted from the break-even spacing on."""

from __future__ import annotations

import re

from ..render import figure_text
from .common import paper_figure, section_cells, times


def _spacing(strategy: str) -> int | None:
    found = re.search(r"spacing=(\d+)", strategy)
    return int(found.group(1)) if found else None


def build(results: dict) -> dict:
    j = section_cells(results, "parked")[0]["json"]
    rows = [
        {
            "strategy": r["strategy"],
            "spacing": _spacing(r["strategy"]),
            "parked_bytes": r["parked_bytes"],
            "capacity_vs_full": r["capacity_vs_full"],
            "measured_at": r["measured_at"],
            "parked_bytes_measured": r["parked_bytes_measured"],
            "formula_at_measure": r["formula_parked_bytes_at_measure"],
            "resume_ms": r["resume_ms"],
        }
        for r in j["rows"]
    ]
    full = next(r for r in rows if r["strategy"] == "full")
    n = full["measured_at"]
    agree = all(r["parked_bytes_measured"] == r["formula_at_measure"] for r in rows)
    for r in rows:  # where the allocator and the formula disagree, the allocator's ratio at n tokens counts
        r["capacity_measured"] = full["parked_bytes_measured"] / r["parked_bytes_measured"]
    key = "capacity_vs_full" if agree else "capacity_measured"
    own = next((c["json"] for c in section_cells(results, "bytes") if c["json"]["source"] == results["model"]), None)
    s_star = own["break_even_spacing_token_id_anchor"] if own else None
    anchors = [r for r in rows if r["strategy"].startswith("anchorkv") and r["spacing"] is not None]
    counted = [r for r in anchors if s_star is None or r["spacing"] >= s_star]
    out = {
        "rows": rows,
        "context": j["context"],
        "measured_at": n,
        "s_star": s_star,
        "formula_agrees": agree,
        "basis": (
            f"computed from the config at {j['context']:,} tokens; the allocator's parked bytes at {n:,} "
            "tokens equal the formula there"
            if agree
            else f"measured by the allocator at {n:,} tokens (the formula disagreed there)"
        ),
        "ours": {"capacity": None},
    }
    out["model"] = j["model"]
    out["scope"] = [
        f"{j['context']:,} tokens",
        f"spacings {', '.join(map(str, sorted({r['spacing'] for r in counted}))) or 'none'} counted",
    ]
    if not counted:
        missing = "no AnchorKV spacing at or past the break-even spacing was parked"
        return {**out, "notes": [missing], "why": f"on {j['model']}, {missing}"}
    least = min(counted, key=lambda r: r[key])
    out["ours"]["capacity"] = [least[key], max(r[key] for r in counted)]
    out["why"] = (
        f"on {j['model']} at {j['context']:,} tokens, AnchorKV parks "
        f"{figure_text(out['ours']['capacity'], 'x')} as many sessions as the full cache in the same memory, "
        + ("at every spacing" if s_star is None else f"at the spacings from the break-even s* = {s_star} on")
        + f" (the least at spacing {least['spacing']}), where the paper has "
        f"{paper_figure('parked', 'capacity')}"
    )
    notes = [f"{j['model']}; the least at spacing {least['spacing']}"]
    below = [r for r in anchors if r not in counted]
    if below:
        notes.append(
            f"spacings below the break-even s* = {s_star} ("
            + ", ".join(f"{r['spacing']}: {times(r[key])}" for r in below)
            + ") store more than they save, as the config's arithmetic says; the paper's range starts "
            "where storage is saved, so they are listed, not counted"
        )
    return {**out, "notes": notes}
