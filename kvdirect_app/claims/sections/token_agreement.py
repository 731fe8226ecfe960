"""Claim 3, token agreement: the exact strategies' token match against the eviction baselines', over the
recall scenario's budgets."""

from __future__ import annotations

from ..render import figure_text
from .common import UNRECORDED, listed, paper_figure, plural, run_mode, section_cells

CLAIM3_BASELINES = ("h2o", "streaming_llm", "snapkv", "tova", "window")  # the methods claim 3's quote names


def build(results: dict) -> dict:
    sweep = section_cells(results, "agreement")[0]["json"]
    rows = [
        {
            "strategy": r["strategy"],
            "budget": r["budget"],
            "mode": run_mode(r),
            "token_match": r["token_match"],
            "teacher_forced": r.get("teacher_forced_agreement"),
            "peak": r["state_bytes"]["peak"],
        }
        for r in sweep["rows"]
    ]
    exact = [r for r in rows if r["mode"] == "exact"]
    baselines = [r for r in rows if r["mode"] is None and r["strategy"] in CLAIM3_BASELINES]
    unnamed = sorted({r["strategy"] for r in rows if r["mode"] is None and r["strategy"] not in CLAIM3_BASELINES})
    out = {
        "rows": rows,
        "basis": "measured",
        "budgets": sweep["budgets"],
        "ours": {"exact": min((r["token_match"] for r in exact), default=None), "baselines": None},
    }
    notes = [
        f"recall scenario on {sweep['model']}, budgets {', '.join(map(str, sweep['budgets']))}, every budget counted"
    ]
    named = sorted({r["strategy"] for r in baselines})
    out["model"] = sweep["model"]
    out["scope"] = [
        "recall scenario",
        f"budgets {', '.join(map(str, sweep['budgets']))}",
        f"exact: {', '.join(sorted({r['strategy'] for r in exact})) or 'none'}",
        f"baselines: {', '.join(named) or 'none'}",
    ]
    exact_words = (
        "no exact-mode strategy ran"
        if not exact
        else f"the exact strategies kept a token match of {figure_text(out['ours']['exact'], '')} (the paper: "
        f"{paper_figure('agreement', 'exact')})"
    )
    base_words = f"none of the {plural(len(CLAIM3_BASELINES), 'named baseline')} ran"
    if baselines:
        high = max(baselines, key=lambda r: r["token_match"])
        out["ours"]["baselines"] = [min(r["token_match"] for r in baselines), high["token_match"]]
        notes.append(f"the highest baseline: {high['strategy']} at budget {high['budget']}")
        base_words = (
            f"the {plural(len(named), 'named baseline')} {figure_text(out['ours']['baselines'], '')}, the "
            f"highest {high['strategy']} at budget {high['budget']} (the paper: "
            f"{paper_figure('agreement', 'baselines')})"
        )
    out["why"] = (
        f"on {sweep['model']}'s recall scenario at budgets {listed(sweep['budgets'])}, {exact_words} and {base_words}"
    )
    if unnamed:
        notes.append(f"{', '.join(unnamed)} listed, not counted: the claim names its five baselines")
    others = [r for r in rows if r["mode"] not in ("exact", None)]
    if others:
        notes.append(f"{len(others)} rows counted in neither part (fast mode, or {UNRECORDED})")
    return {**out, "notes": notes}
