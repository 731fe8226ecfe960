"""`bench sweep`: every strategy at every budget against the full cache, on one conversation.

    python -m kvdirect_app.bench sweep --model smollm2-135m --scenario recall \\
        --strategies window,streaming_llm,h2o,snapkv,tova,kvdirect,anchorkv --budgets 16,32,64,128 \\
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
import sys

import torch

from ..frontier import frontier_figure, points_from_rows, write_frontier
from .. import validate
from ..executors import EXECUTORS, check_executor, run_cells
from ..models import load_model
from ..prompts import InputError
from ..strategies import StrategyError, parse_spec, registry
from ..sweeps import Sweep
from ..units import fmt, fmt_bytes, table
from .common import CliError, add_conversation_options, engine_options, turns_from_args, write_json

# AnchorKV with only the token-id anchor (the deepest spacing of any model) and rebuild=step first: the exact
# strategy that saves memory, and so --equal-memory's default target.
DEFAULT_STRATEGIES = "anchorkv:anchors=0:rebuild=step,kvdirect,window,streaming_llm,h2o,snapkv,tova"
DEFAULT_BUDGETS = "16,32,64,128"
GRID = [1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512, 724, 1024, 1448, 2048, 2896, 4096]


def parse_budgets(text: str) -> list[int]:
    budgets = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise InputError(f"--budgets: {part!r} is not a positive integer; give e.g. 16,32,64,128")
        if int(part) in budgets:
            raise InputError(f"--budgets: {part} is listed twice")
        budgets.append(int(part))
    return budgets


def check_names(names: list[str], allow_missing: bool) -> tuple[list[str], list[dict]]:
    """The names that can be swept, and notes for those skipped."""
    known = registry()
    keep, skipped = [], []
    for name in names:
        base = name.split(":")[0]
        cls = known.get(base)
        if cls is None:
            if not allow_missing:
                raise StrategyError(f"--strategies: {base!r} is not a registered strategy (known: "
                                    f"{', '.join(sorted(known))}); pass --allow-missing to skip it")
            skipped.append({"strategy": name, "budget": None, "reason": f"{base!r} is not a registered strategy"})
            continue
        if "budget" not in cls.settings():
            raise StrategyError(f"--strategies: {base!r} has no budget setting to sweep (the full cache is always "
                                "the reference)")
        if any(pair.partition("=")[0] == "budget" for pair in name.split(":")[1:]):
            raise StrategyError(f"--strategies: {name!r} sets budget itself; the sweep sets it, remove budget=")
        keep.append(name)
    return keep, skipped


def plan(names: list[str], budgets: list[int], allow_missing: bool) -> tuple[dict, list[dict]]:
    """{budget: [(name, Strategy)]} to run, and the notes of what is skipped."""
    names, skipped = check_names(names, allow_missing)
    runs: dict[int, list] = {b: [] for b in budgets}
    for name in names:
        errors = []
        for budget in budgets:
            try:
                runs[budget].append((name, parse_spec(f"{name}:budget={budget}")))
            except StrategyError as e:
                errors.append((budget, str(e)))
        if len(errors) == len(budgets):
            raise StrategyError(f"--strategies: {name!r} fits none of the budgets: {errors[0][1]}")
        skipped += [{"strategy": name, "budget": b, "reason": reason} for b, reason in errors]
    return runs, skipped


def sweep_cell(cell: dict) -> dict:
    """One budget's lockstep run in a worker: the model loaded by name, every strategy at `cell["budget"]` against
    the full cache.  Returns {"rows", "head", "reference"} (the last two as `Sweep` keeps them)."""
    loaded = load_model(cell["model"], dtype=cell["dtype"], device=cell["device"], progress=lambda msg: None)
    sweep = Sweep(loaded, list(cell["turns"]), cell["raw"], dict(cell["options"]))
    budget = cell["budget"]
    rows = sweep.run([(name, parse_spec(f"{name}:budget={budget}"), budget) for name in cell["strategies"]])
    return {"rows": rows, "head": sweep.head, "reference": sweep.reference}


def budget_cells(runs: dict, req, loaded, turns: list[str], raw: bool, options: dict) -> list[dict]:
    """The cells of a fixed-budget sweep, one per budget that has strategies, in the budgets' order.  The thread
    count is resolved here (torch's count in this process when --threads is not given), so a worker runs with the
    count an in-process run would have used."""
    threads = options.get("threads") or torch.get_num_threads()
    return [{"name": f"{req.model} budget={budget}", "model": req.model, "dtype": req.dtype,
             "device": loaded.device.type, "threads": threads, "turns": list(turns), "raw": raw,
             "options": {**options, "threads": threads}, "budget": budget, "strategies": [n for n, _ in entries]}
            for budget, entries in runs.items() if entries]


class Runner(Sweep):
    """The sweep, saying on stderr what each run holds."""

    def run(self, entries, note: str = "") -> list[dict]:
        print(f"{note}: {', '.join(s.label for _, s, _ in entries)}", file=sys.stderr)
        return super().run(entries)


def rows_table(rows: list[dict], target: int | None = None) -> str:
    cols = ["strategy", "budget", "match", "1st div", "TF agree", "KL", "between turns", "peak in turn", "ms/token",
            "formula = measured"]
    if target is not None:
        cols.insert(8, "vs target")
    body = []
    for r in rows:
        sb = r["state_bytes"]
        cells = [r["strategy"], str(r["budget"]), fmt(r["token_match"], ".3f"), fmt(r["first_divergence"], "d"),
                 fmt(r["teacher_forced_agreement"], ".3f"), fmt(r["kl_mean"], ".2e"), fmt_bytes(sb["between_turns_peak"]),
                 fmt_bytes(sb["peak"]), fmt(r["latency_ms"]["decode_total_ms_mean"], ".1f"),
                 fmt(sb["formula_matches_measurement"])]
        if target is not None:
            cells.insert(8, "-" if sb["peak"] is None else f"{100 * (sb['peak'] / target - 1):+.0f}%")
        body.append(cells)
    return table(cols, body, left=2)


def match_matrix(rows: list[dict], names: list[str], budgets: list[int]) -> str:
    by = {(r["strategy"], r["budget"]): r for r in rows}
    cells = lambda r: "-" if r is None else f"{r['token_match']:.3f} / {fmt_bytes(r['state_bytes']['peak'])}"
    cols = ["token match / peak"] + [f"B={b}" for b in budgets]
    return table(cols, [[n] + [cells(by.get((n, b))) for b in budgets] for n in names])


# --- equal memory -----------------------------------------------------------------------------------------------
def target_spec(names: list[str], budgets: list[int], given: str | None) -> tuple[str | None, int | None]:
    """(spec to run and measure, or None) and (bytes, or None)."""
    if given is not None:
        if given.isdigit():
            return None, int(given)
        parse_spec(given)
        return given, None
    for name in names:
        strategy = parse_spec(f"{name}:budget={budgets[0]}")
        if strategy.claims_exact:
            return strategy.label, None
    raise CliError("--equal-memory: no strategy in --strategies promises exact K/V to take the target from; "
                   "give --target SPEC or --target BYTES")


def equal_memory(runner: Runner, names: list[str], budgets: list[int], given: str | None) -> tuple[int, list, list]:
    """Bisection on GRID per strategy for the measured peak closest to the target; returns (target, chosen, probes)."""
    spec, target = target_spec(names, budgets, given)
    probes = []
    if spec is not None:
        row = runner.run([(spec, parse_spec(spec), None)], "target")[0]
        target = row["state_bytes"]["peak"]
        if target is None:
            raise CliError("--equal-memory needs measured peaks: use --memory storage or trace")
        probes.append(row)
    grid = [b for b in GRID if b < runner.loaded.max_context]
    bounds = {name: [0, len(grid) - 1] for name in names}
    seen: dict[str, dict[int, dict]] = {name: {} for name in names}

    def narrow(name: str, row: dict):
        lo, hi = bounds[name]
        mid = grid.index(row["budget"])
        bounds[name] = [mid + 1, hi] if row["state_bytes"]["peak"] < target else [lo, mid - 1]

    while any(lo <= hi for lo, hi in bounds.values()):
        entries = []
        for name, (lo, hi) in bounds.items():
            if lo > hi:
                continue
            budget = grid[(lo + hi) // 2]
            try:
                entries.append((name, parse_spec(f"{name}:budget={budget}"), budget))
            except StrategyError:  # this budget does not fit the spec: search above it
                bounds[name][0] = (lo + hi) // 2 + 1
        if entries:
            for row in runner.run(entries, f"equal memory, probing {len(entries)} strategies"):
                probes.append(row)
                seen[row["strategy"]][row["budget"]] = row
                narrow(row["strategy"], row)
    chosen = []
    for name in names:
        if seen[name]:
            chosen.append(min(seen[name].values(), key=lambda r: abs(r["state_bytes"]["peak"] - target)))
    return target, chosen, probes


def cmd_sweep(args) -> int:
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if not names:
        raise StrategyError("--strategies: empty list")
    if len(set(names)) != len(names):
        raise StrategyError("--strategies: a name is listed twice")
    budgets = parse_budgets(args.budgets)
    if args.target is not None and not args.equal_memory:
        raise CliError("--target: only with --equal-memory")
    if args.equal_memory and (args.memory == "none" or args.no_instruments):
        raise CliError("--equal-memory compares measured peaks: it needs --memory storage (the default) or trace, "
                       "and the instruments on")
    if args.context is not None:
        raise CliError("--context: not for sweep; give --prompt, --prompt-file or --scenario")
    if args.executor is not None:
        check_executor(args.executor)
        if args.equal_memory:
            raise CliError("--executor: not with --equal-memory (its bisection rounds depend on each other; it runs "
                           "in this process)")
    if args.workers is not None:
        if args.executor != "local":
            raise CliError("--workers: only with --executor local (Ray places cells by their resources)")
        validate.integer("workers", args.workers, 1, 4096)
    turns, raw = turns_from_args(args)
    if args.equal_memory:
        names, skipped = check_names(names, args.allow_missing)
        runs = {}
    else:
        runs, skipped = plan(names, budgets, args.allow_missing)
        if not any(runs.values()):
            raise StrategyError("--strategies: nothing left to run")
    for note in skipped:
        at = "" if note["budget"] is None else f" at budget {note['budget']}"
        print(f"note: skipping {note['strategy']}{at}: {note['reason']}")
    known = [n for n in names if n.split(":")[0] in registry()]  # the rest were skipped (or refused) above
    req = validate.request(args.model, args.device, args.dtype, ",".join(known) or "full", args.max_new_tokens, turns,
                           raw)
    loaded = load_model(req.model, dtype=req.dtype, device=req.device)
    validate.against_model(req, loaded)
    for budget in budgets:
        validate.integer("budgets", budget, 1, loaded.max_context, "the model's context")
    runner = Runner(loaded, turns, raw, engine_options(args))
    out = {"turns": turns, "strategies": names, "skipped": skipped}
    if args.equal_memory:
        target, rows, probes = equal_memory(runner, names, budgets, args.target)
        out.update(equal_memory=True, target_bytes=target, rows=rows, probes=probes)
        plotted = probes
        head, reference = runner.head, runner.reference
    elif args.executor is None:
        rows = []
        for budget in budgets:
            if runs[budget]:
                rows += runner.run([(n, s, budget) for n, s in runs[budget]], f"budget {budget}")
        out.update(budgets=budgets, rows=rows)
        plotted = rows
        head, reference = runner.head, runner.reference
    else:
        cells = budget_cells(runs, req, loaded, turns, raw, engine_options(args))
        for i, cell in enumerate(cells):
            labels = ", ".join(s.label for _, s in runs[cell["budget"]])
            print(f"budget {cell['budget']} (cell {i + 1} of {len(cells)}, {args.executor}): {labels}", file=sys.stderr)
        results = run_cells(sweep_cell, cells, args.executor, args.workers)
        rows = [row for result in results for row in result["rows"]]
        out.update(budgets=budgets, rows=rows)
        plotted = rows
        head, reference = results[0]["head"], results[0]["reference"]
    print(f"model {head['model']} ({head['model_source']}), device {head['device']}, dtype {head['dtype']}, "
          f"threads {head['threads']}, {len(turns)} turns, max {args.max_new_tokens} new tokens per turn; "
          f"reference: full cache, {len(reference['token_ids'])} tokens generated, peak in turn "
          f"{fmt_bytes(reference['state_bytes']['peak'])}, between turns "
          f"{fmt_bytes(reference['state_bytes']['between_turns_peak'])}; bytes: {head['memory_instrument']}")
    if args.equal_memory:
        print(f"\nat equal memory: every strategy at the budget whose measured peak is closest to "
              f"{fmt_bytes(out['target_bytes'])} ({len(out['probes'])} runs probed)")
        print(rows_table(rows, out["target_bytes"]))
    else:
        print(rows_table(rows))
        print()
        print(match_matrix(rows, [n for n in names if any(r["strategy"] == n for r in rows)], budgets))
    print(f"\nlast turn, full: {reference['turn_texts'][-1][:100]!r}")
    for r in rows:
        print(f"last turn, {r['spec']}: {r['turn_texts'][-1][:100]!r}")
    if args.plot:
        title = f"{head['model']}, {args.scenario or 'one prompt'}: memory against agreement"
        fig = frontier_figure(points_from_rows(plotted), title=title,
                              subtitle=f"{head['device']}, {head['dtype']}; reference peak "
                                       f"{fmt_bytes(reference['state_bytes']['peak'])}")
        html, png, problem = write_frontier(fig, args.plot)
        print(f"\nwrote {html}" + (f" and {png}" if png else ""))
        if problem:
            print(f"note: {problem}")
        out["plot"] = {"html": html, "png": png}
    write_json(args.json, {**head, **out, "reference": reference}, "sweep")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="every strategy at every budget against the full cache")
    add_conversation_options(p)
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help="comma-separated name[:key=value]...; :budget=B is appended to each")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma-separated token budgets")
    p.add_argument("--equal-memory", action="store_true",
                   help="give each strategy the budget whose measured peak is closest to a target (always runs in "
                        "this process: its rounds depend on each other; not with --executor)")
    p.add_argument("--target", help="with --equal-memory: a spec whose measured peak is the target, or bytes")
    p.add_argument("--plot", help="write the trade-off frontier as PLOT.html and PLOT.png")
    p.add_argument("--allow-missing", action="store_true",
                   help="skip, with a printed note, names that are not registered strategies")
    p.add_argument("--json", help="write every row here")
    p.add_argument("--executor", default=None,
                   help=f"one of {', '.join(EXECUTORS)}: run each budget's lockstep run as a cell on a process pool "
                        "here (local) or as a Ray task (ray: the cluster at RAY_ADDRESS, else a local Ray started for "
                        "the run; pip install -r requirements-ray.txt); default: one after another in this process")
    p.add_argument("--workers", type=int, default=None,
                   help="with --executor local: processes at most (default: cores // threads per cell)")
    p.set_defaults(func=cmd_sweep)
    return p
