"""From the cells of a `bench reproduce` run to the claims: our figure per paper figure, a verdict, a reason.

`assess(results)` reads only `results["model"]` and `results["cells"]` (each
cell's benchmark JSON and the environment it ran in) and returns the
claims (the papers' figures, ours beside them, the verdict of the one rule
in `verdicts`, the reason) and the sections (the rows of the report's
detail tables).  Nothing stored under "claims" or "sections" is read: a
re-render recomputes them from the numbers.

Which strategy is exact is the run's `mode` ("exact" | "fast" for the
rebuilding strategies, null for the others), never the spec's name; a run
JSON written before the engine recorded it says "mode not recorded".
"""

from __future__ import annotations

import re

from ..units import fmt_bytes
from .papers import CLAIMS, SECTIONS
from .render import figure_text, number
from .verdicts import judge, worst

UNRECORDED = "mode not recorded"


def _cells(results: dict, section: str) -> list[dict]:
    return [c for c in results["cells"] if c["section"] == section]


def _mode(r: dict):
    return r.get("mode", UNRECORDED)


def _x(value) -> str:
    return f"{number(value)}x"


# --- one builder per claim: detail rows, our figures by the papers' keys, and what a reader must know -----------
def _bytes(results: dict) -> dict:
    rows = []
    for c in _cells(results, "bytes"):
        j = c["json"]
        rows.append({"source": j["source"].rsplit("/", 1)[-1].removesuffix(".json"), "layers": j["layers"],
                     "kv_bytes_per_token": j["kv_bytes_per_token"], "residual_bytes": j["residual_bytes_per_layer"],
                     "ratio_r": j["ratio_r"], "break_even_spacing": j["break_even_spacing"],
                     "break_even_token_id": j["break_even_spacing_token_id_anchor"]})
    out = {"rows": rows, "basis": "computed from the config", "model": "Gemma 3-4B's config, bf16",
           "ours": {"residual": None, "full_kv": None}}
    gemma = next((r for r in rows if r["source"] == "gemma-3-4b"), None)
    if gemma is None:
        return {**out, "notes": ["no Gemma 3-4B config among the cells"]}
    out["gemma_ratio"] = gemma["kv_bytes_per_token"] / gemma["residual_bytes"]
    out["ours"] = {"residual": gemma["residual_bytes"] / 1024, "full_kv": gemma["kv_bytes_per_token"] / 1024}
    out["notes"] = [f"the paper's KB read as KiB; its 5 KB is one residual against all {gemma['layers']} layers' K/V "
                    f"({_x(out['gemma_ratio'])}), but one residual replaces one layer's K/V only: a residual per layer "
                    f"costs r = {_x(gemma['ratio_r'])} the K/V, so residuals save bytes from spacing s* = "
                    f"{gemma['break_even_spacing']} on"]
    return out


def _turns20(results: dict) -> dict:
    cell = next(c for c in _cells(results, "turns20") if c["argv"][0] == "run")
    run = cell["json"]
    rows = [{"strategy": spec, "mode": _mode(r), "between_turns_peak": r["state_bytes"]["between_turns_peak"],
             "peak": r["state_bytes"]["peak"], "token_match": r["token_match"]}
            for spec, r in run["strategies"].items()]
    turns = len(run["turn_chunk_ids"])
    out = {"rows": rows, "scenario": cell.get("scenario"), "turns": turns, "tokens": len(run["prompt_ids"]),
           "new_tokens": run["max_new_tokens"], "basis": "measured", "ours": {"peak_ratio": None}, "equal_memory": None}
    equal = next((c for c in _cells(results, "turns20") if c["argv"][0] == "sweep"), None)
    if equal is not None:
        out["equal_memory"] = [{"strategy": r["strategy"], "budget": r["budget"], "peak": r["state_bytes"]["peak"],
                                "token_match": r["token_match"]} for r in equal["json"]["rows"]]
    where = (f"{run['model']}, {turns} turns of at most {run['max_new_tokens']} new tokens"
             + ("" if turns == 20 else " (the paper: 20 turns)"))
    full = next((r for r in rows if r["strategy"] == "full"), None)
    exact = [r for r in rows if r["mode"] == "exact" and r["token_match"] == 1.0]
    if full is None or not exact:
        missing = "no full-cache lane" if full is None else "no exact-mode lane with every token equal"
        return {**out, "notes": [f"{missing} in this run ({where})"]}
    best = min(exact, key=lambda r: r["peak"])
    out.update(best=best["strategy"], best_peak=best["peak"], full_peak=full["peak"])
    out["ours"]["peak_ratio"] = full["peak"] / best["peak"]
    notes = [f"{best['strategy']} peaks at {fmt_bytes(best['peak'])} against the full cache's "
             f"{fmt_bytes(full['peak'])} with every token equal, on {where}; the paper's 42 MB and 103 MB are for its "
             "own model and conversation, so only their ratio carries over"]
    own = [r for r in rows if r["strategy"].startswith("kvdirect") and r["mode"] == "exact"]
    if own and own[0] is not best:
        out["kvdirect_ratio"] = full["peak"] / own[0]["peak"]
        notes.append(f"KV-Direct's own lane ({own[0]['strategy']}) peaks at {fmt_bytes(own[0]['peak'])}: "
                     f"{_x(out['kvdirect_ratio'])}" + (", above the full cache: a residual at every layer outweighs "
                                                     "that layer's K/V where r > 1 (see 1.)"
                                                     if out["kvdirect_ratio"] < 1 else ""))
    return {**out, "notes": notes}


def _agreement(results: dict) -> dict:
    sweep = _cells(results, "agreement")[0]["json"]
    rows = [{"strategy": r["strategy"], "budget": r["budget"], "mode": _mode(r), "token_match": r["token_match"],
             "teacher_forced": r.get("teacher_forced_agreement"), "peak": r["state_bytes"]["peak"]}
            for r in sweep["rows"]]
    exact = [r for r in rows if r["mode"] == "exact"]
    baselines = [r for r in rows if r["mode"] is None]
    out = {"rows": rows, "basis": "measured", "budgets": sweep["budgets"],
           "ours": {"exact": min((r["token_match"] for r in exact), default=None), "baselines": None}}
    notes = [f"recall scenario on {sweep['model']}, budgets {', '.join(map(str, sweep['budgets']))}, every budget "
             "counted"]
    if baselines:
        high = max(baselines, key=lambda r: r["token_match"])
        out["ours"]["baselines"] = [min(r["token_match"] for r in baselines), high["token_match"]]
        notes.append(f"the highest baseline: {high['strategy']} at budget {high['budget']}")
    others = [r for r in rows if r["mode"] not in ("exact", None)]
    if others:
        notes.append(f"{len(others)} rows counted in neither part (fast mode, or {UNRECORDED})")
    return {**out, "notes": notes}


def _recompute(results: dict) -> dict:
    from . import recompute

    j = _cells(results, "recompute")[0]["json"]
    # summary()'s numbers only: its own verdict belongs to the microbenchmark; the report's is the one rule's.
    s = {k: v for k, v in recompute.summary(j).items() if k not in ("verdict", "sentence")}
    rows = [r for r in j["rows"] if not r.get("skipped")]
    out = {"rows": j["rows"], "basis": "measured", "summary": s, "ours": {"speedup": None}}
    where = f"{j['device']}, {j['dtype']}, {j['threads']} thread{'' if j['threads'] == 1 else 's'}, {j['model']} " \
            f"layer {j['layer']}"
    if s["best_speedup"] is None:
        return {**out, "notes": [f"every cell was skipped on {where}"]}
    host = s["best_host_speedup"] is not None and s["best_host_speedup"] > s["best_speedup"]
    out["ours"]["speedup"] = s["best_host_speedup"] if host else s["best_speedup"]
    at = s["best_host_at"] if host else s["best_at"]
    notes = [f"best at batch {at['batch']}, context {at['context']}"
             + (" with K/V copied from host memory" if host else " with K/V in device memory") + f", on {where}",
             f"a residual is {j['residual_bytes_per_token']} B against {j['kv_bytes_per_token']} B of K/V per token "
             f"(r = {number(j['ratio_r'])}); the arithmetic-intensity bound allows at most "
             f"{_x(s['largest_bound'])} here"]
    if not any(r.get("host_speedup") is not None for r in rows):
        notes.append("K/V held off the device (host memory over PCIe, CUDA only) not measured here")
    return {**out, "notes": notes}


def _replay(results: dict) -> dict:
    j = _cells(results, "replay")[0]["json"]
    cascade, naive = j["replay"]["cascade"], j["replay"]["naive"]
    out = {"context": j["context"], "spacing": j["spacing"], "cascade_s": cascade["seconds"],
           "naive_s": naive["seconds"], "cascade_passes": cascade["layer_passes"],
           "naive_passes": naive["layer_passes"], "basis": "measured"}
    out["speedup"] = naive["seconds"] / cascade["seconds"]
    out["ideal"] = naive["layer_passes"] / cascade["layer_passes"]
    out["bit_equal"] = sum(1 for r in (cascade, naive) if r["kv_exact"])
    out["exact"] = out["bit_equal"] / 2
    out["ours"] = {"speedup": out["speedup"], "exact": out["exact"]}
    notes = [f"{j['context']} tokens, spacing {j['spacing']}, {j['model']} {j['dtype']}; the layer-pass ratio "
             f"({naive['layer_passes']} naive passes / {cascade['layer_passes']} cascade) is {_x(out['ideal'])}"]
    out["naive_ms_per_pass"] = 1e3 * naive["seconds"] / naive["layer_passes"]
    out["cascade_ms_per_pass"] = 1e3 * cascade["seconds"] / cascade["layer_passes"]
    if out["speedup"] > out["ideal"]:
        # Not a ceiling: the ratio counts passes, and the two replays' passes need not cost the same.
        notes.append(f"the time ratio is above the pass ratio because a naive pass cost more than a cascade pass "
                     f"here ({number(out['naive_ms_per_pass'])} ms against {number(out['cascade_ms_per_pass'])} ms)")
    else:
        notes.append(f"a cascade pass cost {number(out['cascade_ms_per_pass'])} ms, a naive one "
                     f"{number(out['naive_ms_per_pass'])} ms")
    return {**out, "notes": notes}


def _spacing(strategy: str) -> int | None:
    found = re.search(r"spacing=(\d+)", strategy)
    return int(found.group(1)) if found else None


def _parked(results: dict) -> dict:
    j = _cells(results, "parked")[0]["json"]
    rows = [{"strategy": r["strategy"], "spacing": _spacing(r["strategy"]), "parked_bytes": r["parked_bytes"],
             "capacity_vs_full": r["capacity_vs_full"], "measured_at": r["measured_at"],
             "parked_bytes_measured": r["parked_bytes_measured"],
             "formula_at_measure": r["formula_parked_bytes_at_measure"], "resume_ms": r["resume_ms"]}
            for r in j["rows"]]
    full = next(r for r in rows if r["strategy"] == "full")
    n = full["measured_at"]
    agree = all(r["parked_bytes_measured"] == r["formula_at_measure"] for r in rows)
    for r in rows:  # where the allocator and the formula disagree, the allocator's ratio at n tokens counts
        r["capacity_measured"] = full["parked_bytes_measured"] / r["parked_bytes_measured"]
    key = "capacity_vs_full" if agree else "capacity_measured"
    own = next((c["json"] for c in _cells(results, "bytes") if c["json"]["source"] == results["model"]), None)
    s_star = own["break_even_spacing_token_id_anchor"] if own else None
    anchors = [r for r in rows if r["strategy"].startswith("anchorkv") and r["spacing"] is not None]
    counted = [r for r in anchors if s_star is None or r["spacing"] >= s_star]
    out = {"rows": rows, "context": j["context"], "measured_at": n, "s_star": s_star, "formula_agrees": agree,
           "basis": (f"computed from the config at {j['context']:,} tokens; the allocator's parked bytes at {n:,} "
                     "tokens equal the formula there" if agree else
                     f"measured by the allocator at {n:,} tokens (the formula disagreed there)"),
           "ours": {"capacity": None}}
    if not counted:
        return {**out, "notes": ["no AnchorKV spacing at or past the break-even spacing was parked"]}
    least = min(counted, key=lambda r: r[key])
    out["ours"]["capacity"] = [least[key], max(r[key] for r in counted)]
    notes = [f"{j['model']}; the least at spacing {least['spacing']}"]
    below = [r for r in anchors if r not in counted]
    if below:
        notes.append(f"spacings below the break-even s* = {s_star} ("
                     + ", ".join(f"{r['spacing']}: {_x(r[key])}" for r in below)
                     + ") store more than they save, as the config's arithmetic says; the paper's range starts "
                       "where storage is saved, so they are listed, not counted")
    return {**out, "notes": notes}


def _exactness(results: dict) -> dict:
    rows = []
    for c in _cells(results, "exactness"):
        j = c["json"]
        for spec, r in j["strategies"].items():
            if spec == "full" or _mode(r) is None:  # the full cache and the baselines rebuild nothing
                continue
            rows.append({"model": j["model"], "dtype": j["dtype"], "strategy": spec, "mode": _mode(r),
                         "load": c.get("load", 0), "token_match": r["token_match"], "kv_exact": r["kv_exact"],
                         "rebuilt": r["rebuilt_token_layers"], "max_abs_dk": r["max_abs_dk"],
                         "forward_kernels": (j.get("kernels") or {}).get("mode", UNRECORDED),
                         "rebuild_kernels": (r.get("kernels") or {}).get("rebuild", UNRECORDED)})
    counted = [r for r in rows if r["mode"] == "exact" and r["rebuilt"]]
    fast = [r for r in rows if r["mode"] == "fast" and r["rebuilt"]]
    idle = [r for r in rows if r["mode"] in ("exact", "fast") and not r["rebuilt"]]
    unrecorded = [r for r in rows if r["mode"] == UNRECORDED]
    out = {"rows": rows, "basis": "measured", "counted": len(counted), "idle": len(idle),
           "ours": {"kv": None, "tokens": None}}
    notes = []
    if counted:
        out["kv_equal"] = sum(1 for r in counted if r["kv_exact"])
        out["tokens_equal"] = sum(1 for r in counted if r["token_match"] == 1.0)
        out["ours"] = {"kv": out["kv_equal"] / len(counted), "tokens": out["tokens_equal"] / len(counted)}
        dtypes = sorted({r["dtype"] for r in counted})
        models = sorted({r["model"] for r in counted})
        notes.append(f"{out['kv_equal']} of {len(counted)} exact-mode runs that rebuilt K/V bit-equal, "
                     f"{out['tokens_equal']} with every token equal ({', '.join(models)}; {', '.join(dtypes)}; "
                     f"{sum(1 for r in counted if r['load'])} under busy processes)")
    if idle:
        notes.append(f"{len(idle)} runs rebuilt nothing and are listed apart: a single turn with rebuild=turn keeps "
                     "full K/V within the turn, and layers that all slide keep their window as the full cache does")
    if rows:
        forward = sorted({r["forward_kernels"] for r in rows})
        rebuilt = sorted({r["rebuild_kernels"] for r in counted}) if counted else []
        notes.append(f"kernels: the reference and every lane's forwards {', '.join(forward)}"
                     + (f"; exact rebuilds {', '.join(rebuilt)}" if rebuilt else ""))
    if fast:
        equal = [r for r in fast if r["kv_exact"]]
        out["fast_equal"] = len(equal)
        kinds = sorted({r["rebuild_kernels"] for r in fast})
        notes.append(f"fast mode (all old tokens in one call, rebuilt with: {', '.join(kinds)}), not counted: "
                     f"{len(equal)} of {len(fast)} bit-equal to the forwards' K/V")
    if unrecorded:
        notes.append(f"{len(unrecorded)} runs not counted: {UNRECORDED} in their JSON")
    devices = sorted({(c.get("env") or {}).get("device", "not recorded") for c in _cells(results, "exactness")})
    if not any(d.startswith("cuda") for d in devices):
        notes.append(f"devices: {', '.join(devices)}; accelerators not measured here")
    return {**out, "notes": notes}


BUILDERS = {"bytes": _bytes, "turns20": _turns20, "agreement": _agreement, "recompute": _recompute,
            "replay": _replay, "parked": _parked, "exactness": _exactness}


# --- the verdicts ------------------------------------------------------------------------------------------------
def environments(results: dict, section: str) -> list[dict]:
    """The distinct environments the section's cells ran in (recorded in the worker that ran each)."""
    seen = []
    for c in _cells(results, section):
        env = c.get("env")
        if env not in seen:
            seen.append(env)
    return seen


def assess(results: dict) -> tuple[dict, dict]:
    """(claims, sections) from `results["cells"]` and the papers' figures alone."""
    claims, sections = {}, {}
    for name in SECTIONS:
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
            parts.append({"key": f.key, "ours": ours[f.key], "verdict": verdict,
                          "words": f"{f.measures}: {figure_text(ours[f.key], f.unit)} here against "
                                   f"{figure_text(f.value, f.unit)} in the paper"
                                   + (f" ({verdict})" if len(claim.figures) > 1 else "")})
        models = sorted({f.model for f in claim.figures})
        verdict = worst(p["verdict"] for p in parts)
        reason = "; ".join([p["words"] for p in parts] + notes + [f"the paper's model: {', '.join(models)}"])
        claims[name] = {**claim.as_dict(), "parts": parts, "basis": section.pop("basis"),
                        "model": section.pop("model", results["model"]), "verdict": verdict,
                        "reason": reason[0].upper() + reason[1:] + "."}
        sections[name] = {**section, "ran_on": environments(results, name)}
    return claims, sections
