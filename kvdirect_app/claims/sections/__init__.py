"""From the cells of a `bench reproduce` run to the claims: our figure per paper figure, a verdict, a reason.

`assess(results)` reads only `results["model"]` and `results["cells"]` (each
cell's benchmark JSON and the environment it ran in) and returns the
claims (the papers' figures, ours beside them, the verdict of the one rule
in `verdicts`, what ours was measured on, the verdict in one sentence that
reads on its own, the whole reason) and the sections (the rows of the
report's detail tables).  Each builder returns its `scope` (what was
measured: samples, turns, budgets...) and `why` (the sentence's clause,
from its numbers).  Nothing stored under "claims" or "sections" is read: a
re-render recomputes them from the numbers.

Which strategy is exact is the run's `mode` ("exact" | "fast" for the
rebuilding strategies, null for the others), never the spec's name; a run
JSON written before the engine recorded it says "mode not recorded".

One module per claim, each with its `build(results)` (claims 2b and 7b are
their claim's builder on other lanes or devices); `common` holds what they
share.
"""

from __future__ import annotations

from ..papers import CLAIMS, NAMES, section_of
from ..render import figure_text
from ..verdicts import judge, stated, worst
from . import (
    bytes_per_token,
    cascade_replay,
    exactness,
    parked_sessions,
    recompute_vs_read,
    residual_patching,
    task_scores,
    token_agreement,
    twenty_turns,
)
from .common import environments, measured_on

BUILDERS = {
    "bytes": bytes_per_token.build,
    "turns20": twenty_turns.build,
    "turns20_anchorkv": twenty_turns.build_anchorkv,
    "agreement": token_agreement.build,
    "recompute": recompute_vs_read.build,
    "replay": cascade_replay.build,
    "parked": parked_sessions.build,
    "exactness": exactness.build,
    "exactness_accelerator": exactness.build_accelerator,
    "patching": residual_patching.build,
    "tasks": task_scores.build,
}


def assess(results: dict) -> tuple[dict, dict]:
    """(claims, sections) from `results["cells"]` and the papers' figures alone."""
    claims, sections = {}, {}
    for name in NAMES:
        claim = CLAIMS[name]
        try:
            section = BUILDERS[name](results)
        except Exception as e:  # a re-render of a hand-edited results.json names the section that failed
            e.add_note(f"section {name}")
            raise
        ours, notes = section.pop("ours"), section.pop("notes")
        parts = []
        for f in claim.figures:
            verdict = judge(f.value, ours[f.key], f.direction, f.tolerance, f.neutral)
            parts.append(
                {
                    "key": f.key,
                    "ours": ours[f.key],
                    "verdict": verdict,
                    "words": f"{f.measures}: {figure_text(ours[f.key], f.unit)} here against "
                    f"{figure_text(f.value, f.unit)} in the paper"
                    + (f" (this part {stated(verdict)})" if len(claim.figures) > 1 else ""),
                }
            )
        models = sorted({f.model for f in claim.figures})
        verdict = worst(p["verdict"] for p in parts)
        reason = "; ".join([p["words"] for p in parts] + notes + [f"the paper's model: {', '.join(models)}"])
        model = section.pop("model", results["model"])
        claims[name] = {
            **claim.as_dict(),
            "parts": parts,
            "basis": section.pop("basis"),
            "model": model,
            "scope": "; ".join([model, *section.pop("scope", [])]),
            "verdict": verdict,
            "measured_on": section.pop("measured_on", None) or measured_on(results, section_of(name)),
            "sentence": f"Claim {claim.title.split('.')[0]} {stated(verdict)}: {section.pop('why')}.",
            "reason": reason[0].upper() + reason[1:] + ".",
            **({"also": section.pop("also")} if "also" in section else {}),
        }
        sections[name] = {**section, "ran_on": environments(results, section_of(name))}
    return claims, sections
