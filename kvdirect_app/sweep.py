"""Budget sweep: every strategy at every budget against the full cache, on one conversation.

    python -m kvdirect_app.bench sweep --model smollm2-135m --scenario recall \\
        --strategies window,streaming_llm,h2o,snapkv,tova,kvdirect --budgets 16,32,64,128 --json out.json

For each budget, one lockstep run of the engine (the full cache is the
reference) with `:budget=B` appended to every strategy spec.  Prints a table
of token match, teacher-forced agreement, KL and state bytes per strategy and
budget, the last turn's text of each, and writes every row as JSON.

* A name that is not a registered strategy is an error (one line), or, with
  `--allow-missing`, skipped with a printed note (e.g. a strategy another
  branch adds).
* A spec must not set `budget` itself; a strategy without a budget (`full`,
  the reference) cannot be swept.
* A (strategy, budget) pair whose settings do not fit that budget (e.g.
  `snapkv` with its observation window of 32 at budget 16) is skipped with a
  printed note; a spec that fits no budget is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .models import load_model
from .strategies import StrategyError, parse_spec, registry

DEFAULT_STRATEGIES = "window,streaming_llm,h2o,snapkv,tova,kvdirect"
DEFAULT_BUDGETS = "16,32,64,128"


def parse_budgets(text: str) -> list[int]:
    from .engine import InputError

    budgets = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise InputError(f"--budgets: {part!r} is not a positive integer; give e.g. 16,32,64,128")
        if int(part) in budgets:
            raise InputError(f"--budgets: {part} is listed twice")
        budgets.append(int(part))
    return budgets


def plan(names: list[str], budgets: list[int], allow_missing: bool) -> tuple[dict, list[dict]]:
    """{budget: [(name, Strategy)]} to run, and the notes of what is skipped."""
    known = registry()
    runs: dict[int, list] = {b: [] for b in budgets}
    skipped: list[dict] = []
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


def _fmt_row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def table(rows: list[dict]) -> str:
    from .bench import _fmt, _fmt_bytes

    cols = ["strategy", "budget", "match", "1st div", "TF agree", "KL", "between turns", "persistent", "peak",
            "formula=meas"]
    body = []
    for r in rows:
        sb = r["state_bytes"]
        body.append([r["strategy"], str(r["budget"]), _fmt(r["token_match"], ".3f"), _fmt(r["first_divergence"], "d"),
                     _fmt(r["teacher_forced_agreement"], ".3f"), _fmt(r["kl_mean"], ".2e"),
                     _fmt_bytes(sb["between_turns_peak"]), _fmt_bytes(sb["persistent_peak"]), _fmt_bytes(sb["peak"]),
                     _fmt(sb["formula_matches_measurement"])])
    widths = [max(len(c), *(len(row[i]) for row in body)) for i, c in enumerate(cols)]
    return "\n".join([_fmt_row(cols, widths), _fmt_row(["-" * w for w in widths], widths),
                      *(_fmt_row(row, widths) for row in body)])


def match_matrix(rows: list[dict], names: list[str], budgets: list[int]) -> str:
    by = {(r["strategy"], r["budget"]): r["token_match"] for r in rows}
    width = max(len("strategy"), *(len(n) for n in names))
    lines = ["token match".ljust(width) + "".join(f"{'B=' + str(b):>9}" for b in budgets)]
    for name in names:
        cells = "".join(f"{by[(name, b)]:>9.3f}" if (name, b) in by else f"{'-':>9}" for b in budgets)
        lines.append(name.ljust(width) + cells)
    return "\n".join(lines)


def cmd_sweep(args) -> int:
    from . import bench
    from .engine import Engine, InputError, run_to_end

    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if not names:
        raise StrategyError("--strategies: empty list")
    if len(set(names)) != len(names):
        raise StrategyError("--strategies: a name is listed twice")
    budgets = parse_budgets(args.budgets)
    runs, skipped = plan(names, budgets, args.allow_missing)
    if not any(runs.values()):
        raise StrategyError("--strategies: nothing left to run")
    try:
        turns, raw = bench.turns_from_args(args)
    except ValueError as e:  # bench's CliError; its class differs when bench runs as __main__
        raise InputError(str(e)) from None
    for note in skipped:
        at = "" if note["budget"] is None else f" at budget {note['budget']}"
        print(f"note: skipping {note['strategy']}{at}: {note['reason']}")
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    rows, reference, head = [], None, None
    for budget in budgets:
        if not runs[budget]:
            continue
        print(f"budget {budget}: {', '.join(s.label for _, s in runs[budget])}", file=sys.stderr)
        engine = Engine(loaded, [parse_spec("full")] + [s for _, s in runs[budget]],
                        max_new_tokens=args.max_new_tokens, raw=raw, threads=args.threads)
        result = run_to_end(engine, turns)
        if reference is None:
            reference = result["strategies"]["full"]
            head = {k: v for k, v in result.items() if k != "strategies"}
        for name, strategy in runs[budget]:
            rows.append({"strategy": name, "budget": budget, "spec": strategy.label,
                         **result["strategies"][strategy.label]})
    print(f"model {head['model']} ({head['model_source']}), device {head['device']}, dtype {head['dtype']}, "
          f"threads {head['threads']}, {len(turns)} turns, max {args.max_new_tokens} new tokens per turn; "
          f"reference: full cache, {len(reference['token_ids'])} tokens generated")
    print(table(rows))
    print()
    print(match_matrix(rows, names, budgets))
    print(f"\nlast turn, full: {reference['turn_texts'][-1][:100]!r}")
    for r in rows:
        print(f"last turn, {r['spec']}: {r['turn_texts'][-1][:100]!r}")
    if args.json:
        out = {**head, "turns": turns, "budgets": budgets, "strategies": names, "reference": reference,
               "rows": rows, "skipped": skipped}
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.json}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Adds the `sweep` command to the benchmark CLI's subparsers."""
    from .bench import add_conversation_options

    p = subparsers.add_parser("sweep", help="every strategy at every budget against the full cache")
    add_conversation_options(p)
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help="comma-separated name[:key=value]...; :budget=B is appended to each")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma-separated token budgets")
    p.add_argument("--allow-missing", action="store_true",
                   help="skip, with a printed note, names that are not registered strategies")
    p.add_argument("--json", help="write every row here")
    p.set_defaults(func=cmd_sweep)
    return p
