"""The summary of a `bench tasks` run's scores (`summarise`), kept in the results file beside the cells (`runner`):
per strategy and budget the mean score beside the full cache's (the reference: a 135M model misses some needles with
every token kept), the compression ratio by kvpress's convention (the share of the prompt's K/V tokens a layer drops:
1 - budget / prompt tokens, for an evicting strategy) beside the measured one (the share of the full cache's bytes it
does not hold after the answer, by the allocator: a strategy that keeps whole layers, or more than its budget, shows
here what the nominal ratio cannot), the measured bytes held after the answer (what the budget buys; the frontier's
axis) and peak during it (for an evicting strategy, the whole prompt's K/V before it is trimmed); per strategy and
budget, the score by context and depth (the needle heatmap); kvpress's leaderboard rows for a run at compression
ratios (`leaderboard`); with --multiturn each lane's score by turn (`by_turn`).
"""

from __future__ import annotations

import statistics

from ...plain import stats


def compression_ratio(budget: int | None, compressed_tokens: int, exact: bool) -> float:
    """kvpress's convention: the share of the compressed tokens' K/V (the context alone with --question after, the
    whole prompt with the question in it) a layer drops (0 for a strategy that keeps or rebuilds them all)."""
    if exact or budget is None:
        return 0.0
    return max(0.0, 1.0 - budget / compressed_tokens)


def measured_compression(held: int | None, full_held: int | None) -> float | None:
    """The share of the full cache's bytes a lane does not hold after the answer, both measured in the same cell:
    1 - held / the full cache's held (below 0 where it holds more); None where either was not measured.  The nominal
    ratio counts one layer's tokens by the budget; this counts what the allocator says the lane holds (KNorm's whole
    layers, a strategy that keeps more than its budget)."""
    if held is None or not full_held:
        return None
    return 1.0 - held / full_held


def cells_measured_compression(cells: list[dict], spec: str) -> float | None:
    """`measured_compression` of lane `spec`, the mean over `cells` (each cell's lane against its own full cache)."""
    return _mean(measured_compression(c["lanes"][spec]["held_bytes"], c["lanes"]["full"]["held_bytes"]) for c in cells)


def compressed_tokens(cell: dict, question: str) -> int:
    """The tokens a cell's lanes compressed: its context with --question after, its whole prompt otherwise."""
    return cell["context_tokens"] if question == "after" else cell["prompt_tokens"]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarise(cells: list[dict], question: str = "with-context") -> dict:
    """Per lane (spec): mean score, the full cache's mean on the same cells, compression ratio, peak bytes,
    whether an exact lane equalled the full cache everywhere; and the heatmap (context x depth) per lane.  A run
    with lanes at compression ratios also gets each row's ratio and kvpress's leaderboard rows (`leaderboard`); a
    multi-turn run, each lane's score by turn (`by_turn`; a cell's score is then the mean over its turns), and its
    score from the context beside it (its own earlier answers copied not counted)."""
    specs = list(cells[0]["lanes"]) if cells else []
    ratios = any(a.get("ratio") for a in cells[0]["lanes"].values()) if cells else False  # a run at --ratios
    heat = {}
    for spec in specs:
        grid: dict[tuple, list[float]] = {}
        for c in cells:
            grid.setdefault((c["context"], c["depth"]), []).append(c["lanes"][spec]["score"])
        heat[spec] = [
            {"context": k[0], "depth": k[1], "score": statistics.fmean(v), "n": len(v)}
            for k, v in sorted(grid.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1]))
        ]
    return {
        "rows": _rows(cells, ratios, question),
        "heatmap": heat,
        **({"leaderboard": leaderboard(cells, question)} if ratios else {}),
        **({"by_turn": by_turn(cells)} if cells and "turns" in cells[0] else {}),
    }


def by_turn(cells: list[dict]) -> dict:
    """--multiturn: per lane (spec) and turn, over the conversations: the mean score of the answers (`score`) and
    its 95 % bootstrap interval (`low`, `high`), the same counting only what was found in the context
    (`from_context`, `from_context_low`, `from_context_high`: an answer copied from the lane's own earlier replies
    scores 0 there), the answers that copied (`copies`), and how many answers equal the full cache's.  A turn that
    asks nothing (--asked) has no score."""
    out = {}
    for spec in cells[0]["lanes"]:
        rows = []
        for n in range(len(cells[0]["turns"])):
            raw = [c["lanes"][spec]["scores"][n] for c in cells if c["lanes"][spec]["scores"][n] is not None]
            own = [
                c["lanes"][spec]["scores_from_context"][n]
                for c in cells
                if c["lanes"][spec]["scores_from_context"][n] is not None
            ]
            (low, high), (own_low, own_high) = (stats.bootstrap_interval(v) or (None, None) for v in (raw, own))
            rows.append(
                {
                    "turn": n + 1,
                    "score": _mean(raw),
                    "low": low,
                    "high": high,
                    "from_context": _mean(own),
                    "from_context_low": own_low,
                    "from_context_high": own_high,
                    "copies": sum(c["lanes"][spec]["copied_turns"][n] for c in cells),
                    "answers_equal_full": sum(c["lanes"][spec]["equal_full_turns"][n] for c in cells),
                    "n": len(cells),
                }
            )
        out[spec] = rows
    return out


def _rows(cells: list[dict], ratios: bool, question: str = "with-context") -> list[dict]:
    rows = []
    full_mean = statistics.fmean(c["lanes"]["full"]["score"] for c in cells) if cells else None
    multi = bool(cells) and "turns" in cells[0]
    for spec in cells[0]["lanes"] if cells else []:
        lanes = [c["lanes"][spec] for c in cells]
        first = lanes[0]
        ratio = first.get("ratio")
        own = (
            {
                "score_from_context": statistics.fmean(a["score_from_context"] for a in lanes),
                "full_score_from_context": statistics.fmean(c["lanes"]["full"]["score_from_context"] for c in cells),
                "copies": sum(a["copies"] for a in lanes),
            }
            if multi
            else {}
        )
        rows.append(
            {
                "spec": spec,
                # what ran, every setting named (cells from before it was recorded: the lane's key)
                "full_spec": first.get("full_spec", spec),
                "strategy": first["strategy"],
                "budget": None if ratio else first["budget"],
                **({"ratio": ratio} if ratios else {}),
                "kind": "exact" if first["exact"] else "lossy",
                "score": statistics.fmean(a["score"] for a in lanes),
                "full_score": full_mean,
                **own,
                "cells": len(lanes),
                "cells_below_full": sum(a["score"] < c["lanes"]["full"]["score"] for a, c in zip(lanes, cells)),
                "cells_above_full": sum(a["score"] > c["lanes"]["full"]["score"] for a, c in zip(lanes, cells)),
                "answers_equal_full": sum(a["equal_full"] for a in lanes),
                "compression_ratio": statistics.fmean(
                    compression_ratio(a["budget"], compressed_tokens(c, question), a["exact"])
                    for a, c in zip(lanes, cells)
                ),
                "measured_compression": cells_measured_compression(cells, spec),
                "held_bytes_mean": _mean(a["held_bytes"] for a in lanes),
                "peak_bytes_mean": _mean(a["peak_bytes"] for a in lanes),
                "full_peak_bytes_mean": _mean(c["lanes"]["full"]["peak_bytes"] for c in cells),
            }
        )
    return rows


def leaderboard(cells: list[dict], question: str = "with-context") -> list[dict]:
    """kvpress's leaderboard form, for the lanes run at a compression ratio (and the full cache at 0): a row per
    strategy, ratio and task (the summary's row on that task's cells), its measured bytes beside the nominal
    ratio and the measured compression, and where the question was read (`question`); multi-turn rows carry the score
    from the context too.  `spec` names what ran, every setting included (kvpress's rows are keyed by the press's
    name alone, whose defaults are not ours everywhere)."""
    keep = (
        "strategy",
        "score",
        "score_from_context",
        "cells",
        "compression_ratio",
        "measured_compression",
        "held_bytes_mean",
    )
    out = []
    for task in dict.fromkeys(c["task"] for c in cells):
        for row in _rows([c for c in cells if c["task"] == task], True, question):
            if row["spec"] == "full" or row["ratio"]:
                out.append(
                    {
                        **{k: row[k] for k in keep if k in row},
                        "spec": row["full_spec"],
                        "ratio": row["ratio"] or 0.0,
                        "task": task,
                        "question": question,
                    }
                )
    return out
