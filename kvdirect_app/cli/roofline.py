"""`bench roofline`: this machine's roofline for a model's decode step, and each step's shared pass against it.

    bench roofline [--model smollm2-135m] [--dtype float32] [--threads N] [--rows 1,7,8,16]
                   [--strategies SPECS] [--max-new-tokens 16] [--json OUT]

Measures the GEMM rate (a 2048^3 GEMM, fp32, and bf16 where the CPU has bf16 instructions or the model is bf16)
and the copy bandwidth here, the model's weight bytes, and from them the best possible time of a step's linears
for each row count; then the linears as the engine runs them (invariant and native kernels), and two runs of a
held-out prompt: the plain full cache (`--kernels native --memory none --no-instruments`, one row) and the
panes of `--strategies` with the default instruments, each step's shared pass against the roofline of its rows
and each lane's own work beside it.
"""

from __future__ import annotations

import time

from .. import roofline
from ..engine import Engine, run_to_end
from ..errors import UserError
from ..kernels import Kernels
from ..models import DTYPES, load_model
from ..strategies import parse_specs
from ..threads import pin
from .common import THREADS, whole, write_json

PANES = "full,kvdirect:budget=64,anchorkv:spacing=30:budget=64,h2o,streaming_llm,snapkv,tova"
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
    parse_specs(args.strategies)  # a bad spec is refused before anything is measured
    kernels = {mode: Kernels.for_model(loaded, mode, threads) for mode in ("invariant", "native")}
    here = roofline.machine(threads, loaded.dtype)
    model = roofline.model_side(loaded)
    rate = roofline.rate_for(here, loaded.dtype)
    table = []
    for n in rows:
        best = roofline.best_ms(model["weight_bytes"], model["params"], n, rate, here["bandwidth_gbs"])
        for mode, k in kernels.items():
            best[f"{mode}_linears_ms"] = (roofline.linears_ms(loaded, k, n) if k.mode == mode else None)
        table.append(best)
    runs = {}
    _run(loaded, "full", 2, threads, memory="none", kernels="native", instruments=False)  # warm
    for name, specs, options in (("plain full", "full", {"memory": "none", "kernels": "native", "instruments": False}),
                                 ("panes", args.strategies, {})):
        seconds, result, lanes = _run(loaded, specs, args.max_new_tokens, threads, **options)
        steps = result["steps"]
        best = roofline.best_ms(model["weight_bytes"], model["params"], lanes, rate, here["bandwidth_gbs"])
        runs[name] = {"strategies": specs, "seconds": seconds, "rows": lanes, "kernels": result["kernels"]["mode"],
                      "wall_ms": steps["wall_ms_mean"], "shared_ms": steps["shared_ms_mean"],
                      "lanes_ms": steps["lanes_ms_mean"], "measurement_ms": steps["measurement_ms_mean"],
                      "best_ms": best["best_ms"], "shared_over_best": steps["shared_ms_mean"] / best["best_ms"],
                      "own_ms": {label: r["latency_ms"]["decode_total_ms_mean"] - r["latency_ms"]["decode_shared_ms_mean"]
                                 for label, r in result["strategies"].items()}}
    return {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device),
            "machine": here, "weights": model, "rows": table, "runs": runs,
            "ratio": runs["panes"]["seconds"] / runs["plain full"]["seconds"]}


def cmd_roofline(args) -> int:
    report = measure(args)
    here, model = report["machine"], report["weights"]
    rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in here["gemm_gflops"].items())
    print(f"{report['model']} {report['dtype']} on {report['device']}, {here['threads']} thread(s), "
          f"{here['capability']}; bf16 instructions: {', '.join(here['bf16_instructions']) or 'none'}")
    print(f"  machine: 2048^3 GEMM {rates}; copy {here['bandwidth_gbs']:.1f} GB/s")
    print(f"  model: {model['linears']} linears, {model['params'] / 1e6:.1f} M weights, "
          f"{model['weight_bytes'] / 2 ** 20:.0f} MiB read per step")
    print(f"\n  {'rows':>4}  {'weights read':>12}  {'arithmetic':>10}  {'best':>8}  {'bound':>10}  "
          f"{'invariant linears':>17}  {'native linears':>14}")
    for r in report["rows"]:
        inv = "n/a" if r["invariant_linears_ms"] is None else (
            f"{r['invariant_linears_ms']:.1f} ({r['invariant_linears_ms'] / r['best_ms']:.1f}x)")
        print(f"  {r['rows']:>4}  {r['weights_read_ms']:>9.1f} ms  {r['arithmetic_ms']:>7.1f} ms  "
              f"{r['best_ms']:>5.1f} ms  {r['bound']:>10}  {inv:>17}  "
              f"{r['native_linears_ms']:.1f} ({r['native_linears_ms'] / r['best_ms']:.1f}x)")
    print()
    for name, run in report["runs"].items():
        print(f"  {name} ({run['rows']} row(s) a step, kernels {run['kernels']}): {run['seconds']:.1f} s; per decode "
              f"step {run['wall_ms']:.0f} ms: shared pass {run['shared_ms']:.0f} ms = {run['shared_over_best']:.1f}x "
              f"its roofline ({run['best_ms']:.1f} ms), lanes' own {run['lanes_ms'] - run['shared_ms']:.0f}, "
              f"measurement {run['measurement_ms']:.0f}")
        if len(run["own_ms"]) > 1:
            print("    own ms a step: " + ", ".join(f"{label} {ms:.1f}" for label, ms in run["own_ms"].items()))
    print(f"\n  panes / plain full: {report['ratio']:.2f}x")
    write_json(args.json, report, "roofline")
    return 0


def register(sub):
    p = sub.add_parser("roofline", help="this machine's roofline for a decode step, and the shared pass against it")
    p.add_argument("--model", default="smollm2-135m", help="preset name, Hub id or local path")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--threads", type=THREADS, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rows", default=",".join(map(str, roofline.ROWS)), help="row counts of the table")
    p.add_argument("--strategies", default=PANES, help="the panes timed against the plain full cache")
    p.add_argument("--max-new-tokens", type=whole(2, None, "decode steps"), default=16)
    p.add_argument("--json")
    p.set_defaults(func=cmd_roofline)
    return sub
