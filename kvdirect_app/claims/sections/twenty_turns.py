"""Claim 2 (and 2b on AnchorKV's lanes), twenty turns: the full cache's peak over a conversation against
the exact lane's, per model, and the same section in answers about turn 1."""

from __future__ import annotations

from ...plain.units import fmt_bytes
from ..papers import CLAIMS
from ..render import number
from ..verdicts import NOT_MEASURED, judge
from .common import paper_figure, plural, run_mode, section_cells, times


def _lockstep_runs(results: dict) -> list[dict]:
    """The twenty-turn section's lockstep runs (one per model), the report's model first."""
    runs = [c for c in section_cells(results, "turns20") if c["kind"] == "run" and c["json"].get("strategies")]
    return sorted(runs, key=lambda c: c["json"]["model"] != results["model"])


def _lane_rows(cell: dict) -> list[dict]:
    """One row per lane of a lockstep run: its mode, its peaks (between turns and overall), its token match."""
    return [
        {
            "model": cell["json"]["model"],
            "strategy": spec,
            "mode": run_mode(r),
            "between_turns_peak": r["state_bytes"]["between_turns_peak"],
            "peak": r["state_bytes"]["peak"],
            "token_match": r["token_match"],
        }
        for spec, r in cell["json"]["strategies"].items()
    ]


def _ratio_r(results: dict, model: str):
    """r (a residual's bytes / one layer's K/V) of `model`, from its bytes cell (None if it has none)."""
    own = next((c["json"] for c in section_cells(results, "bytes") if c["json"]["source"] == model), None)
    return None if own is None else own["ratio_r"]


def _lowest(rows: list[dict], prefix: str):
    """The lowest-peak exact lane whose spec starts with `prefix` and whose every token equals the full cache's."""
    exact = [r for r in rows if r["strategy"].startswith(prefix) and r["mode"] == "exact" and r["token_match"] == 1.0]
    return min(exact, key=lambda r: r["peak"], default=None)


def build(results: dict, prefix: str = "kvdirect") -> dict:
    """Claim 2 on KV-Direct's own lane (`prefix`; 2b: AnchorKV's), per model, with r beside it; the report's model
    decides."""
    runs = _lockstep_runs(results)
    first = runs[0]["json"]
    rows = [row for c in runs for row in _lane_rows(c)]
    turns = len(first["turn_chunk_ids"])
    out = {
        "rows": rows,
        "scenario": runs[0].get("scenario"),
        "turns": turns,
        "tokens": len(first["prompt_ids"]),
        "new_tokens": first["max_new_tokens"],
        "basis": "measured",
        "ours": {"peak_ratio": None},
        "equal_memory": None,
        "lane": prefix,
    }
    equal = next((c for c in section_cells(results, "turns20") if c["kind"] == "sweep" and c["json"].get("rows")), None)
    if equal is not None:
        out["equal_memory"] = [
            {
                "strategy": r["strategy"],
                "budget": r["budget"],
                "peak": r["state_bytes"]["peak"],
                "token_match": r["token_match"],
            }
            for r in equal["json"]["rows"]
        ]
        out["equal_memory_target"] = {
            "spec": equal.get("config", {}).get("target"),
            "peak": equal["json"].get("target_bytes"),
        }
    figure = next(f for f in CLAIMS["turns20"].figures if f.key == "peak_ratio")
    name = {"kvdirect": "KV-Direct", "anchorkv": "AnchorKV"}[prefix]
    own_lane = "lane" if prefix == "kvdirect" else "lowest exact lane"
    by_model, notes = [], []
    out["why"] = f"there is no twenty-turn run of {results['model']} in this report"
    for c in runs:
        j, mine = c["json"], [r for r in rows if r["model"] == c["json"]["model"]]
        where = f"{j['model']}, {len(j['turn_chunk_ids'])} turns of at most {j['max_new_tokens']} new tokens" + (
            "" if len(j["turn_chunk_ids"]) == 20 else " (the paper: 20 turns)"
        )
        full, lane = next((r for r in mine if r["strategy"] == "full"), None), _lowest(mine, prefix)
        entry = {
            "model": j["model"],
            "r": _ratio_r(results, j["model"]),
            "full_peak": full and full["peak"],
            "lane": lane and lane["strategy"],
            "lane_peak": lane and lane["peak"],
            "ratio": None,
            "verdict": NOT_MEASURED,
        }
        own = j["model"] == results["model"]
        if own:
            out["scope"] = [
                f"{len(j['turn_chunk_ids'])} turns",
                f"at most {j['max_new_tokens']} new tokens per turn",
                f"{len(j['prompt_ids'])} tokens in the first turn",
            ] + ([f"lane {lane['strategy']}"] if lane else [])
            on = (
                f"on {j['model']} over {len(j['turn_chunk_ids'])} turns of at most {j['max_new_tokens']} new "
                "tokens each"
            )
        if full is None or lane is None:
            missing = "no full-cache lane" if full is None else f"no exact {name} lane with every token equal"
            notes.append(f"{where}: {missing}")
            if own:
                out["why"] = f"{on}, there was {missing}"
        else:
            entry["ratio"] = full["peak"] / lane["peak"]
            entry["verdict"] = judge(figure.value, entry["ratio"], figure.direction, figure.tolerance, figure.neutral)
            r = "r not computed" if entry["r"] is None else f"r = {number(entry['r'])}"
            notes.append(
                f"{where} ({r}): {lane['strategy']} peaks at {fmt_bytes(lane['peak'])} against the full "
                f"cache's {fmt_bytes(full['peak'])}, {times(entry['ratio'])} ({entry['verdict']})"
                + (
                    "; a residual at every layer outweighs that layer's K/V where r > 1 (see 1.)"
                    if prefix == "kvdirect" and entry["r"] is not None and entry["r"] > 1
                    else ""
                )
            )
            if own:
                heavy = prefix == "kvdirect" and entry["r"] is not None and entry["r"] > 1 and entry["ratio"] < 1
                out["why"] = (
                    f"{on}, {name}'s {own_lane} {lane['strategy']} peaks at {fmt_bytes(lane['peak'])} "
                    f"against the full cache's {fmt_bytes(full['peak'])}, a ratio of {times(entry['ratio'])} "
                    f"where the paper has {paper_figure('turns20', 'peak_ratio')}"
                    + (
                        f", because the residual it keeps at every layer weighs r = {times(entry['r'])} that "
                        "layer's K/V"
                        if heavy
                        else ""
                    )
                )
        by_model.append(entry)
    out["by_model"] = by_model
    if by_model and by_model[0]["model"] == results["model"]:
        out["ours"]["peak_ratio"] = by_model[0]["ratio"]
    notes.append(
        f"judged on {results['model']}'s {name} lane; the paper's 42 MB and 103 MB are for its own model and "
        "conversation, so only their ratio carries over"
    )
    out["answers"] = answer_scores(results)
    out["also"] = answers_note(out["answers"], prefix)  # on the card under the verdict's sentence
    notes.append(out["also"])
    return {**out, "notes": notes}


ANSWER_TURNS = (5, 10, 20)  # the turns at which the twenty-turn section scores answers about turn 1


def answer_scores(results: dict) -> dict | None:
    """The twenty-turn section in answers: the `bench tasks --multiturn` cell's conversations (turn 1 a context with a
    needle for each asking turn, 5, 10 and 20, the turns between chat), each lane's mean score at the asking turns,
    its answers equal to the full cache's in every turn, and the bytes it held."""
    cell = next((c for c in section_cells(results, "turns20") if c["kind"] == "tasks"), None)
    if cell is None:
        return None
    j = cell["json"]
    at = j.get("asked") or [t for t in ANSWER_TURNS if t <= j["turns"]] or [j["turns"]]
    lanes = []
    for spec, turns in j["by_turn"].items():
        row = next(r for r in j["rows"] if r["spec"] == spec)
        own = "from_context" in turns[0]  # a report made before answers were scored from the context: raw
        lanes.append(
            {
                "strategy": spec,
                "kind": row["kind"],
                "scores": [turns[t - 1]["from_context" if own else "score"] for t in at],
                "raw_scores": [turns[t - 1]["score"] for t in at],
                "copies": sum(t.get("copies", 0) for t in turns),
                "mean": row.get("score_from_context", row["score"]),
                "equal_full": sum(t["answers_equal_full"] for t in turns),
                "answers": sum(t["n"] for t in turns),
                "held_bytes": row["held_bytes_mean"],
            }
        )
    return {
        "model": j["model"],
        "turns": j["turns"],
        "at": at,
        "asked": j.get("asked"),
        "conversations": len(j["cells"]),
        "contexts": j["contexts"],
        "budgets": j["budgets"],
        "lanes": lanes,
        "exact_equal": j["exact_answers_equal_full"],
    }


def answers_note(a: dict | None, prefix: str) -> str:
    """`answer_scores` in one line (on the claim's card, under the verdict's sentence)."""
    if a is None:
        return "answers: not measured (no multi-turn task cell in this report)"
    turns = "/".join(map(str, a["at"]))  # "5/10/20": a number before ", " would read as "5," in the report
    by = {r["strategy"].split(":")[0]: r for r in a["lanes"]}
    scores = lambda r: "/".join(number(x) for x in r["scores"])  # noqa: E731
    mine = by.get(prefix)
    lossy = [r for r in a["lanes"] if r["kind"] == "lossy"]
    return (
        f"answers about turn 1 at turns {turns} ({plural(a['conversations'], 'conversation')} of {a['turns']} "
        f"turns on {a['model']}, {'/'.join(map(str, a['contexts']))} tokens, budget "
        f"{'/'.join(map(str, a['budgets']))}): the full cache scores {scores(by['full'])}"
        + (
            f"; {mine['strategy']} {scores(mine)}, {mine['equal_full']} of {mine['answers']} answers equal to the "
            "full cache's"
            if mine
            else f"; no {prefix} lane"
        )
        + ("; " + ", ".join(f"{r['strategy'].split(':')[0]} {scores(r)}" for r in lossy) if lossy else "")
    )


def build_anchorkv(results: dict) -> dict:
    """Claim 2b: the same section judged on AnchorKV's lowest exact lane."""
    return build(results, "anchorkv")
