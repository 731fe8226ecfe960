"""Headless benchmark CLI.

    python -m kvdirect_app.bench run --model smollm2-135m \\
        --strategies full,kvdirect:budget=64:mode=exact,kvdirect:budget=64:mode=fast \\
        --max-new-tokens 64 --json out.json

Prints a table and writes JSON.  Bad input exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from . import anchor_bench, sweep
from .models import DEVICES, DTYPES, PRESETS_DIR, ModelError, load_model
from .strategies import StrategyError, parse_specs

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


class CliError(ValueError):
    pass


def scenarios() -> dict[str, dict]:
    with open(PRESETS_DIR / "scenarios.toml", "rb") as f:
        table = tomllib.load(f)
    for scenario in table.values():
        if "file" in scenario:
            scenario["turns"] = [(PRESETS_DIR / scenario["file"]).read_text(encoding="utf-8"), *scenario.get("turns", [])]
    return table


def turns_from_args(args) -> tuple[list[str], bool]:
    """User turns and whether to feed them raw."""
    given = [x for x in (args.prompt is not None, args.prompt_file is not None, args.scenario is not None) if x]
    if len(given) > 1:
        raise CliError("give only one of --prompt, --prompt-file, --scenario")
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise CliError(f"--prompt-file: no such file {args.prompt_file!r}")
        return [path.read_text(encoding="utf-8")], args.raw
    if args.scenario is not None:
        table = scenarios()
        if args.scenario not in table:
            raise CliError(f"--scenario: unknown scenario {args.scenario!r}; allowed: {', '.join(table)}")
        scenario = table[args.scenario]
        return list(scenario["turns"]), args.raw or scenario.get("raw", False)
    return [DEFAULT_PROMPT if args.prompt is None else args.prompt], args.raw


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _fmt(x, spec=".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return format(x, spec)


def table(result: dict) -> str:
    cols = ["strategy", "tokens", "match", "1st div", "TF agree", "KL", "K/V exact", "max|dK|", "max|dV|",
            "max|dlogit|", "between turns", "persistent", "peak", "formula peak", "TTFT ms", "ms/step", "recomp ms", "score ms",
            "tok/s"]
    rows = []
    for spec, r in result["strategies"].items():
        lat = r["latency_ms"]
        rows.append([
            spec, str(len(r["token_ids"])), _fmt(r["token_match"], ".3f"), _fmt(r["first_divergence"], "d"),
            _fmt(r["teacher_forced_agreement"], ".3f"), _fmt(r["kl_mean"], ".2e"), _fmt(r["kv_exact"]),
            _fmt(r["max_abs_dk"], ".1e"), _fmt(r["max_abs_dv"], ".1e"), _fmt(r["max_abs_dlogit"], ".1e"),
            _fmt_bytes(r["state_bytes"]["between_turns_peak"]), _fmt_bytes(r["state_bytes"]["persistent_peak"]),
            _fmt_bytes(r["state_bytes"]["peak"]),
            _fmt_bytes(r["state_bytes"]["formula_peak"]), _fmt(lat["ttft_ms"], ".1f"),
            _fmt(lat["decode_total_ms_mean"], ".2f"), _fmt(lat["decode_recompute_ms_mean"], ".2f"),
            _fmt(lat["decode_scoring_ms_mean"], ".2f"), _fmt(r["tokens_per_s"], ".1f"),
        ])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(cells, widths)))
    head = (f"model {result['model']} ({result['model_source']}), device {result['device']}, dtype {result['dtype']}, "
            f"threads {result['threads']}, prompt {len(result['prompt_ids'])} tokens, "
            f"process RSS peak {_fmt_bytes(result['process_rss_peak_bytes'])}")
    return "\n".join([head, line(cols), line(["-" * w for w in widths]), *map(line, rows)])


def cmd_run(args) -> int:
    from .engine import Engine, run_to_end

    strategies = parse_specs(args.strategies)
    turns, raw = turns_from_args(args)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    engine = Engine(loaded, strategies, max_new_tokens=args.max_new_tokens, raw=raw, threads=args.threads)
    result = run_to_end(engine, turns, park=args.park)
    print(table(result))
    for spec, r in result["strategies"].items():
        print(f"\n[{spec}] {r['text'][:400]!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.json}")
    return 0


def add_conversation_options(p: argparse.ArgumentParser):
    """The options `run` and `sweep` share: the model, the conversation, the device and timing."""
    p.add_argument("--model", default="smollm2-135m", help="preset name, Hub id or local path")
    p.add_argument("--prompt", help="one user message (a chat model's template is applied)")
    p.add_argument("--prompt-file", help="a file holding one user message")
    p.add_argument("--scenario", help="a scripted conversation from presets/scenarios.toml")
    p.add_argument("--raw", action="store_true", help="feed the text as is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--threads", type=int, default=None, help="torch threads while timing (default: torch's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvdirect_app.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run strategies in lockstep against the full cache")
    add_conversation_options(run)
    run.add_argument("--strategies", default="full,kvdirect:budget=64:mode=exact",
                     help="comma-separated name[:key=value]... e.g. full,kvdirect:budget=64:mode=exact")
    run.add_argument("--park", action="store_true", help="park every session between turns and resume it")
    run.add_argument("--json", help="write the results here")
    run.set_defaults(func=cmd_run)
    anchor_bench.register(sub)
    sweep.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .engine import InputError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ModelError, StrategyError, InputError, anchor_bench.BenchInputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
