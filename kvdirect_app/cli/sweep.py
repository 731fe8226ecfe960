"""`bench sweep`: every strategy at every budget against the full cache, on one conversation.

    python -m kvdirect_app.bench sweep --model smollm2-135m --scenario recall \\
        --strategies window,streaming_llm,h2o,snapkv,tova,knorm,pyramidkv,kvdirect,anchorkv --budgets 16,32,64,128 \\
        [--equal-memory [--target SPEC|BYTES]] [--plot docs/frontier] [--json out.json]

For each budget, one lockstep run of the engine (the full cache is the
reference) with `:budget=B` appended to every strategy spec.  Prints token
match, teacher-forced agreement and KL with the measured bytes between
turns, peak during a turn and ms per token beside them: a budget is the
strategy's own knob, and the same number means different memory for
different strategies, so the table never shows one without the other.

* `--equal-memory`: instead of fixed budgets, each strategy gets the budget
  whose *measured* peak is closest to a target: by default the measured
  peak of the first strategy in the list that promises exact K/V, at the
  first budget of `--budgets`; or `--target SPEC` (run and measured), or
  `--target BYTES`.  Budgets are searched on a geometric grid by bisection
  (peaks grow with the budget), all strategies probed together in one
  lockstep run per round; every probe is kept in the JSON.
* `--executor local|ray [--workers N]`: each budget's lockstep run is a
  cell (`sweep_cell`: the model loaded by name in the worker, the run, its
  rows) run through `executors.run_cells`: `local`, a process pool here
  (`--workers`, default cores / threads), or `ray`, one Ray task per cell
  (the cluster at RAY_ADDRESS, else a local Ray started for the run).
  Without it the runs go one after another in this process.  The JSON is
  the same either way, timing fields (ms, tokens/s, seconds, RSS) aside.
  `--equal-memory` always runs in this process: its rounds depend on each
  other.
* `--plot PREFIX`: the trade-off frontier of every measured row (peak
  against token match, marker size for ms per token, the Pareto front) as
  PREFIX.html and PREFIX.png.
* A name that is not a registered strategy is an error (one line), or, with
  `--allow-missing`, skipped with a printed note.  A spec must not set
  `budget` itself; a strategy without a budget (`full`, the reference)
  cannot be swept.  A (strategy, budget) pair whose settings do not fit
  that budget is skipped with a note; a spec that fits no budget is an error.
"""

from __future__ import annotations

import argparse

from ..benchmarks.api import SweepConfig, sweep
from ..benchmarks.executors import EXECUTORS
from ..plain.frontier import frontier_figure, points_from_rows, write_frontier
from ..plain.units import fmt, fmt_bytes, table
from .common import WORKERS, add_conversation_options, write_json

DEFAULT_STRATEGIES = SweepConfig.strategies
DEFAULT_BUDGETS = SweepConfig.budgets


def rows_table(rows: list[dict], target: int | None = None) -> str:
    cols = [
        "strategy",
        "budget",
        "match",
        "1st div",
        "TF agree",
        "KL",
        "between turns",
        "peak in turn",
        "ms/token",
        "formula = measured",
    ]
    if target is not None:
        cols.insert(8, "vs target")
    body = []
    for r in rows:
        sb = r["state_bytes"]
        cells = [
            r["strategy"],
            str(r["budget"]),
            fmt(r["token_match"], ".3f"),
            fmt(r["first_divergence"], "d"),
            fmt(r["teacher_forced_agreement"], ".3f"),
            fmt(r["kl_mean"], ".2e"),
            fmt_bytes(sb["between_turns_peak"]),
            fmt_bytes(sb["peak"]),
            fmt(r["latency_ms"]["decode_total_ms_mean"], ".1f"),
            fmt(sb["formula_matches_measurement"]),
        ]
        if target is not None:
            cells.insert(8, "-" if sb["peak"] is None else f"{100 * (sb['peak'] / target - 1):+.0f}%")
        body.append(cells)
    return table(cols, body, left=2)


def match_matrix(rows: list[dict], names: list[str], budgets: list[int]) -> str:
    by = {(r["strategy"], r["budget"]): r for r in rows}
    cells = lambda r: "-" if r is None else f"{r['token_match']:.3f} / {fmt_bytes(r['state_bytes']['peak'])}"
    cols = ["token match / peak"] + [f"B={b}" for b in budgets]
    return table(cols, [[n] + [cells(by.get((n, b))) for b in budgets] for n in names])


def cmd_sweep(args) -> int:
    out = sweep(SweepConfig.from_args(args))
    names, budgets, rows, reference = out["strategies"], out.get("budgets"), out["rows"], out["reference"]
    for note in out["skipped"]:
        at = "" if note["budget"] is None else f" at budget {note['budget']}"
        print(f"note: skipping {note['strategy']}{at}: {note['reason']}")
    print(
        f"model {out['model']} ({out['model_source']}), device {out['device']}, dtype {out['dtype']}, "
        f"threads {out['threads']}, {len(out['turns'])} turns, max {args.max_new_tokens} new tokens per turn; "
        f"reference: full cache, {len(reference['token_ids'])} tokens generated, peak in turn "
        f"{fmt_bytes(reference['state_bytes']['peak'])}, between turns "
        f"{fmt_bytes(reference['state_bytes']['between_turns_peak'])}; bytes: {out['memory_instrument']}"
    )
    if args.equal_memory:
        print(
            f"\nat equal memory: every strategy at the budget whose measured peak is closest to "
            f"{fmt_bytes(out['target_bytes'])} ({len(out['probes'])} runs probed)"
        )
        print(rows_table(rows, out["target_bytes"]))
    else:
        print(rows_table(rows))
        print()
        print(match_matrix(rows, [n for n in names if any(r["strategy"] == n for r in rows)], budgets))
    print(f"\nlast turn, full: {reference['turn_texts'][-1][:100]!r}")
    for r in rows:
        print(f"last turn, {r['spec']}: {r['turn_texts'][-1][:100]!r}")
    plotted = out.pop("plotted")
    if args.plot:
        title = f"{out['model']}, {args.scenario or 'one prompt'}: memory against agreement"
        fig = frontier_figure(
            points_from_rows(plotted),
            title=title,
            subtitle=f"{out['device']}, {out['dtype']}; reference peak {fmt_bytes(reference['state_bytes']['peak'])}",
        )
        html, png, problem = write_frontier(fig, args.plot)
        print(f"\nwrote {html}" + (f" and {png}" if png else ""))
        if problem:
            print(f"note: {problem}")
        out["plot"] = {"html": html, "png": png}
    write_json(args.json, out, "sweep")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="every strategy at every budget against the full cache")
    add_conversation_options(p)
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help="comma-separated name[:key=value]...; :budget=B is appended to each",
    )
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma-separated token budgets")
    p.add_argument(
        "--equal-memory",
        action="store_true",
        help="give each strategy the budget whose measured peak is closest to a target (always runs in "
        "this process: its rounds depend on each other; not with --executor)",
    )
    p.add_argument("--target", help="with --equal-memory: a spec whose measured peak is the target, or bytes")
    p.add_argument("--plot", help="write the trade-off frontier as PLOT.html and PLOT.png")
    p.add_argument(
        "--allow-missing",
        action="store_true",
        help="skip, with a printed note, names that are not registered strategies",
    )
    p.add_argument("--json", help="write every row here")
    p.add_argument(
        "--executor",
        default=None,
        help=f"one of {', '.join(EXECUTORS)}: run each budget's lockstep run as a cell on a process pool "
        "here (local) or as a Ray task (ray: the cluster at RAY_ADDRESS, else a local Ray started for "
        "the run; pip install -r requirements-ray.txt); default: one after another in this process",
    )
    p.add_argument(
        "--workers",
        type=WORKERS,
        default=None,
        help="with --executor local: processes at most (default: cores // threads per cell)",
    )
    p.set_defaults(func=cmd_sweep)
    return p
