"""AnchorKV benchmarks: `breakeven`, `capacity` and `replay` subcommands of `python -m kvdirect_app.bench`.

bench breakeven (--model NAME | --config PATH) [--dtype bfloat16|float32] [--json OUT]
bench capacity --model NAME --context 32768 [--memory-gb G] [--json OUT]
bench replay --model NAME --context N --spacing s [--json OUT]
"""

from __future__ import annotations

from ..benchmarks.api import BreakevenConfig, CapacityConfig, ReplayConfig, breakeven, capacity, replay
from ..models.loading import DTYPES
from ..plain.units import fmt, fmt_bytes, table
from .common import THREADS, TOKENS, whole, write_json


def _kib(n: float) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 1024:.2f} KiB" if n >= 1024 else f"{n:.0f} B"


# --- breakeven -----------------------------------------------------------------
def cmd_breakeven(args) -> int:
    report = breakeven(BreakevenConfig.from_args(args))
    print(
        f"{report['source']} ({args.dtype}): L={report['layers']} d={report['hidden_size']} "
        f"n_kv={report['num_kv_heads']} d_h={report['head_dim']}"
    )
    print(f"  full KV per token (every layer global): {_kib(report['kv_bytes_per_token'])}")
    print(f"  residual per stored layer:              {_kib(report['residual_bytes_per_layer'])}")
    print(
        f"  r = d / (2 n_kv d_h) = {report['ratio_r']:.3g}"
        + ("  (> 1: a residual at every layer costs more than its K/V)" if report["ratio_r"] > 1 else "")
    )
    print(
        f"  break-even spacing s* = {report['break_even_spacing']}  "
        f"(layer 0 as a token id: {report['break_even_spacing_token_id_anchor']})"
    )
    print(
        f"\n  {'s':>3}  {'anchors':>7}  {'bytes/token':>12}  {'token-id anchor':>15}  {'vs full KV':>10}  "
        f"{'cascade':>7}  {'naive':>6}"
    )
    for row in report["per_spacing"]:
        ratio = row["anchor_bytes_per_token_token_id_anchor"] / report["kv_bytes_per_token"]
        print(
            f"  {row['spacing']:>3}  {len(row['anchors']):>7}  {_kib(row['anchor_bytes_per_token']):>12}  "
            f"{_kib(row['anchor_bytes_per_token_token_id_anchor']):>15}  {ratio:>10.3f}  "
            f"{row['cascade_passes']:>7}  {row['naive_passes']:>6}"
        )
    windowed = report.get("windowed")
    if windowed:
        dp = windowed["dp_placement"]
        print(
            f"\n  sliding-window view at {windowed['context']} tokens: global layers {report['global_layers']}, "
            f"global KV {_kib(windowed['global_kv_bytes_per_token'])}/token, windows "
            f"{_kib(windowed['window_bytes_per_session'])}/session"
        )
        print(
            f"  break-even counting global layers only: s* = {windowed['break_even_spacing_global_only']} "
            f"(token-id anchor: {windowed['break_even_spacing_global_only_token_id_anchor']})"
        )
        print(
            f"  DP placement (bound {dp['max_passes']}): anchors {dp['anchors']}, {_kib(dp['bytes_per_token'])}/token, "
            f"{dp['cascade_passes']} passes"
        )
        print(f"\n  {'s':>3}  {'uniform bytes':>13}  {'passes':>6}  {'DP at same passes':>17}  DP anchors")
        for row in windowed["uniform"]:
            print(
                f"  {row['spacing']:>3}  {_kib(row['bytes_per_token']):>13}  {row['cascade_passes']:>6}  "
                f"{_kib(row['dp_bytes_per_token']):>17}  {row['dp_anchors']}"
            )
    write_json(args.json, report, "breakeven")
    return 0


# --- replay ---------------------------------------------------------------------------
def cmd_replay(args) -> int:
    result = replay(ReplayConfig.from_args(args))
    rows, anchors, speedup, ideal = result["replay"], result["anchors"], result["speedup"], result["ideal_pass_ratio"]
    print(
        f"{result['model']} {result['dtype']} on {result['device']}, {args.context} tokens, spacing {args.spacing} "
        f"(anchors {anchors}), threads {result['threads']}"
    )
    print(f"  {'replay':<8} {'seconds':>8} {'layer passes':>12} {'layer calls':>11}  K/V exact")
    for kind, row in rows.items():
        print(
            f"  {kind:<8} {row['seconds']:>8.2f} {row['layer_passes']:>12} {row['layer_calls']:>11}  "
            f"{'yes' if row['kv_exact'] else 'NO'}"
        )
    print(f"  cascade speedup {speedup:.2f}x; ideal (pass ratio) {ideal:.2f}x; achieved {speedup / ideal:.2f} of ideal")
    write_json(args.json, result, "replay")
    return 0


# --- capacity -------------------------------------------------------------------------
def cmd_capacity(args) -> int:
    result = capacity(CapacityConfig.from_args(args))
    rows, memory, n = result["rows"], result["memory_bytes"], result["rows"][0]["measured_at"]
    print(
        f"{result['model']} {result['dtype']}, context {args.context} tokens, memory {memory / 2**30:.1f} GiB; "
        f"measured at {n} tokens on {result['device']} ({result['threads']} threads), "
        f"{max(1, args.measure)} session(s) parked per strategy"
    )
    cols = [
        "strategy",
        "parked/session",
        "bytes/token",
        "sessions",
        "vs full",
        f"measured at {n}",
        f"formula at {n}",
        "RSS growth/session",
        "resume ms",
        f"next token ms at {n}",
        f"next token ms at {args.context}" + (" (>=)" if n < args.context else ""),
    ]
    body = [
        [
            r["strategy"],
            fmt_bytes(r["parked_bytes"]),
            f"{r['parked_bytes_per_token']:.1f}",
            str(r["sessions"]),
            f"{r['capacity_vs_full']:.2f}x",
            fmt_bytes(r["parked_bytes_measured"]),
            fmt_bytes(r["formula_parked_bytes_at_measure"]),
            fmt_bytes(r["rss_growth_per_session"]),
            fmt(r["resume_ms"], ".1f"),
            fmt(r["next_ttft_ms"], ".0f"),
            fmt(r["next_ttft_ms_at_context_lower_bound"], ".0f"),
        ]
        for r in rows
    ]
    print(table(cols, body))
    print(
        "note: parked bytes per session measured by the allocator for each parked session; 'next token' is the "
        "first token of the next turn after resume (what a returning user waits for; rebuild=step rebuilds then)"
    )
    if args.context >= result["max_context"]:
        print(
            f"note: {args.context} tokens is beyond this model's context of {result['max_context']}; "
            "the bytes at that context are by formula"
        )
    if n < args.context:
        print(
            f"note: the next token at {args.context} tokens is extrapolated linearly from {n}: a lower bound "
            "(replayed attention grows faster than linearly)"
        )
    write_json(args.json, result, "capacity")
    return 0


def register(sub):
    common_model = dict(default="smollm2-135m", help="preset name, Hub id or local path")
    p = sub.add_parser("breakeven", help="bytes per token and the break-even anchor spacing, from a config")
    p.add_argument("--model")
    p.add_argument("--config", help="a config.json")
    p.add_argument("--dtype", default="bfloat16", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--context", type=TOKENS, default=32768, help="context for the sliding-window view")
    p.add_argument(
        "--max-passes",
        type=whole(1, None, "layer passes"),
        default=None,
        help="replay bound for the DP anchor placement",
    )
    p.add_argument("--json")
    p.set_defaults(func=cmd_breakeven)
    for name, func, helptext in (
        ("replay", cmd_replay, "naive vs cascade reconstruction, timed side by side"),
        ("capacity", cmd_capacity, "parked bytes, sessions that fit, resume time"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", **common_model)
        p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
        p.add_argument("--device", default="auto")
        p.add_argument("--threads", type=THREADS, default=None)
        p.add_argument("--json")
        p.set_defaults(func=func)
        if name == "replay":
            p.add_argument("--context", type=TOKENS, default=1024)
            p.add_argument("--spacing", type=whole(1, None, "layers between anchors"), required=True)
        else:
            p.add_argument("--context", type=TOKENS, default=32768)
            p.add_argument("--memory-gb", type=float, default=None, help="default: this machine's memory")
            p.add_argument(
                "--measure-context",
                type=TOKENS,
                default=1024,
                help="sessions are parked and resumed at min(context, this) tokens; beyond, by formula "
                "(bytes) and a linear lower bound (time)",
            )
            p.add_argument(
                "--measure",
                type=whole(0, None, "sessions"),
                default=0,
                help="park this many sessions of each strategy in this process (default: one)",
            )
            p.add_argument("--budget", type=TOKENS, default=64, help="hot window of KV-Direct and AnchorKV")
    return sub
