"""AnchorKV benchmarks: `breakeven`, `capacity` and `replay` subcommands of `python -m kvdirect_app.bench`.

    bench breakeven (--model NAME | --config PATH) [--dtype bfloat16|float32] [--json OUT]
    bench capacity --model NAME --context 32768 [--memory-gb G] [--json OUT]
    bench replay --model NAME --context N --spacing s [--json OUT]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import torch

from ..geometry import ModelGeometry, breakeven_report, load_config
from ..models import DTYPES, resolve_dtype
from ..prompts import filler_ids
from ..units import fmt, fmt_bytes, table
from .common import CliError, write_json


def _kib(n: float) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 1024:.2f} KiB" if n >= 1024 else f"{n:.0f} B"


# --- breakeven -----------------------------------------------------------------
def cmd_breakeven(args) -> int:
    if (args.model is None) == (args.config is None):
        raise CliError("give exactly one of --model NAME or --config PATH")
    if args.config is not None and not Path(args.config).is_file():
        raise CliError(f"--config: no such file {args.config!r}")
    try:
        config = load_config(args.config or args.model)
    except (OSError, ValueError) as e:
        raise CliError(f"--model: cannot read a config for {args.model!r} ({str(e).splitlines()[0]})") from None
    geom = ModelGeometry.from_config(config, resolve_dtype(args.dtype))
    report = breakeven_report(geom, context=args.context, max_passes=args.max_passes)
    report["source"] = args.config or args.model
    report["dtype"] = args.dtype
    print(f"{report['source']} ({args.dtype}): L={report['layers']} d={report['hidden_size']} "
          f"n_kv={report['num_kv_heads']} d_h={report['head_dim']}")
    print(f"  full KV per token (every layer global): {_kib(report['kv_bytes_per_token'])}")
    print(f"  residual per stored layer:              {_kib(report['residual_bytes_per_layer'])}")
    print(f"  r = d / (2 n_kv d_h) = {report['ratio_r']:.3g}"
          + ("  (> 1: a residual at every layer costs more than its K/V)" if report["ratio_r"] > 1 else ""))
    print(f"  break-even spacing s* = {report['break_even_spacing']}  "
          f"(layer 0 as a token id: {report['break_even_spacing_token_id_anchor']})")
    print(f"\n  {'s':>3}  {'anchors':>7}  {'bytes/token':>12}  {'token-id anchor':>15}  {'vs full KV':>10}  "
          f"{'cascade':>7}  {'naive':>6}")
    for row in report["per_spacing"]:
        ratio = row["anchor_bytes_per_token_token_id_anchor"] / report["kv_bytes_per_token"]
        print(f"  {row['spacing']:>3}  {len(row['anchors']):>7}  {_kib(row['anchor_bytes_per_token']):>12}  "
              f"{_kib(row['anchor_bytes_per_token_token_id_anchor']):>15}  {ratio:>10.3f}  "
              f"{row['cascade_passes']:>7}  {row['naive_passes']:>6}")
    windowed = report.get("windowed")
    if windowed:
        dp = windowed["dp_placement"]
        print(f"\n  sliding-window view at {windowed['context']} tokens: global layers {report['global_layers']}, "
              f"global KV {_kib(windowed['global_kv_bytes_per_token'])}/token, windows "
              f"{_kib(windowed['window_bytes_per_session'])}/session")
        print(f"  break-even counting global layers only: s* = {windowed['break_even_spacing_global_only']} "
              f"(token-id anchor: {windowed['break_even_spacing_global_only_token_id_anchor']})")
        print(f"  DP placement (bound {dp['max_passes']}): anchors {dp['anchors']}, {_kib(dp['bytes_per_token'])}/token, "
              f"{dp['cascade_passes']} passes")
        print(f"\n  {'s':>3}  {'uniform bytes':>13}  {'passes':>6}  {'DP at same passes':>17}  DP anchors")
        for row in windowed["uniform"]:
            print(f"  {row['spacing']:>3}  {_kib(row['bytes_per_token']):>13}  {row['cascade_passes']:>6}  "
                  f"{_kib(row['dp_bytes_per_token']):>17}  {row['dp_anchors']}")
    write_json(args.json, report, "breakeven")
    return 0


# --- shared: a context of exactly N tokens --------------------------------------------
def _context_engine(loaded, strategies, n: int):
    from ..engine import Engine

    if n < 2 or n >= loaded.max_context:
        raise CliError(f"--context: {n} must be between 2 and the model's context {loaded.max_context - 1}")
    engine = Engine(loaded, strategies, max_new_tokens=1, raw=True)
    for _ in engine.turn("context", ids=filler_ids(loaded.tokenizer, n)):
        pass
    return engine


# --- replay ---------------------------------------------------------------------------
def cmd_replay(args) -> int:
    from ..engine import model_lock
    from ..models import load_model
    from ..strategies.anchorkv import AnchorKV, rebuild_all

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    geom = ModelGeometry.from_config(loaded.config, loaded.dtype)
    if not 1 <= args.spacing <= geom.num_layers:
        raise CliError(f"--spacing: {args.spacing} must be between 1 and L={geom.num_layers}")
    strategy = AnchorKV(spacing=args.spacing, budget=1)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    engine = _context_engine(loaded, [strategy], args.context)
    cache, reference = engine.lanes[0].cache, engine.reference.cache
    anchors = strategy.anchor_layers(geom)
    rows = {}
    with model_lock(loaded.model), torch.inference_mode(), engine.kernel_scope():
        for kind in ("cascade", "naive"):
            replayer = cache.store.replayer
            replayer.passes = replayer.calls = 0
            t0 = time.perf_counter()
            kv = rebuild_all(cache, kind)
            elapsed = time.perf_counter() - t0
            exact = all(torch.equal(k, reference.layers[g].keys) and torch.equal(v, reference.layers[g].values)
                        for g, (k, v) in kv.items())
            rows[kind] = {"seconds": elapsed, "layer_passes": replayer.passes, "layer_calls": replayer.calls,
                          "kv_exact": exact, "expected_passes": geom.replay_passes(anchors, cascade=kind == "cascade")}
            del kv
    speedup = rows["naive"]["seconds"] / rows["cascade"]["seconds"]
    ideal = rows["naive"]["layer_passes"] / rows["cascade"]["layer_passes"]
    result = {"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "context": args.context, "spacing": args.spacing,
              "anchors": anchors, "replay": rows, "speedup": speedup, "ideal_pass_ratio": ideal,
              "speedup_over_ideal": speedup / ideal}
    print(f"{loaded.name} {result['dtype']} on {result['device']}, {args.context} tokens, spacing {args.spacing} "
          f"(anchors {anchors}), threads {result['threads']}")
    print(f"  {'replay':<8} {'seconds':>8} {'layer passes':>12} {'layer calls':>11}  K/V exact")
    for kind, row in rows.items():
        print(f"  {kind:<8} {row['seconds']:>8.2f} {row['layer_passes']:>12} {row['layer_calls']:>11}  "
              f"{'yes' if row['kv_exact'] else 'NO'}")
    print(f"  cascade speedup {speedup:.2f}x; ideal (pass ratio) {ideal:.2f}x; achieved {speedup / ideal:.2f} of ideal")
    write_json(args.json, result, "replay")
    return 0


# --- capacity -------------------------------------------------------------------------
def _capacity_strategies(geom: ModelGeometry, spacings: list[int], budget: int):
    """Each strategy with the settings it runs with (its default rebuild mode), plus AnchorKV's deepest
    spacing with ``rebuild=step``."""
    from ..strategies import parse_spec

    specs = ["full", f"kvdirect:budget={budget}"]
    specs += [f"anchorkv:spacing={s}:budget={budget}" for s in spacings]
    specs.append(f"anchorkv:spacing={geom.num_layers}:budget={budget}:rebuild=step")
    if any(layer.is_sliding for layer in geom.layers):
        specs += [f"anchorkv:spacing={s}:anchors=dp:budget={budget}" for s in spacings if s > 1]
    return [(spec, parse_spec(spec)) for spec in specs]


def _session(loaded, strategy, n: int, threads: int | None):
    """One session of `strategy` alone (no reference lane), `n` tokens of context, parked."""
    from ..engine import Engine

    engine = Engine(loaded, [strategy], max_new_tokens=1, raw=True, threads=threads, compare=False,
                    memory="trace")  # parked bytes and resume peaks: the allocator's (the claims report reads them)
    for _ in engine.turn("context", ids=filler_ids(loaded.tokenizer, n)):
        pass
    engine.park()
    return engine


def _measure(loaded, strategy, n: int, sessions: int, threads: int | None) -> dict:
    """Park `sessions` sessions (at least one) in this process; bytes measured per session, then resume one
    and time it and its next turn's first token."""
    process = psutil.Process()
    before = process.memory_info().rss
    parked = [_session(loaded, strategy, n, threads) for _ in range(max(1, sessions))]
    after = process.memory_info().rss
    measured = [engine.reference.parks[-1]["bytes"] for engine in parked]
    engine = parked[0]
    resume = engine.resume()["lanes"][strategy.label]
    result = None
    for event in engine.turn(" Continue."):
        if event["type"] == "step":
            result = event["lanes"][strategy.label]
            break
    return {"sessions_parked": len(parked), "parked_bytes_measured": sum(measured) / len(measured),
            "rss_growth_per_session": (after - before) / len(parked), "resume_ms": resume["resume_ms"],
            "resume_peak_bytes": resume["resume_peak_bytes"],
            "next_ttft_ms": None if result is None else result["prefill_ms"]}


def cmd_capacity(args) -> int:
    from ..models import load_model

    if args.context < 2:
        raise CliError(f"--context: {args.context} must be >= 2")
    if args.measure < 0:
        raise CliError(f"--measure: {args.measure} must be >= 0 (sessions to park for real)")
    if args.budget < 1:
        raise CliError(f"--budget: {args.budget} must be >= 1")
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    geom = ModelGeometry.from_config(loaded.config, loaded.dtype)
    memory = (args.memory_gb * 2**30) if args.memory_gb else psutil.virtual_memory().total
    if memory <= 0:
        raise CliError(f"--memory-gb: {args.memory_gb} must be > 0")
    L = geom.num_layers
    spacings = sorted({1, 2, geom.break_even_spacing(token_id_anchor=True) or L, L // 2 or 1, L})
    strategies = _capacity_strategies(geom, spacings, args.budget)
    full_bytes = geom.full_kv_bytes(args.context)
    n = min(args.context, args.measure_context, loaded.max_context - 1)
    rows = []
    for name, strategy in strategies:
        print(f"{name}: parking {max(1, args.measure)} session(s) of {n} tokens…", file=sys.stderr)
        m = _measure(loaded, strategy, n, args.measure, args.threads)
        parked = strategy.formula_parked(geom, args.context)
        rows.append({"strategy": name, "parked_bytes": parked, "parked_bytes_per_token": parked / args.context,
                     "sessions": int(memory // parked), "capacity_vs_full": full_bytes / parked,
                     "measured_at": n, "formula_parked_bytes_at_measure": strategy.formula_parked(geom, n), **m,
                     # Linear in tokens: a lower bound, since replayed attention grows faster than linearly.
                     "next_ttft_ms_at_context_lower_bound": None if m["next_ttft_ms"] is None
                     else m["next_ttft_ms"] * args.context / n,
                     "estimated": n < args.context})
    result = {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device),
              "threads": args.threads or torch.get_num_threads(), "context": args.context, "memory_bytes": memory,
              "full_kv_bytes": full_bytes, "budget": args.budget, "rows": rows}
    print(f"{loaded.name} {result['dtype']}, context {args.context} tokens, memory {memory / 2**30:.1f} GiB; "
          f"measured at {n} tokens on {result['device']} ({result['threads']} threads), "
          f"{max(1, args.measure)} session(s) parked per strategy")
    cols = ["strategy", "parked/session", "bytes/token", "sessions", "vs full", f"measured at {n}",
            f"formula at {n}", "RSS growth/session", "resume ms", f"next token ms at {n}",
            f"next token ms at {args.context}" + (" (>=)" if n < args.context else "")]
    body = [[r["strategy"], fmt_bytes(r["parked_bytes"]), f"{r['parked_bytes_per_token']:.1f}", str(r["sessions"]),
             f"{r['capacity_vs_full']:.2f}x", fmt_bytes(r["parked_bytes_measured"]),
             fmt_bytes(r["formula_parked_bytes_at_measure"]), fmt_bytes(r["rss_growth_per_session"]),
             fmt(r["resume_ms"], ".1f"), fmt(r["next_ttft_ms"], ".0f"), fmt(r["next_ttft_ms_at_context_lower_bound"], ".0f")]
            for r in rows]
    print(table(cols, body))
    print("note: parked bytes per session measured by the allocator for each parked session; 'next token' is the "
          "first token of the next turn after resume (what a returning user waits for; rebuild=step rebuilds then)")
    if args.context >= loaded.max_context:
        print(f"note: {args.context} tokens is beyond this model's context of {loaded.max_context}; "
              "the bytes at that context are by formula")
    if n < args.context:
        print(f"note: the next token at {args.context} tokens is extrapolated linearly from {n}: a lower bound "
              "(replayed attention grows faster than linearly)")
    write_json(args.json, result, "capacity")
    return 0


def register(sub):
    common_model = dict(default="smollm2-135m", help="preset name, Hub id or local path")
    p = sub.add_parser("breakeven", help="bytes per token and the break-even anchor spacing, from a config")
    p.add_argument("--model")
    p.add_argument("--config", help="a config.json")
    p.add_argument("--dtype", default="bfloat16", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--context", type=int, default=32768, help="context for the sliding-window view")
    p.add_argument("--max-passes", type=int, default=None, help="replay bound for the DP anchor placement")
    p.add_argument("--json")
    p.set_defaults(func=cmd_breakeven)
    for name, func, helptext in (("replay", cmd_replay, "naive vs cascade reconstruction, timed side by side"),
                                 ("capacity", cmd_capacity, "parked bytes, sessions that fit, resume time")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", **common_model)
        p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
        p.add_argument("--device", default="auto")
        p.add_argument("--threads", type=int, default=None)
        p.add_argument("--json")
        p.set_defaults(func=func)
        if name == "replay":
            p.add_argument("--context", type=int, default=1024)
            p.add_argument("--spacing", type=int, required=True)
        else:
            p.add_argument("--context", type=int, default=32768)
            p.add_argument("--memory-gb", type=float, default=None, help="default: this machine's memory")
            p.add_argument("--measure-context", type=int, default=1024,
                           help="sessions are parked and resumed at min(context, this) tokens; beyond, by formula "
                                "(bytes) and a linear lower bound (time)")
            p.add_argument("--measure", type=int, default=0,
                           help="park this many sessions of each strategy in this process (default: one)")
            p.add_argument("--budget", type=int, default=64, help="hot window of KV-Direct and AnchorKV")
    return sub
