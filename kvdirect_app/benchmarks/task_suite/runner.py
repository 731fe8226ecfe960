"""Running `bench tasks`: what a cache strategy costs in answers (`bench tasks`, the Tasks tab, claim 9).

A cell is one generated sample (`single_turn.sample`: a task, a context length, a needle depth, a seed): its
prompt is fed once to every strategy in lockstep with the full cache (`Engine`; lanes that have not diverged
share the prompt's forward, `lockstep.py`), each lane answers greedily, and each answer is scored against the
sample's references (`single_turn.score`: RULER's string_match_all, containment for the QA set).  Every strategy
runs at every budget (`:budget=B` appended, as `bench sweep` does); an exact strategy's answer is compared with
the full cache's token for token in every cell (`equal_full`), never assumed.  Cells are independent: in this
process, or on the local pool or Ray (`executors.run_cells`).

With --multiturn a cell is a conversation (`multi_turn.conversation`): every lane answers each turn in lockstep with
the full cache, its cache carried over between turns as in the app (SnapKV and PyramidKV compress each user turn's
prompt); each turn is scored, and an exact lane's every turn compared with the full cache's.

The grid of cells and its settings' checks are `grid`'s; the result (`tasks` results file, docs/schema/tasks.json)
keeps every cell's answers, scores and measured bytes, and their summary (`summary`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Callable

import torch

from ...engine import guard, validate
from ...engine.runner import Engine
from ...models.loading import load_model
from ...models.probe_verdicts import environment
from ...plain import rss
from ...plain.limits import limits
from ...plain.recording import commit, today
from ...strategies import parse_spec
from ..executors import Ticker, check_executor, run_cells
from . import haystack, multi_turn, single_turn
from .grid import TaskError, plan, ratio_budget
from .summary import summarise


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
    for name, ratio, key, run in cell.get("ratio_lanes", []):
        budget = ratio_budget(ratio, compressed)
        lanes.append((name, budget, ratio, key, parse_spec(f"{run}:budget={budget}").label))
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
        ran = parse_spec(spec)
        answers[key] = {
            "strategy": name,
            "budget": budget,
            "ratio": ratio,
            "spec": spec,
            # every setting, defaults included; at a ratio the budget is this sample's, so the ratio stands for it
            "full_spec": ran.full_spec() if ratio is None else f"{ran.full_spec(('budget',))}:ratio={ratio:g}",
            "reply": replies[0],
            "score": statistics.fmean(x for x in scores if x is not None),
            **multi,
            "exact": bool(ran.claims_exact),
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
        parse_spec(f"{run}:budget={ratio_budget(r, top)}").label for _, r, _, run in p.ratio_lanes
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
    at_ratios = [k if run == name else f"{k} (as {run})" for name, _, k, run in p.ratio_lanes]
    say(
        f"{len(cells)} cells ({len(p.tasks)} tasks x {len(p.contexts)} contexts x "
        f"{f'conversations of {p.turns} turns' if p.turns else 'depths'} x {len(p.seeds)} seeds), "
        f"{len(p.lanes) + len(p.ratio_lanes) + 1} lanes each: "
        f"{', '.join(['full'] + [s for _, _, s in p.lanes] + at_ratios)}"
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
