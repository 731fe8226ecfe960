"""Task scores: what a cache strategy costs in answers (`bench tasks`, the Tasks tab, claim 9).

A cell is one generated sample (`single_turn.sample`: a task, a context length, a needle depth, a seed): its
prompt is fed once to every strategy in lockstep with the full cache (`Engine`; lanes that have not diverged
share the prompt's forward, `lockstep.py`), each lane answers greedily, and each answer is scored against the
sample's references (`single_turn.score`: RULER's string_match_all, containment for the QA set).  Every strategy
runs at every budget (`:budget=B` appended, as `bench sweep` does); an exact strategy's answer is compared with
the full cache's token for token in every cell (`equal_full`), never assumed.  Cells are independent: in this
process, or on the local pool or Ray (`executors.run_cells`).

The result (`tasks` results file, docs/schema/tasks.json) keeps every cell's answers, scores and measured bytes,
and the summary: per strategy and budget the mean score beside the full cache's (the reference: a 135M model
misses some needles with every token kept), the compression ratio by kvpress's convention (the share of the
prompt's K/V tokens a layer drops: 1 - budget / prompt tokens, for an evicting strategy) beside the measured one
(the share of the full cache's bytes it does not hold after the answer, by the allocator: a strategy that keeps
whole layers, or more than its budget, shows here what the nominal ratio cannot), the measured bytes held after
the answer (what the budget buys; the frontier's axis) and peak during it (for an evicting strategy, the whole
prompt's K/V before it is trimmed); per strategy and budget, the score by context and depth (the needle heatmap).

With --multiturn a cell is a conversation (`multi_turn.conversation`): every lane answers each turn in lockstep with
the full cache, its cache carried over between turns as in the app (SnapKV and PyramidKV compress each user turn's
prompt); each turn is scored, an exact lane's every turn compared with the full cache's, and the summary adds each
lane's score by turn (`by_turn`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ...engine import guard, validate
from ...engine.runner import Engine
from ...models.loading import load_model
from ...models.probe_verdicts import environment
from ...plain import rss, stats
from ...plain.errors import UserError
from ...plain.limits import limits
from ...plain.recording import commit, today
from ...strategies import StrategyError, parse_spec
from ..executors import Ticker, check_executor, run_cells
from . import haystack, multi_turn, single_turn

ANSWER_TOKENS = 64  # the memory guard's bound on an answer (every task's max_new_tokens is below it)
# The grids (`bench tasks` without, and with, --quick); a setting given on the command line replaces its entry, and
# --budgets alone replaces the grid's ratios.  The field's setting by default: kvpress's compression ratios, the
# question read after the context.  The default tasks: those SmolLM2-135M's full cache answers at least half the
# time (variable tracking, 0.04, and multi-query at 2k, 0.25, leave no reference to fall from), within 30 minutes
# on the local pool of 2 cores.
DEFAULT = {
    "contexts": "512,1024,2048",
    "depths": "0,50,100",
    "ratios": "0.5,0.875",
    "tasks": "niah_single_number,niah_multikey,niah_multivalue,qa",
}
QUICK = {"contexts": "512,2048", "depths": "0,50,100", "tasks": "niah_single_number,qa", "ratios": "0.875"}
# --multiturn (and with --quick): conversations, not depths.
MULTITURN = {"contexts": "1024,2048", "tasks": "niah_single_number,qa", "ratios": "0.5,0.875", "turns": 5, "samples": 3}
MULTITURN_QUICK = {"contexts": "1024", "tasks": "niah_single_number,qa", "ratios": "0.875", "turns": 3, "samples": 2}
LATER_TOKENS = 96  # the bound on a later turn's prompt (end of reply, user turn, question, answer prefix)
# --question: where the question is read.  "after": the context is compressed alone, the question (and the answer)
# read after it with nothing evicted (kvpress's pipeline: query-agnostic); "with-context": the question is the end of
# the compressed prompt, as the SnapKV paper has it (its observation window sees the question).
QUESTIONS = ("after", "with-context")
# --history (--multiturn): "keep" carries each lane's cache from turn to turn, its own earlier answers in it (a
# conversation); "drop" starts every question from the compressed context, the earlier questions and answers cut
# (kvpress's multi-question mode: each question meets the compressed context alone).
HISTORIES = ("keep", "drop")


class TaskError(UserError):
    """A task setting out of range; one line naming the setting and its allowed values."""


def _ints(setting: str, text: str, lo: int, hi: int, what: str) -> list[int]:
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit() or not lo <= int(part) <= hi:
            raise TaskError(
                f"{setting}: {part!r} is not allowed; allowed: whole numbers {lo}..{hi} ({what}), comma-separated"
            )
        if int(part) in out:
            raise TaskError(f"{setting}: {part} is listed twice")
        out.append(int(part))
    return out


def _names(setting: str, text: str, allowed) -> list[str]:
    out = [t.strip() for t in str(text).split(",") if t.strip()]
    for name in out:
        if name not in allowed:
            raise TaskError(f"{setting}: {name!r} is not allowed; allowed: {', '.join(allowed)}")
    if not out or len(set(out)) != len(out):
        raise TaskError(f"{setting}: give each of {', '.join(allowed)} at most once, at least one")
    return out


@dataclass
class Plan:
    tasks: list[str]
    contexts: list[int]
    depths: list[int]
    seeds: list[int]
    budgets: list[int]
    names: list[str]
    lanes: list[tuple[str, int | None, str]]
    ratios: list[float] = field(default_factory=list)
    ratio_lanes: list[tuple[str, float, str]] = field(default_factory=list)  # (name, ratio, key) of a budgeted name
    turns: int | None = None  # --multiturn: turns per conversation (each cell is one conversation)
    asked: list[int] | None = None  # --asked: the turns that ask (the others chat); None: every turn
    question: str = "with-context"  # QUESTIONS
    history: str | None = None  # HISTORIES with --multiturn, else None

    def depths_for(self, task: str) -> list[int | None]:
        return [None] if task in haystack.DEPTHLESS or self.turns else self.depths

    def tokens(self, context: int) -> int:
        """A cell's longest conversation in tokens: the prompt, then every turn's question and answer."""
        return context + (self.turns or 1) * ANSWER_TOKENS + max(0, (self.turns or 1) - 1) * LATER_TOKENS


def plan(config) -> Plan:
    """The grid a `TasksConfig` asks for, every setting checked (one line each); `quick` fills the unset ones."""
    multi = config.multiturn
    q = (MULTITURN_QUICK if config.quick else MULTITURN) if multi else QUICK if config.quick else DEFAULT
    tasks = _names("tasks", config.tasks or q["tasks"], multi_turn.MULTITURN_TASKS if multi else haystack.TASKS)
    contexts = _ints("contexts", config.contexts or q["contexts"], haystack.MIN_CONTEXT, 1 << 20, "tokens of prompt")
    if multi and config.depths:
        raise TaskError(
            "depths: not a setting of --multiturn (each turn asks about its own needle, the needles "
            "spread from 0 to 100 percent of the context); allowed: leave it out"
        )
    depths = (
        []
        if multi
        else _ints("depths", config.depths or q["depths"], 0, 100, "percent of the context before the needle")
    )
    if config.turns is not None and not multi:
        raise TaskError("turns: a setting of --multiturn; allowed: leave it out, or add --multiturn")
    turns = (
        _ints(
            "turns",
            str(q["turns"] if config.turns is None else config.turns),
            2,
            multi_turn.MAX_TURNS,
            "turns per conversation",
        )[0]
        if multi
        else None
    )
    # The grids have ratios, not budgets: --budgets alone replaces them.
    ratio_text = config.ratios or (q["ratios"] if not config.budgets else None)
    ratios = _ratios(ratio_text) if ratio_text else []
    samples = config.samples if config.samples is not None else q.get("samples", 1)
    if config.asked and not multi:
        raise TaskError("asked: a setting of --multiturn; allowed: leave it out, or add --multiturn")
    asked = sorted(_ints("asked", config.asked, 1, turns, f"turns of the {turns}")) if config.asked else None
    # --ratios alone replaces the grid's budgets; with --budgets both run.
    budgets = _ints("budgets", config.budgets, 1, 1 << 20, "tokens per layer") if config.budgets else []
    if config.threads is not None and (
        isinstance(config.threads, bool) or not isinstance(config.threads, int) or config.threads < 1
    ):
        raise TaskError(
            f"threads: {config.threads!r} is not allowed; allowed: whole numbers >= 1 (torch threads per "
            "cell), or leave it out"
        )
    if samples < 1 or samples > 1000:
        raise TaskError(f"samples: {samples} is not allowed; allowed: 1..1000 per cell")
    if config.haystack not in haystack.HAYSTACKS:
        raise TaskError(f"haystack: {config.haystack!r} is not allowed; allowed: {', '.join(haystack.HAYSTACKS)}")
    names = [n.strip() for n in config.strategies.split(",") if n.strip() and n.strip() != "full"]
    if len(set(names)) != len(names):
        raise TaskError("strategies: a name is listed twice")
    try:
        for name in names:
            if any(pair.partition("=")[0] == "budget" for pair in name.split(":")[1:]):
                raise TaskError(f"strategies: {name!r} sets budget itself; --budgets sets it, remove budget=")
        lanes = lane_specs(names, budgets)
        ratio_lanes = [
            (name, r, f"{parse_spec(name).label}:ratio={r:g}")
            for name in names
            if "budget" in parse_spec(name).settings()
            for r in ratios
        ]
    except StrategyError as e:
        raise TaskError(str(e)) from None
    question = config.question or ("after" if ratios else "with-context")
    if question not in QUESTIONS:
        raise TaskError(f"question: {question!r} is not allowed; allowed: {', '.join(QUESTIONS)}")
    if config.history is not None and not multi:
        raise TaskError("history: a setting of --multiturn; allowed: leave it out, or add --multiturn")
    history = (config.history or "keep") if multi else None
    if history is not None and history not in HISTORIES:
        raise TaskError(f"history: {history!r} is not allowed; allowed: {', '.join(HISTORIES)}")
    if history == "drop" and question != "after":
        raise TaskError(
            "history: drop cuts each answer and starts the next question from the context compressed "
            "alone (kvpress's multi-question mode); allowed: drop with --question after, or keep"
        )
    if history == "drop" and asked:
        raise TaskError(
            "asked: the turns between the asking ones only matter where the history is kept; allowed: "
            "leave --asked out with --history drop"
        )
    seeds = [config.seed + i for i in range(samples)]
    return Plan(
        tasks, contexts, depths, seeds, budgets, names, lanes, ratios, ratio_lanes, turns, asked, question, history
    )


def _ratios(text: str) -> list[float]:
    out = []
    for part in str(text).split(","):
        try:
            r = float(part)
        except ValueError:
            r = None
        if r is None or not 0 < r < 1:
            raise TaskError(
                f"ratios: {part.strip()!r} is not allowed; allowed: compression ratios above 0 and below 1 "
                "(the share of the prompt's K/V tokens a layer drops, kvpress's convention), "
                "comma-separated"
            )
        if r in out:
            raise TaskError(f"ratios: {r:g} is listed twice")
        out.append(r)
    return out


def ratio_budget(ratio: float, compressed_tokens: int) -> int:
    """The budget of a lane at compression ratio `ratio` on `compressed_tokens` tokens (the context alone with
    --question after, as kvpress counts it; the whole prompt with the question in it): the K/V tokens kept per
    layer, max(1, int(compressed_tokens * (1 - ratio)))."""
    return max(1, int(compressed_tokens * (1 - ratio)))


def lane_specs(names: list[str], budgets: list[int]) -> list[tuple[str, int | None, str]]:
    """(strategy name, budget, spec) of every lane: each strategy at each budget (a strategy without a budget
    setting once, budget None)."""
    out = []
    for name in names:
        strategy = parse_spec(name)
        if "budget" not in strategy.settings():
            out.append((name, None, strategy.label))
            continue
        for b in budgets:
            out.append((name, b, parse_spec(f"{name}:budget={b}").label))
    return out


def task_cell(cell: dict) -> dict:
    """One sample (or, with "turns", one conversation) through every lane (in a worker or here): the answers, their
    scores, the lanes' bytes."""
    loaded = load_model(cell["model"], dtype=cell["dtype"], device=cell["device"], progress=lambda msg: None)
    tok = loaded.tokenizer
    after, drop = cell["question"] == "after", cell.get("history") == "drop"
    if cell.get("turns"):
        asked = tuple(cell["asked"]) if cell.get("asked") else None
        conv = multi_turn.conversation(
            cell["task"],
            tok,
            cell["context"],
            cell["turns"],
            cell["seed"],
            haystack=cell["haystack"],
            chat=loaded.chat,
            asked=asked,
        )
        first = next(t for t in conv.turns if t.answers)
        (context, question), turns, max_new = multi_turn.conversation_parts(conv, tok), conv.turns, conv.max_new_tokens
        scored = lambda replies: multi_turn.score_turns(conv, replies)
        about = {
            "depth": None,
            "needle_depth": first.needle_depth,
            "references": list(first.answers),
            "turns": [
                {"turn": n + 1, "question": t.question, "references": list(t.answers), "needle_depth": t.needle_depth}
                for n, t in enumerate(turns)
            ],
        }
    else:
        s = single_turn.sample(
            cell["task"], tok, cell["context"], cell["depth"], cell["seed"], haystack=cell["haystack"], chat=loaded.chat
        )
        (context, question), turns, max_new = single_turn.prompt_parts(s, tok), [s], s.max_new_tokens
        scored = lambda replies: [single_turn.score(s, replies[0])]
        about = {"depth": s.depth, "needle_depth": s.needle_depth, "references": list(s.answers)}
    ids = context + question
    compressed = len(context) if after else len(ids)  # what a lane at a ratio compresses
    # (name, budget, ratio, key, spec): a lane at a ratio gets its budget from this sample's prompt; lanes whose
    # specs coincide (a ratio's budget equal to a listed budget) run once and share the answer.
    lanes = [(name, budget, None, spec, spec) for name, budget, spec in cell["lanes"]]
    for name, ratio, key in cell.get("ratio_lanes", []):
        budget = ratio_budget(ratio, compressed)
        lanes.append((name, budget, ratio, key, parse_spec(f"{name}:budget={budget}").label))
    specs = list(dict.fromkeys(spec for *_, spec in lanes))
    engine = Engine(
        loaded,
        [parse_spec("full")] + [parse_spec(spec) for spec in specs],
        max_new_tokens=max_new,
        threads=cell["threads"],
        twins=False,
        kernels=cell["kernels"],
        prefill_chunk=cell["prefill_chunk"],
    )
    t0 = time.perf_counter()
    with rss.kept_heap():  # the cells report the ledger's bytes, not the process's RSS
        for n, turn in enumerate(turns):  # the cache carries over from turn to turn, as in the app
            if n == 0:  # --question after: the context compressed alone, then the question read with nothing evicted
                how = dict(ids=context, question=question, save_context=drop) if after and question else dict(ids=ids)
            elif drop:  # every later question from the compressed context, the earlier answers cut
                how = dict(question=multi_turn.question_ids(conv, tok, n), from_context=True)
            else:
                how = dict(answer_prefix=turn.answer_prefix)
            for _ in engine.turn(turn.user, **how):
                pass
    seconds = time.perf_counter() - t0
    result = engine.results()
    full = result["strategies"]["full"]
    answers = {}
    for name, budget, ratio, key, spec in [("full", None, None, "full", "full")] + lanes:
        r = result["strategies"][spec]
        replies, scores = r["turn_texts"], scored(r["turn_texts"])
        equal = [a == b for a, b in zip(r["turn_token_ids"], full["turn_token_ids"])]
        multi = {}
        if len(turns) > 1:  # with the history kept, an answer that stood in the lane's own earlier replies is a copy
            own, copied = (
                multi_turn.score_turns_from_context(conv, replies) if not drop else (scores, [False] * len(scores))
            )
            multi = {
                "replies": replies,
                "scores": scores,
                "equal_full_turns": equal,
                "scores_from_context": own,
                "copied_turns": copied,
                "copies": sum(copied),
                "score_from_context": statistics.fmean(x for x in own if x is not None),
            }
        answers[key] = {
            "strategy": name,
            "budget": budget,
            "ratio": ratio,
            "spec": spec,
            "reply": replies[0],
            "score": statistics.fmean(x for x in scores if x is not None),
            **multi,
            "exact": bool(parse_spec(spec).claims_exact),
            "equal_full": all(equal),
            "kv_exact": r["kv_exact"],
            "held_bytes": r["state_bytes"]["between_turns_peak"],
            "peak_bytes": r["state_bytes"]["peak"],
            "formula_peak_bytes": r["state_bytes"]["formula_peak"],
        }
    return {
        "task": cell["task"],
        "context": cell["context"],
        "seed": cell["seed"],
        "haystack": cell["haystack"],
        "prompt_tokens": len(ids),
        "context_tokens": len(context),
        **about,
        "seconds": seconds,
        "kernels": result["kernels"]["mode"],
        "device": result["device"],
        "memory_instrument": result["memory_instrument"],
        "lanes": answers,
    }


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
    from the context too."""
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
                        "ratio": row["ratio"] or 0.0,
                        "task": task,
                        "question": question,
                    }
                )
    return out


def run_tasks(config, say: Callable[[str], None]) -> dict:
    """`benchmarks.tasks`'s work: `config` is a `benchmarks.TasksConfig`."""
    p = plan(config)
    if config.executor is not None:
        check_executor(config.executor)
    # Every strategy at every budget is a lane of one lockstep run (they share the prompt's forward): more lanes
    # than a page's cap, bounded by the memory guard below.
    top = max(p.contexts)
    # A lane at a ratio is checked, and bounded by the guard, at the budget it has on the longest context.
    checked = [s for _, _, s in p.lanes] + [
        parse_spec(f"{n}:budget={ratio_budget(r, top)}").label for n, r, _ in p.ratio_lanes
    ]
    cap = replace(limits(), max_strategies=max(limits().max_strategies, len(checked)))
    req = validate.request(
        config.model, config.device, config.dtype, ",".join(dict.fromkeys(checked)), 1, ["task"], False, cap
    )
    loaded = load_model(req.model, dtype=req.dtype, device=req.device)
    longest = p.tokens(top)  # the prompt and, with --multiturn, every later turn's question and answer
    if longest >= loaded.max_context:
        more = longest - top
        room = loaded.max_context - 1 - more  # the longest context that leaves room for the answers
        if room < haystack.MIN_CONTEXT:  # no context fits beside the answers: the turns are what to cut
            fits = max(
                (
                    t
                    for t in range(2, multi_turn.MAX_TURNS + 1)
                    if replace(p, turns=t).tokens(haystack.MIN_CONTEXT) < loaded.max_context
                ),
                default=None,
            )
            raise TaskError(
                f"turns: {p.turns} turns' questions and answers ({more} tokens) leave no room for a "
                f"context in {config.model}'s context of {loaded.max_context} tokens; allowed: "
                + (f"up to {fits} turns" if fits else "a model with a longer context")
            )
        raise TaskError(
            f"contexts: {top} tokens plus the answer{'s' if p.turns else ''} ({more} tokens) pass "
            f"{config.model}'s context of {loaded.max_context}; allowed: up to {room}"
        )
    validate.against_model(req, loaded, prompt_tokens=top)
    est = guard.estimate(
        loaded.config,
        loaded.dtype,
        list(req.strategies),
        top,
        longest,
        config.prefill_chunk,
        twins=False,
        compare=True,
        turns=p.turns or 1,
        kernels=config.kernels,
        saved_context=p.history == "drop",
    )
    guard.check(est, loaded.device)
    for task in p.tasks:  # a context too small for a task's needles and question: one line before any cell runs
        if p.turns:
            multi_turn.conversation(
                task,
                loaded.tokenizer,
                min(p.contexts),
                p.turns,
                p.seeds[0],
                config.haystack,
                chat=loaded.chat,
                asked=tuple(p.asked) if p.asked else None,
            )
        else:
            single_turn.sample(
                task,
                loaded.tokenizer,
                min(p.contexts),
                p.depths_for(task)[0],
                p.seeds[0],
                config.haystack,
                chat=loaded.chat,
            )
    threads = (
        config.threads if config.threads is not None else (1 if config.executor == "local" else torch.get_num_threads())
    )
    what = (
        (f"{p.turns} turns" + (f" asking at {'/'.join(map(str, p.asked))}" if p.asked else ""))
        if p.turns
        else "depth {}"
    )
    cells = [
        {
            "name": f"{task} {context} tokens {what.format(depth)} seed {seed}",
            "model": req.model,
            "dtype": req.dtype,
            "turns": p.turns,
            "asked": p.asked,
            "device": loaded.device.type,
            "threads": threads,
            "kernels": config.kernels,
            "prefill_chunk": config.prefill_chunk,
            "task": task,
            "context": context,
            "depth": depth,
            "seed": seed,
            "haystack": config.haystack,
            "question": p.question,
            "history": p.history,
            "lanes": [list(x) for x in p.lanes],
            "ratio_lanes": [list(x) for x in p.ratio_lanes],
        }
        for task in p.tasks
        for context in p.contexts
        for depth in p.depths_for(task)
        for seed in p.seeds
    ]
    say(
        f"{len(cells)} cells ({len(p.tasks)} tasks x {len(p.contexts)} contexts x "
        f"{f'conversations of {p.turns} turns' if p.turns else 'depths'} x {len(p.seeds)} seeds), "
        f"{len(p.lanes) + len(p.ratio_lanes) + 1} lanes each: "
        f"{', '.join(['full'] + [s for _, _, s in p.lanes] + [k for _, _, k in p.ratio_lanes])}"
    )
    t0 = time.perf_counter()
    if config.executor is None:
        results, ticker = [], Ticker(cells, say)
        for i, cell in enumerate(cells):
            results.append(task_cell(cell))
            ticker.done(i)
    else:
        results = run_cells(task_cell, cells, config.executor, config.workers, say=say)
    seconds = time.perf_counter() - t0
    # An exact lane's answers differing from the full cache's: (task, context, depth, spec), and with --multiturn
    # the seed and the turn of each differing answer.
    mismatched = [
        (c["task"], c["context"], c["depth"], spec, *([c["seed"], n + 1] if p.turns else []))
        for c in results
        for spec, a in c["lanes"].items()
        if a["exact"]
        for n, same in enumerate(a.get("equal_full_turns", [a["equal_full"]]))
        if not same
    ]

    env = environment(loaded.device)
    return {
        "measured_at": today(),
        "commit": commit(),
        "processor": env["cpu"],
        "torch": env["torch"],
        "model": loaded.name,
        "model_source": loaded.source,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "threads": threads,
        "kernels": config.kernels,
        "executor": config.executor or "in-process",
        "quick": config.quick,
        "multiturn": bool(p.turns),
        "turns": p.turns,
        "asked": p.asked,
        "tasks": p.tasks,
        "contexts": p.contexts,
        "depths": p.depths,
        "seeds": p.seeds,
        "haystack": config.haystack,
        "question": p.question,
        **({"history": p.history} if p.turns else {}),
        "budgets": p.budgets,
        "ratios": p.ratios,
        "strategies": p.names,
        "seconds": seconds,
        "memory_instrument": results[0]["memory_instrument"] if results else None,
        "exact_answers_equal_full": not mismatched,
        "exact_mismatches": [list(m) for m in mismatched],
        "cells": results,
        **summarise(results, p.question),
    }
