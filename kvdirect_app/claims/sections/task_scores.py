"""Claim 9, task scores: the exact methods' answers and scores against the full cache's, and which external
lossy methods change task scores (a sign test per method)."""

from __future__ import annotations

import statistics

from ...plain import stats
from ..papers import EXACT_METHODS, EXTERNAL
from ..render import number
from .common import listed, plural, section_cells


def changes_scores(deltas: list[float]) -> dict:
    """Claim 9's one rule (`papers.CLAIMS["tasks"].rule`): a method changes task scores when a one-sided exact sign
    test on its per-sample scores against the full cache's (`deltas`: its score minus the full cache's, per sample)
    says it scores lower at `stats.LEVEL`; too few samples to reach that level is "not enough samples"
    (`stats.changes`)."""
    return stats.changes(deltas)


def build(results: dict) -> dict:
    """Claim 9 from every sample's answers: each exact method's samples whose answer and score equal the full
    cache's, and which of the external lossy methods change task scores (`changes_scores`), all of them required,
    each with enough samples to reach the test's level."""
    runs = [c["json"] for c in section_cells(results, "tasks")]
    exact, lossy = {}, {}
    for j in runs:
        for cell in j["cells"]:
            full = cell["lanes"]["full"]
            for spec, lane in cell["lanes"].items():
                if spec == "full":
                    continue
                if lane["exact"]:
                    exact.setdefault(lane["strategy"], []).append(lane["score"] == full["score"] and lane["equal_full"])
                else:
                    lossy.setdefault(lane["strategy"], []).append(lane["score"] - full["score"])
    methods = {
        m: {**changes_scores(ds), "cells": len(ds), "mean_delta": statistics.fmean(ds)} for m, ds in lossy.items()
    }
    ran = [m for m in EXTERNAL if m in methods]
    missing = [m for m in EXTERNAL if m not in methods]
    too_few = [m for m in ran if methods[m]["verdict"] == stats.TOO_FEW]
    out = {
        "basis": "measured" if exact or lossy else "not measured",
        "methods": methods,
        "level": stats.LEVEL,
        "exact": {m: {"equal": sum(v), "cells": len(v)} for m, v in exact.items()},
        "rows": [r for j in runs for r in j["rows"]],
    }
    out["ours"] = {
        **{m: sum(exact[m]) / len(exact[m]) if exact.get(m) else None for m in EXACT_METHODS},
        "lossy": None
        if missing or too_few
        else sum(methods[m]["verdict"] == stats.CHANGES for m in EXTERNAL) / len(EXTERNAL),
    }
    sampled = [j for j in runs if j["cells"]]
    union = lambda key: sorted({x for j in sampled for x in j[key]})  # noqa: E731
    samples, contexts, budgets = sum(len(j["cells"]) for j in sampled), union("contexts"), union("budgets")
    settings = sorted({j.get("question", "with-context") for j in sampled})
    if sampled:
        out["scope"] = [
            plural(samples, "sample"),
            f"tasks {', '.join(union('tasks'))}",
            f"{plural(len(contexts), 'context length')}: {', '.join(map(str, contexts))} tokens",
            f"{'budget' if len(budgets) == 1 else 'budgets'} {', '.join(map(str, budgets))}",
            f"the question read {' and '.join(QUESTION_WORDS[q] for q in settings)}",
        ]
    names = {"anchorkv": "AnchorKV", "kvdirect": "KV-Direct"}
    exact_words = [f"{names[m]} in {sum(exact[m])} of {len(exact[m])}" for m in EXACT_METHODS if exact.get(m)]
    exact_words = (
        f"{listed(exact_words)} samples answered and scored as the full cache did"
        if exact_words
        else "no exact lane ran"
    )
    changed = [m for m in ran if methods[m]["verdict"] == stats.CHANGES]
    lossy_words = (
        f"only {len(ran)} of the {len(EXTERNAL)} external lossy methods ran, so their part is not measured"
        if missing
        else f"{plural(samples, 'sample')} cannot reach the sign test's level of {stats.LEVEL:g} "
        f"({', '.join(too_few)}), so the lossy part is not measured: not enough samples"
        if too_few
        else f"{len(changed)} of the {len(EXTERNAL)} external lossy methods scored lower than the full cache "
        f"beyond noise (one-sided exact sign test on {plural(samples, 'sample')}, p < {stats.LEVEL:g}: "
        + ", ".join(f"{m} p = {number(methods[m]['p'])}" for m in EXTERNAL)
        + ")"
    )
    out["why"] = (
        f"on {plural(samples, 'sample')} of {plural(len(union('tasks')), 'task')} "
        f"({', '.join(union('tasks'))}) at {plural(len(contexts), 'context length')} "
        f"({listed(contexts)} tokens) and {'budget' if len(budgets) == 1 else 'budgets'} "
        f"{listed(budgets)}, {exact_words}, and {lossy_words}"
        if sampled
        else "no task sample is in this report"
    )
    notes = []
    for j in sampled:
        notes.append(
            f"{len(j['cells'])} samples ({', '.join(j['tasks'])}; contexts "
            f"{', '.join(map(str, j['contexts']))} tokens; budgets {', '.join(map(str, j['budgets']))}; the "
            f"question read {QUESTION_WORDS[j.get('question', 'with-context')]}), the full cache scoring "
            f"{number(statistics.fmean(c['lanes']['full']['score'] for c in j['cells']))} (the reference)"
        )
    if methods:
        notes.append(
            "lossy methods against the full cache, per sample (one-sided exact sign test, ties left out): "
            + ", ".join(
                f"{m}{'' if m in EXTERNAL else ' (ours, not counted)'} {v['verdict']} "
                f"(p = {number(v['p'])}; {v['lower']} lower / {v['higher']} higher of {v['cells']}; "
                f"mean change {number(v['mean_delta'])})"
                for m, v in methods.items()
            )
        )
    if missing:
        notes.append(f"not run: {', '.join(missing)}")
    if not exact and not lossy:
        notes.append("no task sample in this report")
    return {**out, "notes": notes}


QUESTION_WORDS = {
    "after": "after the context was compressed alone (kvpress's setting)",
    "with-context": "inside the compressed prompt (the SnapKV paper's setting)",
}
