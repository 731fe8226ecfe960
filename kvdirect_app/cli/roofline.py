"""`bench roofline`: this machine's roofline for a model's decode step, and each step's shared pass against it.

    bench roofline [--model smollm2-135m] [--dtype float32] [--threads N] [--rows 1,7,8,16]
                   [--strategies SPECS] [--step-strategies SPECS] [--max-new-tokens 16] [--json OUT]

Measures the GEMM rate (a 2048^3 GEMM, fp32, and bf16 where the CPU has bf16 instructions or the model is bf16)
and the copy bandwidth here, the model's weight bytes, and from them the best possible time of a step's linears
for each row count; then the linears as the engine runs them (the invariant kernels: which ones ran, and the
weights' GB/s; the native ones), and three runs of a held-out prompt: the plain full cache (`--kernels native
--memory none --no-instruments`, one row), the panes of `--strategies` with the default instruments, and the
same with AnchorKV rebuilding every step (`--step-strategies`).  Each run's decode step is split into parts: the
linears (as measured alone at its row count), the rest of the shared pass, each kind of the lanes' own work
summed over the lanes, the measurement by instrument, and the engine's own.
"""

from __future__ import annotations

import time

from ..benchmarks import roofline
from ..engine.runner import Engine, run_to_end
from ..kernels.invariant import Kernels, describe
from ..models.loading import DTYPES, load_model
from ..models.threads import pin
from ..plain.errors import UserError
from ..strategies import parse_specs
from .common import THREADS, whole, write_json

PANES = "full,kvdirect:budget=64,anchorkv:spacing=30:budget=64,h2o,streaming_llm,snapkv,tova"
STEP_PANES = PANES.replace("anchorkv:spacing=30:budget=64", "anchorkv:spacing=30:budget=64:rebuild=step")
LANE_PARTS = ("attention", "cache_update", "scoring", "recompute", "replay", "other")
RUN_NAMES = {"plain": "plain full", "panes": "panes", "panes_step": "panes, AnchorKV rebuild=step"}


def _part_name(part: str) -> str:
    """A step part's key (`parts_ms`) in words."""
    if part == "linears":
        return "linears (measured alone)"
    if part == "shared_rest":
        return "the rest of the shared pass"
    for head, words in (("lanes_", "lanes' "), ("measurement_", "measurement: ")):
        if part.startswith(head):
            return words + part.removeprefix(head).replace("_", " ")
    return part


PROMPT = "Tell me a short story about a lighthouse keeper who finds a message in a bottle, and what happens next."


def _rows(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(r) for r in text.split(","))
    except ValueError:
        rows = ()
    if not rows or any(r < 1 or r > 512 for r in rows):
        raise UserError(f"--rows: {text[:40]!r} is not allowed; allowed: comma-separated row counts from 1 to 512")
    return rows


def _run(loaded, specs: str, tokens: int, threads: int, **options) -> tuple[float, dict, int]:
    engine = Engine(loaded, parse_specs(specs), max_new_tokens=tokens, threads=threads, **options)
    t0 = time.perf_counter()
    result = run_to_end(engine, [PROMPT])
    return time.perf_counter() - t0, result, len(engine.all_lanes)


def measure(args) -> dict:
    rows = _rows(args.rows)
    if args.max_new_tokens < 2:
        raise UserError(f"--max-new-tokens: {args.max_new_tokens} is not allowed; allowed: 2 or more (decode steps)")
    loaded = load_model(args.model, dtype=args.dtype)
    threads = __import__("torch").get_num_threads() if args.threads is None else args.threads
    pin(threads)
    for specs in (args.strategies, args.step_strategies):  # a bad spec is refused before anything is measured
        if specs:
            parse_specs(specs)
    kernels = {mode: Kernels.for_model(loaded, mode, threads) for mode in ("invariant", "native")}
    here = roofline.machine(threads, loaded.dtype)
    model = roofline.model_side(loaded)
    rate = roofline.rate_for(here, loaded.dtype)
    table = []
    for n in rows:
        best = roofline.best_ms(model["weight_bytes"], model["params"], n, rate, here["bandwidth_gbs"])
        for mode, k in kernels.items():
            best[f"{mode}_linears_ms"] = roofline.linears_ms(loaded, k, n) if k.mode == mode else None
        table.append(best)
    runs = {}
    _run(loaded, "full", 2, threads, memory="none", kernels="native", instruments=False)  # warm
    for name, specs, options in (
        ("plain", "full", {"memory": "none", "kernels": "native", "instruments": False}),
        ("panes", args.strategies, {}),
        ("panes_step", args.step_strategies, {}),
    ):
        if not specs:
            continue
        seconds, result, lanes = _run(loaded, specs, args.max_new_tokens, threads, **options)
        steps = result["steps"]
        best = roofline.best_ms(model["weight_bytes"], model["params"], lanes, rate, here["bandwidth_gbs"])
        linears = roofline.linears_ms(loaded, kernels[result["kernels"]["mode"]], lanes)
        lane_parts = {
            part: sum(r["latency_ms"][f"decode_{part}_ms_mean"] for r in result["strategies"].values())
            for part in LANE_PARTS
        }
        parts = {
            "linears": linears,
            "shared_rest": steps["shared_ms_mean"] - linears,
            **{f"lanes_{part}": ms for part, ms in lane_parts.items()},
            **{f"measurement_{k}": ms for k, ms in steps["measurement_by_instrument_ms_mean"].items()},
            "engine": steps["engine_ms_mean"],
            "unattributed": steps["unattributed_ms_mean"],
        }
        runs[name] = {
            "strategies": specs,
            "seconds": seconds,
            "rows": lanes,
            "kernels": result["kernels"]["mode"],
            "wall_ms": steps["wall_ms_mean"],
            "shared_ms": steps["shared_ms_mean"],
            "lanes_ms": steps["lanes_ms_mean"],
            "measurement_ms": steps["measurement_ms_mean"],
            "best_ms": best["best_ms"],
            "shared_over_best": steps["shared_ms_mean"] / best["best_ms"],
            "parts_ms": parts,
            "own_ms": {
                label: (r["latency_ms"]["decode_total_ms_mean"] - r["latency_ms"]["decode_shared_ms_mean"])
                for label, r in result["strategies"].items()
            },
        }
    invariant = kernels["invariant"]
    return {
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "machine": here,
        "weights": model,
        "rows": table,
        "runs": runs,
        "kernels": {"invariant": describe(invariant.report()), "linears": invariant.dots or "probed GEMM"},
        "ratios": {name: run["seconds"] / runs["plain"]["seconds"] for name, run in runs.items() if name != "plain"},
        "ratio": runs["panes"]["seconds"] / runs["plain"]["seconds"],
    }


def cmd_roofline(args) -> int:
    report = measure(args)
    here, model = report["machine"], report["weights"]
    rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in here["gemm_gflops"].items())
    print(
        f"{report['model']} {report['dtype']} on {report['device']}, {here['threads']} thread(s), "
        f"{here['capability']}; bf16 instructions: {', '.join(here['bf16_instructions']) or 'none'}"
    )
    print(f"  machine: 2048^3 GEMM {rates}; copy {here['bandwidth_gbs']:.1f} GB/s")
    print(
        f"  model: {model['linears']} linears, {model['params'] / 1e6:.1f} M weights, "
        f"{model['weight_bytes'] / 2**20:.0f} MiB read per step"
    )
    print(f"  {report['kernels']['invariant']}")
    gbs = model["weight_bytes"] / 1e6  # MB: / ms = GB/s
    print(
        f"\n  {'rows':>4}  {'weights read':>12}  {'arithmetic':>10}  {'best':>8}  {'bound':>10}  "
        f"{'invariant linears':>26}  {'native linears':>23}"
    )
    for r in report["rows"]:
        inv = (
            "n/a"
            if r["invariant_linears_ms"] is None
            else (
                f"{r['invariant_linears_ms']:.1f} ({r['invariant_linears_ms'] / r['best_ms']:.1f}x, "
                f"{gbs / r['invariant_linears_ms']:.0f} GB/s)"
            )
        )
        nat = (
            f"{r['native_linears_ms']:.1f} ({r['native_linears_ms'] / r['best_ms']:.1f}x, "
            f"{gbs / r['native_linears_ms']:.0f} GB/s)"
        )
        print(
            f"  {r['rows']:>4}  {r['weights_read_ms']:>9.1f} ms  {r['arithmetic_ms']:>7.1f} ms  "
            f"{r['best_ms']:>5.1f} ms  {r['bound']:>10}  {inv:>26}  {nat:>23}"
        )
    print()
    for name, run in report["runs"].items():
        print(
            f"  {RUN_NAMES[name]} ({run['rows']} row(s) a step, kernels {run['kernels']}): {run['seconds']:.1f} s; "
            "per decode "
            f"step {run['wall_ms']:.0f} ms: shared pass {run['shared_ms']:.0f} ms = {run['shared_over_best']:.1f}x "
            f"its roofline ({run['best_ms']:.1f} ms), lanes' own {run['lanes_ms'] - run['shared_ms']:.0f}, "
            f"measurement {run['measurement_ms']:.0f}"
        )
        if len(run["own_ms"]) > 1:
            print("    own ms a step: " + ", ".join(f"{label} {ms:.1f}" for label, ms in run["own_ms"].items()))
        print(
            "    the step by part, ms: "
            + ", ".join(f"{_part_name(part)} {ms:.1f}" for part, ms in run["parts_ms"].items() if ms >= 0.05)
        )
    print()
    for name, ratio in report["ratios"].items():
        print(f"  {RUN_NAMES[name]} / plain full: {ratio:.2f}x")
    write_json(args.json, report, "roofline")
    return 0


def register(sub):
    p = sub.add_parser("roofline", help="this machine's roofline for a decode step, and the shared pass against it")
    p.add_argument("--model", default="smollm2-135m", help="preset name, Hub id or local path")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--threads", type=THREADS, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rows", default=",".join(map(str, roofline.ROWS)), help="row counts of the table")
    p.add_argument("--strategies", default=PANES, help="the panes timed against the plain full cache")
    p.add_argument(
        "--step-strategies", default=STEP_PANES, help="the same with AnchorKV rebuilding every step ('' to skip)"
    )
    p.add_argument("--max-new-tokens", type=whole(2, None, "decode steps"), default=16)
    p.add_argument("--json")
    p.set_defaults(func=cmd_roofline)
    return sub
