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
"""

from __future__ import annotations

import re
import statistics

from ..plain import stats
from ..plain.units import fmt_bytes
from .papers import CLAIMS, EXACT_METHODS, EXTERNAL, NAMES, section_of
from .render import figure_text, number
from .verdicts import NOT_MEASURED, judge, stated, worst

UNRECORDED = "mode not recorded"


def _cells(results: dict, section: str) -> list[dict]:
    return [c for c in results["cells"] if c["section"] == section]


def _mode(r: dict):
    return r.get("mode", UNRECORDED)


def _x(value) -> str:
    return f"{number(value)}x"


def _paper(name: str, key: str) -> str:
    """The paper's figure `key` of claim `name`, with its unit."""
    f = next(f for f in CLAIMS[name].figures if f.key == key)
    return figure_text(f.value, f.unit)


def _listed(items) -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = [str(i) for i in items]
    return " and ".join(items) if len(items) < 3 else f"{', '.join(items[:-1])} and {items[-1]}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
        return {**out, "notes": ["no Gemma 3-4B config among the cells"],
                "why": "no Gemma 3-4B config is among the cells"}
    out["gemma_ratio"] = gemma["kv_bytes_per_token"] / gemma["residual_bytes"]
    out["ours"] = {"residual": gemma["residual_bytes"] / 1024, "full_kv": gemma["kv_bytes_per_token"] / 1024}
    out["scope"] = [_count(gemma["layers"], "layer")]
    out["why"] = (f"Gemma 3-4B's config in bf16 gives {figure_text(out['ours']['residual'], 'KiB')} for one residual "
                  f"and {figure_text(out['ours']['full_kv'], 'KiB')} of K/V per token over its {gemma['layers']} "
                  f"layers, against the paper's {_paper('bytes', 'residual')} and {_paper('bytes', 'full_kv')}")
    out["notes"] = [f"the paper's KB read as KiB; its 5 KB is one residual against all {gemma['layers']} layers' K/V "
                    f"({_x(out['gemma_ratio'])}), but one residual replaces one layer's K/V only: a residual per layer "
                    f"costs r = {_x(gemma['ratio_r'])} the K/V, so residuals save bytes from spacing s* = "
                    f"{gemma['break_even_spacing']} on"]
    return out


def _runs20(results: dict) -> list[dict]:
    """The twenty-turn section's lockstep runs (one per model), the report's model first."""
    runs = [c for c in _cells(results, "turns20") if c["kind"] == "run" and c["json"].get("strategies")]
    return sorted(runs, key=lambda c: c["json"]["model"] != results["model"])


def _lanes20(cell: dict) -> list[dict]:
    return [{"model": cell["json"]["model"], "strategy": spec, "mode": _mode(r),
             "between_turns_peak": r["state_bytes"]["between_turns_peak"], "peak": r["state_bytes"]["peak"],
             "token_match": r["token_match"]} for spec, r in cell["json"]["strategies"].items()]


def _ratio_r(results: dict, model: str):
    """r (a residual's bytes / one layer's K/V) of `model`, from its bytes cell (None if it has none)."""
    own = next((c["json"] for c in _cells(results, "bytes") if c["json"]["source"] == model), None)
    return None if own is None else own["ratio_r"]


def _lowest(rows: list[dict], prefix: str):
    """The lowest-peak exact lane whose spec starts with `prefix` and whose every token equals the full cache's."""
    exact = [r for r in rows if r["strategy"].startswith(prefix) and r["mode"] == "exact" and r["token_match"] == 1.0]
    return min(exact, key=lambda r: r["peak"], default=None)


def _turns20(results: dict, prefix: str = "kvdirect") -> dict:
    """Claim 2 on KV-Direct's own lane (`prefix`), per model, with r beside it; the report's model decides."""
    runs = _runs20(results)
    first = runs[0]["json"]
    rows = [row for c in runs for row in _lanes20(c)]
    turns = len(first["turn_chunk_ids"])
    out = {"rows": rows, "scenario": runs[0].get("scenario"), "turns": turns, "tokens": len(first["prompt_ids"]),
           "new_tokens": first["max_new_tokens"], "basis": "measured", "ours": {"peak_ratio": None},
           "equal_memory": None, "lane": prefix}
    equal = next((c for c in _cells(results, "turns20") if c["kind"] == "sweep" and c["json"].get("rows")), None)
    if equal is not None:
        out["equal_memory"] = [{"strategy": r["strategy"], "budget": r["budget"], "peak": r["state_bytes"]["peak"],
                                "token_match": r["token_match"]} for r in equal["json"]["rows"]]
        out["equal_memory_target"] = {"spec": equal.get("config", {}).get("target"),
                                      "peak": equal["json"].get("target_bytes")}
    figure = next(f for f in CLAIMS["turns20"].figures if f.key == "peak_ratio")
    name = {"kvdirect": "KV-Direct", "anchorkv": "AnchorKV"}[prefix]
    own_lane = "lane" if prefix == "kvdirect" else "lowest exact lane"
    by_model, notes = [], []
    out["why"] = f"there is no twenty-turn run of {results['model']} in this report"
    for c in runs:
        j, mine = c["json"], [r for r in rows if r["model"] == c["json"]["model"]]
        where = (f"{j['model']}, {len(j['turn_chunk_ids'])} turns of at most {j['max_new_tokens']} new tokens"
                 + ("" if len(j["turn_chunk_ids"]) == 20 else " (the paper: 20 turns)"))
        full, lane = next((r for r in mine if r["strategy"] == "full"), None), _lowest(mine, prefix)
        entry = {"model": j["model"], "r": _ratio_r(results, j["model"]), "full_peak": full and full["peak"],
                 "lane": lane and lane["strategy"], "lane_peak": lane and lane["peak"], "ratio": None,
                 "verdict": NOT_MEASURED}
        own = j["model"] == results["model"]
        if own:
            out["scope"] = [f"{len(j['turn_chunk_ids'])} turns", f"at most {j['max_new_tokens']} new tokens per turn",
                            f"{len(j['prompt_ids'])} tokens in the first turn"] + ([f"lane {lane['strategy']}"]
                                                                                    if lane else [])
            on = (f"on {j['model']} over {len(j['turn_chunk_ids'])} turns of at most {j['max_new_tokens']} new "
                  "tokens each")
        if full is None or lane is None:
            missing = "no full-cache lane" if full is None else f"no exact {name} lane with every token equal"
            notes.append(f"{where}: {missing}")
            if own:
                out["why"] = f"{on}, there was {missing}"
        else:
            entry["ratio"] = full["peak"] / lane["peak"]
            entry["verdict"] = judge(figure.value, entry["ratio"], figure.direction, figure.tolerance, figure.neutral)
            r = "r not computed" if entry["r"] is None else f"r = {number(entry['r'])}"
            notes.append(f"{where} ({r}): {lane['strategy']} peaks at {fmt_bytes(lane['peak'])} against the full "
                         f"cache's {fmt_bytes(full['peak'])}, {_x(entry['ratio'])} ({entry['verdict']})"
                         + ("; a residual at every layer outweighs that layer's K/V where r > 1 (see 1.)"
                            if prefix == "kvdirect" and entry["r"] is not None and entry["r"] > 1 else ""))
            if own:
                heavy = prefix == "kvdirect" and entry["r"] is not None and entry["r"] > 1 and entry["ratio"] < 1
                out["why"] = (f"{on}, {name}'s {own_lane} {lane['strategy']} peaks at {fmt_bytes(lane['peak'])} "
                              f"against the full cache's {fmt_bytes(full['peak'])}, a ratio of {_x(entry['ratio'])} "
                              f"where the paper has {_paper('turns20', 'peak_ratio')}"
                              + (f", because the residual it keeps at every layer weighs r = {_x(entry['r'])} that "
                                 "layer's K/V" if heavy else ""))
        by_model.append(entry)
    out["by_model"] = by_model
    if by_model and by_model[0]["model"] == results["model"]:
        out["ours"]["peak_ratio"] = by_model[0]["ratio"]
    notes.append(f"judged on {results['model']}'s {name} lane; the paper's 42 MB and 103 MB are for its own model and "
                 "conversation, so only their ratio carries over")
    out["answers"] = _answers20(results)
    out["also"] = _answers_note(out["answers"], prefix)  # on the card under the verdict's sentence
    notes.append(out["also"])
    return {**out, "notes": notes}


ANSWER_TURNS = (5, 10, 20)  # the turns at which the twenty-turn section scores answers about turn 1


def _answers20(results: dict) -> dict | None:
    """The twenty-turn section in answers: the `bench tasks --multiturn` cell's conversations (turn 1 a context with a
    needle for each asking turn, 5, 10 and 20, the turns between chat), each lane's mean score at the asking turns,
    its answers equal to the full cache's in every turn, and the bytes it held."""
    cell = next((c for c in _cells(results, "turns20") if c["kind"] == "tasks"), None)
    if cell is None:
        return None
    j = cell["json"]
    at = j.get("asked") or [t for t in ANSWER_TURNS if t <= j["turns"]] or [j["turns"]]
    lanes = []
    for spec, turns in j["by_turn"].items():
        row = next(r for r in j["rows"] if r["spec"] == spec)
        own = "from_context" in turns[0]  # a report made before answers were scored from the context: raw
        lanes.append({"strategy": spec, "kind": row["kind"],
                      "scores": [turns[t - 1]["from_context" if own else "score"] for t in at],
                      "raw_scores": [turns[t - 1]["score"] for t in at], "copies": sum(t.get("copies", 0) for t in turns),
                      "mean": row.get("score_from_context", row["score"]),
                      "equal_full": sum(t["answers_equal_full"] for t in turns),
                      "answers": sum(t["n"] for t in turns), "held_bytes": row["held_bytes_mean"]})
    return {"model": j["model"], "turns": j["turns"], "at": at, "asked": j.get("asked"),
            "conversations": len(j["cells"]),
            "contexts": j["contexts"], "budgets": j["budgets"], "lanes": lanes,
            "exact_equal": j["exact_answers_equal_full"]}


def _answers_note(a: dict | None, prefix: str) -> str:
    if a is None:
        return "answers: not measured (no multi-turn task cell in this report)"
    turns = "/".join(map(str, a["at"]))  # "5/10/20": a number before ", " would read as "5," in the report
    by = {r["strategy"].split(":")[0]: r for r in a["lanes"]}
    scores = lambda r: "/".join(number(x) for x in r["scores"])  # noqa: E731
    mine = by.get(prefix)
    lossy = [r for r in a["lanes"] if r["kind"] == "lossy"]
    return (f"answers about turn 1 at turns {turns} ({_count(a['conversations'], 'conversation')} of {a['turns']} "
            f"turns on {a['model']}, {'/'.join(map(str, a['contexts']))} tokens, budget "
            f"{'/'.join(map(str, a['budgets']))}): the full cache scores {scores(by['full'])}"
            + (f"; {mine['strategy']} {scores(mine)}, {mine['equal_full']} of {mine['answers']} answers equal to the "
               "full cache's" if mine else f"; no {prefix} lane")
            + ("; " + ", ".join(f"{r['strategy'].split(':')[0]} {scores(r)}" for r in lossy) if lossy else ""))


def _turns20_anchorkv(results: dict) -> dict:
    return _turns20(results, "anchorkv")


CLAIM3_BASELINES = ("h2o", "streaming_llm", "snapkv", "tova", "window")  # the methods claim 3's quote names


def _agreement(results: dict) -> dict:
    sweep = _cells(results, "agreement")[0]["json"]
    rows = [{"strategy": r["strategy"], "budget": r["budget"], "mode": _mode(r), "token_match": r["token_match"],
             "teacher_forced": r.get("teacher_forced_agreement"), "peak": r["state_bytes"]["peak"]}
            for r in sweep["rows"]]
    exact = [r for r in rows if r["mode"] == "exact"]
    baselines = [r for r in rows if r["mode"] is None and r["strategy"] in CLAIM3_BASELINES]
    unnamed = sorted({r["strategy"] for r in rows if r["mode"] is None and r["strategy"] not in CLAIM3_BASELINES})
    out = {"rows": rows, "basis": "measured", "budgets": sweep["budgets"],
           "ours": {"exact": min((r["token_match"] for r in exact), default=None), "baselines": None}}
    notes = [f"recall scenario on {sweep['model']}, budgets {', '.join(map(str, sweep['budgets']))}, every budget "
             "counted"]
    named = sorted({r["strategy"] for r in baselines})
    out["model"] = sweep["model"]
    out["scope"] = ["recall scenario", f"budgets {', '.join(map(str, sweep['budgets']))}",
                    f"exact: {', '.join(sorted({r['strategy'] for r in exact})) or 'none'}",
                    f"baselines: {', '.join(named) or 'none'}"]
    exact_words = ("no exact-mode strategy ran" if not exact else
                   f"the exact strategies kept a token match of {figure_text(out['ours']['exact'], '')} (the paper: "
                   f"{_paper('agreement', 'exact')})")
    base_words = f"none of the {_count(len(CLAIM3_BASELINES), 'named baseline')} ran"
    if baselines:
        high = max(baselines, key=lambda r: r["token_match"])
        out["ours"]["baselines"] = [min(r["token_match"] for r in baselines), high["token_match"]]
        notes.append(f"the highest baseline: {high['strategy']} at budget {high['budget']}")
        base_words = (f"the {_count(len(named), 'named baseline')} {figure_text(out['ours']['baselines'], '')}, the "
                      f"highest {high['strategy']} at budget {high['budget']} (the paper: "
                      f"{_paper('agreement', 'baselines')})")
    out["why"] = (f"on {sweep['model']}'s recall scenario at budgets {_listed(sweep['budgets'])}, {exact_words} and "
                  f"{base_words}")
    if unnamed:
        notes.append(f"{', '.join(unnamed)} listed, not counted: the claim names its five baselines")
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
    where = f"{j['device']}, {j['dtype']}, {_count(j['threads'], 'thread')}, {j['model']} layer {j['layer']}"
    out["model"] = j["model"]
    out["scope"] = [f"layer {j['layer']}", j["dtype"], _count(j["threads"], "thread"),
                    f"batches {', '.join(map(str, sorted({r['batch'] for r in j['rows']})))}",
                    f"contexts {', '.join(map(str, sorted({r['context'] for r in j['rows']})))}"]
    if s["best_speedup"] is None:
        return {**out, "notes": [f"every cell was skipped on {where}"], "why": f"every cell was skipped on {where}"}
    host = s["best_host_speedup"] is not None and s["best_host_speedup"] > s["best_speedup"]
    out["ours"]["speedup"] = s["best_host_speedup"] if host else s["best_speedup"]
    at = s["best_host_at"] if host else s["best_at"]
    notes = [f"best at batch {at['batch']}, context {at['context']}"
             + (" with K/V copied from host memory" if host else " with K/V in device memory") + f", on {where}",
             f"a residual is {j['residual_bytes_per_token']} B against {j['kv_bytes_per_token']} B of K/V per token "
             f"(r = {number(j['ratio_r'])}); the arithmetic-intensity bound allows at most "
             f"{_x(s['largest_bound'])} here"]
    out["why"] = (f"on {j['model']} layer {j['layer']} ({j['device']}, {j['dtype']}, "
                  f"{_count(j['threads'], 'thread')}), the best speed-up of recomputing K/V from the residual over reading them was "
                  f"{_x(out['ours']['speedup'])} (batch {at['batch']}, context {at['context']}, K/V "
                  f"{'copied from host' if host else 'in device'} memory), where the arithmetic-intensity bound allows "
                  f"at most {_x(s['largest_bound'])} for r = {number(j['ratio_r'])} and the paper has up to "
                  f"{_paper('recompute', 'speedup')}")
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
    out["model"] = j["model"]
    out["scope"] = [f"{j['context']} tokens", f"spacing {j['spacing']}", j["dtype"]]
    out["why"] = (f"at {j['context']} tokens with spacing {j['spacing']} on {j['model']} in {j['dtype']}, naive replay "
                  f"took {number(naive['seconds'])} s and cascade replay {number(cascade['seconds'])} s, "
                  f"{_x(out['speedup'])} where the paper has {_paper('replay', 'speedup')} (the layer-pass ratio is "
                  f"{_x(out['ideal'])}), and {out['bit_equal']} of 2 replays were bit-equal to the full cache")
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
    out["model"] = j["model"]
    out["scope"] = [f"{j['context']:,} tokens",
                    f"spacings {', '.join(map(str, sorted({r['spacing'] for r in counted}))) or 'none'} counted"]
    if not counted:
        missing = "no AnchorKV spacing at or past the break-even spacing was parked"
        return {**out, "notes": [missing], "why": f"on {j['model']}, {missing}"}
    least = min(counted, key=lambda r: r[key])
    out["ours"]["capacity"] = [least[key], max(r[key] for r in counted)]
    out["why"] = (f"on {j['model']} at {j['context']:,} tokens, AnchorKV parks "
                  f"{figure_text(out['ours']['capacity'], 'x')} as many sessions as the full cache in the same memory, "
                  + ("at every spacing" if s_star is None else f"at the spacings from the break-even s* = {s_star} on")
                  + f" (the least at spacing {least['spacing']}), where the paper has {_paper('parked', 'capacity')}")
    notes = [f"{j['model']}; the least at spacing {least['spacing']}"]
    below = [r for r in anchors if r not in counted]
    if below:
        notes.append(f"spacings below the break-even s* = {s_star} ("
                     + ", ".join(f"{r['spacing']}: {_x(r[key])}" for r in below)
                     + ") store more than they save, as the config's arithmetic says; the paper's range starts "
                       "where storage is saved, so they are listed, not counted")
    return {**out, "notes": notes}


def _exactness_rows(cell: dict, j: dict) -> list[dict]:
    """One exactness run's rebuilding lanes: a `bench run` JSON, or a real-size run (`claims/realsize.py`,
    labelled with its random weights)."""
    if "lanes" in j:  # random weights at a real config
        return [{"model": f"{j['model']} ({j['label']})", "dtype": j["dtype"], "strategy": spec, "mode": _mode(r),
                 "load": 0, "token_match": 1.0 if r["tokens_equal"] else 0.0, "kv_exact": r["kv_exact"],
                 "rebuilt": r["rebuilt_token_layers"], "max_abs_dk": r["max_abs_dk"], "bytes_match": r["bytes_match"],
                 "forward_kernels": j["kernels"]["mode"], "rebuild_kernels": r["kernels"]["rebuild"]}
                for spec, r in j["lanes"].items() if spec != "full" and _mode(r) is not None]
    return [{"model": j["model"], "dtype": j["dtype"], "strategy": spec, "mode": _mode(r),
             "load": cell.get("load", 0), "token_match": r["token_match"], "kv_exact": r["kv_exact"],
             "rebuilt": r["rebuilt_token_layers"], "max_abs_dk": r["max_abs_dk"],
             "forward_kernels": (j.get("kernels") or {}).get("mode", UNRECORDED),
             "rebuild_kernels": (r.get("kernels") or {}).get("rebuild", UNRECORDED)}
            for spec, r in j["strategies"].items()
            if spec != "full" and _mode(r) is not None]  # the full cache and the baselines rebuild nothing


def _on_accelerator(cell: dict) -> bool:
    return str((cell.get("env") or {}).get("device", "")).startswith("cuda")


def _exactness_accelerator(results: dict) -> dict:
    return _exactness(results, accelerator=True)


def _exactness(results: dict, accelerator: bool = False) -> dict:
    """Claim 7 on the CPU runs (7b: on the accelerator runs; not measured where none ran)."""
    rows, mine = [], [c for c in _cells(results, "exactness") if _on_accelerator(c) == accelerator]
    for c in mine:
        for j in c["json"].get("runs", [c["json"]]):
            rows += _exactness_rows(c, j)
    counted = [r for r in rows if r["mode"] == "exact" and r["rebuilt"]]
    fast = [r for r in rows if r["mode"] == "fast" and r["rebuilt"]]
    idle = [r for r in rows if r["mode"] in ("exact", "fast") and not r["rebuilt"]]
    unrecorded = [r for r in rows if r["mode"] == UNRECORDED]
    out = {"rows": rows, "basis": "measured", "counted": len(counted), "idle": len(idle),
           "ours": {"kv": None, "tokens": None}, "measured_on": measured_on(results, "exactness", mine)}
    notes = []
    on = "an accelerator" if accelerator else "a CPU"
    out["why"] = f"no exact-mode run on {on} rebuilt K/V in this report" + (
        f" ({len(unrecorded)} runs with {UNRECORDED})" if unrecorded else "")
    if counted:
        out["kv_equal"] = sum(1 for r in counted if r["kv_exact"])
        out["tokens_equal"] = sum(1 for r in counted if r["token_match"] == 1.0)
        out["ours"] = {"kv": out["kv_equal"] / len(counted), "tokens": out["tokens_equal"] / len(counted)}
        dtypes = sorted({r["dtype"] for r in counted})
        models = sorted({r["model"] for r in counted})
        out["model"] = f"{_count(len(models), 'model')}: {', '.join(models)}"
        out["scope"] = [", ".join(dtypes), f"{len(counted)} exact-mode runs that rebuilt K/V"]
        out["why"] = (f"{out['kv_equal']} of {len(counted)} exact-mode runs on {on} that rebuilt K/V were bit-equal "
                      f"to the full cache and {out['tokens_equal']} had every greedy token equal, over "
                      f"{_count(len(models), 'model')} in {_listed(dtypes)}")
        notes.append(f"{out['kv_equal']} of {len(counted)} exact-mode runs that rebuilt K/V bit-equal, "
                     f"{out['tokens_equal']} with every token equal ({', '.join(models)}; {', '.join(dtypes)}; "
                     f"{sum(1 for r in counted if r['load'])} under busy processes)")
    real = [r for r in rows if "bytes_match" in r]
    if real:
        notes.append(f"{len(real)} of them at real size with random weights ({', '.join(sorted({r['model'] for r in real}))}"
                     f"): allocator bytes equal to the formula in {sum(1 for r in real if r['bytes_match'])} of "
                     f"{len(real)}")
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
    if accelerator and not rows:
        out.update(basis="not measured", model="no run", measured_on="devices: no accelerator ran in this report",
                   why="no exactness run on an accelerator is in this report")
        notes.append("no exactness run on an accelerator in this report: nothing holds on accelerators until one "
                     "measured it (scripts/device_check.py runs them where a GPU is lent)")
    return {**out, "notes": notes}


def _patching(results: dict) -> dict:
    """Claim 8: KL and max |dlogit| per layer, counted only for models whose control (the last position patched
    alone) moved the distribution at every layer: there the measurement could fail."""
    runs = [c["json"] for c in _cells(results, "patching")]
    rows = [{"model": j["model"], "dtype": j["dtype"], "tokens": j["tokens"], "layers": j["layers"],
             "max_kl": j["max_kl"], "max_abs_dlogit": j["max_abs_dlogit"], "min_control_kl": j["min_control_kl"],
             "zero_layers": sum(1 for r in j["rows"] if r["kl"] == 0 and r["max_abs_dlogit"] == 0)}
            for j in runs]
    counted = [r for r in rows if r["min_control_kl"] > 0]
    out = {"rows": rows, "runs": runs, "basis": "measured", "counted": len(counted),
           "ours": {"kl": None, "dlogit": None}}
    notes = []
    out["why"] = ("no residual-patching cell is in this report" if not rows else
                  "no model's control (its last position patched alone) moved the distribution at every layer, so "
                  "the measurement could not fail")
    if counted:
        out["ours"] = {"kl": max(r["max_kl"] for r in counted), "dlogit": max(r["max_abs_dlogit"] for r in counted)}
        out["model"] = f"{_count(len(counted), 'model')}: {', '.join(r['model'] for r in counted)}"
        out["scope"] = [", ".join(sorted({r["dtype"] for r in counted})),
                        f"{', '.join(map(str, sorted({r['tokens'] for r in counted})))} tokens",
                        f"{sum(r['layers'] for r in counted)} layers in all"]
        out["why"] = (f"with the donor's residual stream patched in at every position of every layer of "
                      f"{_count(len(counted), 'model')}, the largest KL was {number(out['ours']['kl'])} and the "
                      f"largest |logit difference| {number(out['ours']['dlogit'])} (the paper: KL "
                      f"{_paper('patching', 'kl')}), "
                      f"while the last position patched alone moved the distribution at every layer (least KL "
                      f"{number(min(r['min_control_kl'] for r in counted))})")
        zero = sum(1 for r in counted if r["zero_layers"] == r["layers"])
        notes.append(f"{zero} of {len(counted)} models with KL 0 and equal logits at every layer "
                     f"({', '.join(r['model'] for r in counted)}); donor and recipient prompts of different tasks, "
                     f"cut to the same length ({', '.join(sorted({str(r['tokens']) for r in counted}))} tokens)")
        notes.append("control, the donor's residual at the last position only: smallest KL over layers "
                     + ", ".join(f"{r['model']} {number(r['min_control_kl'])}" for r in counted)
                     + " (above 0: the measurement can fail)")
    uncounted = [r for r in rows if r not in counted]
    if uncounted:
        notes.append(f"not counted, the control left the distribution unchanged at some layer (the measurement could "
                     f"not fail there): {', '.join(r['model'] for r in uncounted)}")
    if not rows:
        notes.append("no residual-patching cell in this report")
    return {**out, "notes": notes}


def changes_scores(deltas: list[float]) -> dict:
    """Claim 9's one rule (`papers.CLAIMS["tasks"].rule`): a method changes task scores when a one-sided exact sign
    test on its per-sample scores against the full cache's (`deltas`: its score minus the full cache's, per sample)
    says it scores lower at `stats.LEVEL`; too few samples to reach that level is "not enough samples"
    (`stats.changes`)."""
    return stats.changes(deltas)


def _tasks(results: dict) -> dict:
    """Claim 9 from every sample's answers: each exact method's samples whose answer and score equal the full
    cache's, and which of the external lossy methods change task scores (`changes_scores`), all of them required,
    each with enough samples to reach the test's level."""
    runs = [c["json"] for c in _cells(results, "tasks")]
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
    methods = {m: {**changes_scores(ds), "cells": len(ds), "mean_delta": statistics.fmean(ds)}
               for m, ds in lossy.items()}
    ran = [m for m in EXTERNAL if m in methods]
    missing = [m for m in EXTERNAL if m not in methods]
    too_few = [m for m in ran if methods[m]["verdict"] == stats.TOO_FEW]
    out = {"basis": "measured" if exact or lossy else "not measured", "methods": methods, "level": stats.LEVEL,
           "exact": {m: {"equal": sum(v), "cells": len(v)} for m, v in exact.items()},
           "rows": [r for j in runs for r in j["rows"]]}
    out["ours"] = {**{m: sum(exact[m]) / len(exact[m]) if exact.get(m) else None for m in EXACT_METHODS},
                   "lossy": None if missing or too_few else
                   sum(methods[m]["verdict"] == stats.CHANGES for m in EXTERNAL) / len(EXTERNAL)}
    sampled = [j for j in runs if j["cells"]]
    union = lambda key: sorted({x for j in sampled for x in j[key]})  # noqa: E731
    samples, contexts, budgets = sum(len(j["cells"]) for j in sampled), union("contexts"), union("budgets")
    settings = sorted({j.get("question", "with-context") for j in sampled})
    if sampled:
        out["scope"] = [_count(samples, "sample"), f"tasks {', '.join(union('tasks'))}",
                        f"{_count(len(contexts), 'context length')}: {', '.join(map(str, contexts))} tokens",
                        f"{'budget' if len(budgets) == 1 else 'budgets'} {', '.join(map(str, budgets))}",
                        f"the question read {' and '.join(QUESTION_WORDS[q] for q in settings)}"]
    names = {"anchorkv": "AnchorKV", "kvdirect": "KV-Direct"}
    exact_words = [f"{names[m]} in {sum(exact[m])} of {len(exact[m])}" for m in EXACT_METHODS if exact.get(m)]
    exact_words = (f"{_listed(exact_words)} samples answered and scored as the full cache did" if exact_words else
                   "no exact lane ran")
    changed = [m for m in ran if methods[m]["verdict"] == stats.CHANGES]
    lossy_words = (f"only {len(ran)} of the {len(EXTERNAL)} external lossy methods ran, so their part is not measured"
                   if missing else
                   f"{_count(samples, 'sample')} cannot reach the sign test's level of {stats.LEVEL:g} "
                   f"({', '.join(too_few)}), so the lossy part is not measured: not enough samples" if too_few else
                   f"{len(changed)} of the {len(EXTERNAL)} external lossy methods scored lower than the full cache "
                   f"beyond noise (one-sided exact sign test on {_count(samples, 'sample')}, p < {stats.LEVEL:g}: "
                   + ", ".join(f"{m} p = {number(methods[m]['p'])}" for m in EXTERNAL) + ")")
    out["why"] = (f"on {_count(samples, 'sample')} of {_count(len(union('tasks')), 'task')} "
                  f"({', '.join(union('tasks'))}) at {_count(len(contexts), 'context length')} "
                  f"({_listed(contexts)} tokens) and {'budget' if len(budgets) == 1 else 'budgets'} "
                  f"{_listed(budgets)}, {exact_words}, and {lossy_words}" if sampled else
                  "no task sample is in this report")
    notes = []
    for j in sampled:
        notes.append(f"{len(j['cells'])} samples ({', '.join(j['tasks'])}; contexts "
                     f"{', '.join(map(str, j['contexts']))} tokens; budgets {', '.join(map(str, j['budgets']))}; the "
                     f"question read {QUESTION_WORDS[j.get('question', 'with-context')]}), the full cache scoring "
                     f"{number(statistics.fmean(c['lanes']['full']['score'] for c in j['cells']))} (the reference)")
    if methods:
        notes.append("lossy methods against the full cache, per sample (one-sided exact sign test, ties left out): "
                     + ", ".join(f"{m}{'' if m in EXTERNAL else ' (ours, not counted)'} {v['verdict']} "
                                 f"(p = {number(v['p'])}; {v['lower']} lower / {v['higher']} higher of {v['cells']}; "
                                 f"mean change {number(v['mean_delta'])})" for m, v in methods.items()))
    if missing:
        notes.append(f"not run: {', '.join(missing)}")
    if not exact and not lossy:
        notes.append("no task sample in this report")
    return {**out, "notes": notes}


QUESTION_WORDS = {"after": "after the context was compressed alone (kvpress's setting)",
                  "with-context": "inside the compressed prompt (the SnapKV paper's setting)"}


BUILDERS = {"bytes": _bytes, "turns20": _turns20, "turns20_anchorkv": _turns20_anchorkv, "agreement": _agreement,
            "recompute": _recompute, "replay": _replay, "parked": _parked, "exactness": _exactness,
            "exactness_accelerator": _exactness_accelerator, "patching": _patching, "tasks": _tasks}


# --- the verdicts ------------------------------------------------------------------------------------------------
def _kernels(cell: dict) -> str:
    """The kernels a cell's numbers came from, as its JSON records them."""
    k = cell["json"].get("kernels")
    if isinstance(k, dict):
        return k.get("mode", UNRECORDED)
    if isinstance(k, str):
        return k
    return "none (arithmetic)" if not (cell.get("env") or {}).get("threads") else "not recorded"


def measured_on(results: dict, section: str, cells: list[dict] | None = None) -> str:
    """Devices and kernels of a section's cells (or of `cells`), in words: what a verdict's scope is."""
    cells = _cells(results, section) if cells is None else cells
    devices = sorted({str((c.get("env") or {}).get("device", "not recorded")) for c in cells})
    kernels = sorted({_kernels(c) for c in cells})
    return f"devices: {', '.join(devices) or 'none'}; kernels: {', '.join(kernels) or 'none'}"


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
            parts.append({"key": f.key, "ours": ours[f.key], "verdict": verdict,
                          "words": f"{f.measures}: {figure_text(ours[f.key], f.unit)} here against "
                                   f"{figure_text(f.value, f.unit)} in the paper"
                                   + (f" (this part {stated(verdict)})" if len(claim.figures) > 1 else "")})
        models = sorted({f.model for f in claim.figures})
        verdict = worst(p["verdict"] for p in parts)
        reason = "; ".join([p["words"] for p in parts] + notes + [f"the paper's model: {', '.join(models)}"])
        model = section.pop("model", results["model"])
        claims[name] = {**claim.as_dict(), "parts": parts, "basis": section.pop("basis"), "model": model,
                        "scope": "; ".join([model, *section.pop("scope", [])]), "verdict": verdict,
                        "measured_on": section.pop("measured_on", None) or measured_on(results, section_of(name)),
                        "sentence": f"Claim {claim.title.split('.')[0]} {stated(verdict)}: {section.pop('why')}.",
                        "reason": reason[0].upper() + reason[1:] + ".",
                        **({"also": section.pop("also")} if "also" in section else {})}
        sections[name] = {**section, "ran_on": environments(results, section_of(name))}
    return claims, sections
