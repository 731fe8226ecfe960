"""`bench tasks`: retrieval and QA scores for every strategy, RULER-style tasks generated here with a seed.

    python -m kvdirect_app.bench tasks --quick --json out.json
    python -m kvdirect_app.bench tasks --json presets/tasks/smollm2-135m.json   # the shipped result (the default grid)
    python -m kvdirect_app.bench tasks --multiturn --json presets/tasks/smollm2-135m-multiturn.json   # across turns

Every strategy at every budget answers each generated sample in lockstep with the full cache (whose score is
the reference); prints the score per strategy and budget beside the full cache's, the compression ratio (kvpress's
convention, nominal) and the measured one beside it (1 - the bytes held after the answer over the full cache's),
the measured bytes held after the answer and the peak during it, then the needle map (context x depth) per
strategy; says whether every exact strategy's answers equalled the full cache's in every cell (checked
token for token; the exit status is 1 if one did not).  With --multiturn each cell is a conversation (turn 1 a
context with a needle per turn, every turn asking about another; `task_suite.conversation`) and the score is
printed by turn as well.
"""

from __future__ import annotations

import argparse

from ..benchmarks import task_suite
from ..benchmarks.api import TasksConfig, tasks
from ..benchmarks.executors import EXECUTORS
from ..benchmarks.task_suite.grid import DEFAULT, MULTITURN, MULTITURN_QUICK, QUICK
from ..plain.units import fmt, fmt_bytes, table
from .common import THREADS, TOKENS, WORKERS, whole, write_json

HERE = "here"  # --executor here: the cells in this process
QUESTION_WORDS = {
    "after": "after the context was compressed (kvpress's setting)",
    "with-context": "as the end of the compressed prompt (the SnapKV paper's setting)",
}
HISTORY_WORDS = {
    "keep": "kept (a conversation: each lane's own earlier answers stay in its cache)",
    "drop": "dropped (every question from the compressed context, kvpress's multi-question mode)",
}


def scores_table(rows: list[dict]) -> str:
    cols = [
        "strategy",
        "budget",
        "kind",
        "score",
        "full cache",
        "below full",
        "= full answers",
        "compression",
        "measured",
        "held after",
        "peak during",
    ]
    body = [
        [
            r["strategy"],
            f"ratio {r['ratio']:g}" if r.get("ratio") else fmt(r["budget"], "d"),
            r["kind"],
            f"{r['score']:.3f}",
            f"{r['full_score']:.3f}",
            f"{r['cells_below_full']}/{r['cells']}",
            f"{r['answers_equal_full']}/{r['cells']}",
            f"{r['compression_ratio']:.2f}",
            fmt(r.get("measured_compression"), ".2f"),
            fmt_bytes(r["held_bytes_mean"]),
            fmt_bytes(r["peak_bytes_mean"]),
        ]
        for r in rows
    ]
    return table(cols, body, left=2)


def heat_table(out: dict, spec: str) -> str:
    cells = {(h["context"], h["depth"]): h["score"] for h in out["heatmap"][spec]}
    depths = sorted({d for _, d in cells}, key=lambda d: -1 if d is None else d)
    contexts = sorted({c for c, _ in cells})
    cols = [f"{spec}: context"] + ["-" if d is None else f"{d:g}%" for d in depths]
    return table(cols, [[str(c)] + [fmt(cells.get((c, d)), ".2f") for d in depths] for c in contexts])


def turns_table(out: dict, key: str = "from_context") -> str:
    """--multiturn: each lane's mean score at each turn (the full cache's first: the reference), found in the context
    (`key` "from_context": an answer copied from the lane's own earlier replies scores 0) or raw ("score"), with its
    95 % bootstrap interval over the conversations, the copied answers, and the answers equal to the full cache's."""
    turns = len(next(iter(out["by_turn"].values())))
    low, high = ("from_context_low", "from_context_high") if key == "from_context" else ("low", "high")
    cols = ["strategy"] + [f"turn {n + 1}" for n in range(turns)] + ["copied", "= full answers"]
    body = [
        [spec]
        + [
            f"{fmt(t[key], '.2f')} [{fmt(t[low], '.2f')}, {fmt(t[high], '.2f')}]" if t[key] is not None else "-"
            for t in rows
        ]
        + [
            str(sum(t["copies"] for t in rows)),
            f"{sum(t['answers_equal_full'] for t in rows)}/{sum(t['n'] for t in rows)}",
        ]
        for spec, rows in out["by_turn"].items()
    ]
    return table(cols, body, left=1)


def cmd_tasks(args) -> int:
    out = tasks(TasksConfig.from_args(args, executor=None if args.executor == HERE else args.executor))
    print(
        f"model {out['model']} ({out['model_source']}), device {out['device']}, dtype {out['dtype']}, threads "
        f"{out['threads']}, kernels {out['kernels']}; {len(out['cells'])} cells in {out['seconds']:.0f} s "
        f"({out['executor']}); haystack {out['haystack']}; the question read {QUESTION_WORDS[out['question']]}"
        + (f"; history {HISTORY_WORDS[out['history']]}" if out.get("history") else "")
    )
    print(scores_table(out["rows"]))
    if out.get("by_turn"):
        print(
            "\nscore by turn, found in the context (an answer that stood in the lane's own earlier replies scores "
            "0), mean over the conversations [95 % bootstrap interval]"
        )
        print(turns_table(out))
        print("\nscore by turn, raw (every answer that holds the reference)")
        print(turns_table(out, "score"))
    for spec in out["heatmap"] if not out.get("by_turn") else []:
        print()
        print(heat_table(out, spec))
    if out["exact_answers_equal_full"]:
        print("\nexact strategies: every answer equals the full cache's, token for token, in every cell")
    else:
        print(
            f"\nexact strategies: {len(out['exact_mismatches'])} answers differ from the full cache's: "
            f"{out['exact_mismatches'][:5]}"
        )
    write_json(args.json, out, "tasks")
    return 0 if out["exact_answers_equal_full"] else 1


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tasks", help="retrieval and QA scores for every strategy (RULER-style, generated)")
    p.add_argument("--model", default="smollm2-135m", help="preset name, Hub id or local path")
    p.add_argument(
        "--strategies",
        default=TasksConfig.strategies,
        help="comma-separated name[:key=value]...; :budget=B is appended to each that has a budget; the "
        "full cache always runs as the reference",
    )
    p.add_argument(
        "--budgets",
        help="comma-separated token budgets per layer; alone, they replace the grid's ratios "
        "(the question is then read inside the compressed prompt unless --question "
        "after)",
    )
    p.add_argument(
        "--ratios",
        help="comma-separated compression ratios (kvpress's convention: the share of the "
        "compressed tokens' K/V a layer drops, e.g. 0.25,0.5,0.75,0.875): each lane's "
        "budget is max(1, int(tokens x (1 - ratio))) of its sample's context (--question "
        "after) or prompt (with-context); default "
        f"{DEFAULT['ratios']}, --quick {QUICK['ratios']}; these lanes run kvpress's "
        "settings where the name does not set them (SnapKV and PyramidKV window=64, "
        "KNorm skip=0 decode=grow); the JSON gets kvpress's leaderboard rows (strategy, "
        "spec, ratio, task, score) with the measured bytes",
    )
    p.add_argument(
        "--contexts",
        help=f"comma-separated prompt lengths in tokens (default {DEFAULT['contexts']}; "
        f"--quick {QUICK['contexts']}); at most the model's context",
    )
    p.add_argument("--depths", help=f"comma-separated needle depths, percent 0..100 (default {DEFAULT['depths']})")
    p.add_argument(
        "--tasks",
        help=f"comma-separated, from {', '.join(task_suite.TASKS)} (default "
        f"{DEFAULT['tasks']}; --quick {QUICK['tasks']})",
    )
    p.add_argument(
        "--samples",
        type=whole(1, 1000, "samples per cell"),
        default=None,
        help="seeds per task x context x depth (default 1), or "
        f"conversations per task x context with --multiturn "
        f"(default {MULTITURN['samples']})",
    )
    p.add_argument(
        "--multiturn",
        action="store_true",
        help="conversations: turn 1 carries a context with a needle (or, --haystack document with qa, the "
        "report) per turn and asks about one; each later turn asks about another, answered from turn "
        "1 alone, the cache carried over; scored per turn. Tasks from "
        f"{', '.join(task_suite.MULTITURN_TASKS)} (default {MULTITURN['tasks']}, ratios "
        f"{MULTITURN['ratios']}, contexts {MULTITURN['contexts']}; --quick: "
        + "; ".join(f"{k} {v}" for k, v in MULTITURN_QUICK.items())
        + ")",
    )
    p.add_argument(
        "--asked",
        default=None,
        help="with --multiturn: comma-separated turns that ask about turn 1, one needle each (e.g. 5,10,20); "
        "the others are the twenty-turn scenario's chat, scored by nothing (default: every turn asks)",
    )
    p.add_argument(
        "--turns",
        type=whole(2, task_suite.MAX_TURNS, "turns per conversation"),
        default=None,
        help=f"with --multiturn: turns per conversation, 2..{task_suite.MAX_TURNS} (default {MULTITURN['turns']})",
    )
    p.add_argument(
        "--question",
        default=None,
        choices=None,
        help="where the question is read: after (the context compressed alone, then the question and the "
        "answer read with nothing evicted: kvpress's pipeline; a ratio's budget counts the context's "
        "tokens) or with-context (the question is the end of the compressed prompt: the SnapKV "
        "paper's setting; a ratio's budget counts the whole prompt); default: after where the lanes run "
        "at ratios (the grids' default), with-context with --budgets alone",
    )
    p.add_argument(
        "--history",
        default=None,
        help="with --multiturn: keep (default: each lane's cache carries its own earlier answers from turn "
        "to turn, as in a conversation) or drop (every question from the compressed context, the "
        "earlier questions and answers cut: kvpress's multi-question mode; needs --question after)",
    )
    p.add_argument("--seed", type=whole(), default=0, help="the first seed")
    p.add_argument("--haystack", default="noise", help=f"one of {', '.join(task_suite.HAYSTACKS)}")
    p.add_argument(
        "--quick", action="store_true", help="the quick grid (" + "; ".join(f"{k} {v}" for k, v in QUICK.items()) + ")"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--threads",
        type=THREADS,
        default=None,
        help="torch threads per cell (default: 1 with --executor local, else torch's)",
    )
    p.add_argument("--kernels", default="invariant", help="invariant (exact answers hold by construction) or native")
    p.add_argument("--prefill-chunk", type=TOKENS, default=TasksConfig.prefill_chunk)
    p.add_argument(
        "--executor",
        default="local",
        help=f"one of {', '.join(EXECUTORS)}, {HERE}: each sample a cell on a process pool here (local, the "
        "default: the block attention runs on one thread, so one-thread workers fill the cores), a "
        f"Ray task, or one after another in this process with a line per sample ({HERE})",
    )
    p.add_argument("--workers", type=WORKERS, default=None, help="with --executor local: processes at most")
    p.add_argument("--json", help="write every cell, answer and score here (the Tasks tab reads such a file)")
    p.set_defaults(func=cmd_tasks)
    return p
