"""What a recompute-vs-read measurement (`recompute.measure`'s JSON) says, without torch: the best speed-up and
where, the bound beside it and a verdict on the paper's 5x (`summary`; the report's claim 4 reads its numbers), and
its plot (`figure`).  `recompute` re-exports both; the claims tab reads a report through this module alone."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from .verdicts import FAILS, HIGHER, HOLDS, SIZE_TOLERANCE, judge

PAPER_SPEEDUP = 5.0
COLOURS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#8B4513", "#7F3C8D"]
FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=16, color="#111")


def _measured(result: dict) -> list[dict]:
    return [r for r in result["rows"] if not r.get("skipped") and r.get("speedup") is not None]


def _where(row: dict | None) -> dict | None:
    return None if row is None else {"batch": row["batch"], "context": row["context"], "tokens": row["tokens"]}


def _x(value: float) -> str:
    return f"{value:.3g}x"


def _threads(result: dict) -> str:
    return f"{result['threads']} thread{'' if result['threads'] == 1 else 's'}"


def summary(result: dict) -> dict:
    """The largest measured speed-up and where, the largest bound, and a verdict on the paper's claim.

    Verdict: the report's one rule (`verdicts.judge`) on the best speed-up, from device memory or from a host
    copy, against the paper's 5x, higher is better, no gain at 1x.
    """
    rows = _measured(result)
    host_rows = [r for r in rows if r.get("host_speedup") is not None]
    best = max(rows, key=lambda r: r["speedup"], default=None)
    best_host = max(host_rows, key=lambda r: r["host_speedup"], default=None)
    bounds = [r["bound_speedup"] for r in result["rows"] if r.get("bound_speedup") is not None]
    host_bounds = [r["host_bound_speedup"] for r in result["rows"] if r.get("host_bound_speedup") is not None]
    where = f"{result['device']} ({result['dtype']}, {_threads(result)}, {result['model']} layer {result['layer']})"
    skipped = len(result["rows"]) - len(rows)
    agree = all((r["speedup"] > 1) == (r["bound_speedup"] > 1) for r in rows)
    out = {
        "best_speedup": None if best is None else best["speedup"],
        "best_at": _where(best),
        "best_host_speedup": None if best_host is None else best_host["host_speedup"],
        "best_host_at": _where(best_host),
        "largest_bound": max(bounds, default=None),
        "largest_host_bound": max(host_bounds, default=None),
        "paper_speedup": PAPER_SPEEDUP,
        "measured_cells": len(rows),
        "skipped_cells": skipped,
        "bound_agrees": agree,
        "cells_above_bound": sum(1 for r in rows if r["speedup"] > r["bound_speedup"]),
    }
    if best is None:
        out.update(
            verdict=FAILS,
            sentence=f"Nothing was measured on {where}: every cell was skipped, so the claim is not supported here.",
        )
        return out
    s, at = best["speedup"], f"b={best['batch']}, n={best['context']}"
    kv_t, res_t = result["kv_bytes_per_token"], result["residual_bytes_per_token"]
    gemm = (
        f"a {result['d']}x{2 * result['kv_heads'] * result['head_dim']} GEMM per token "
        f"({result['flops_per_token']:,} FLOPs, {best['intensity']:.3g} FLOP per residual byte against "
        f"this device's balance of {result['flop_per_byte']:.3g} FLOP/byte)"
    )
    r_words = (
        f"a residual ({res_t} B) is already {'as large as' if res_t == kv_t else 'larger than'} the K/V "
        f"it replaces ({kv_t} B, r = {result['ratio_r']:.3g})"
        if res_t >= kv_t
        else f"a residual is {res_t} B against {kv_t} B of K/V (r = {result['ratio_r']:.3g})"
    )
    bound_words = f"the arithmetic-intensity bound allows at most {_x(out['largest_bound'])} here"
    hs = best_host["host_speedup"] if best_host is not None else None
    verdict = judge(PAPER_SPEEDUP, max(s, hs or s), HIGHER, SIZE_TOLERANCE, 1.0)
    if hs is None or s >= hs:
        if verdict == HOLDS:
            sentence = (
                f"Holds on {where}: recompute is up to {_x(s)} faster than reading cached K/V (at {at}), "
                f"within {SIZE_TOLERANCE:.0%} of the paper's {PAPER_SPEEDUP:g}x or above; {bound_words}."
            )
        elif s > 1:
            sentence = (
                f"Holds in direction, not in size, on {where}: recompute beats reading cached K/V, but only up "
                f"to {_x(s)} (at {at}), below the paper's {PAPER_SPEEDUP:g}x; {bound_words}."
            )
    if hs is not None and hs > s and hs > 1:
        sentence = (
            f"{'Holds' if verdict == HOLDS else 'Holds in direction, not in size,'} on {where}: only with "
            f"K/V held in host memory and copied over the host "
            f"link ({result['host_bytes_per_s'] / 1e9:.3g} GB/s) is recompute faster, up to {_x(hs)} (at "
            f"b={best_host['batch']}, n={best_host['context']}"
            f"{'' if hs >= PAPER_SPEEDUP else f', below the paper’s {PAPER_SPEEDUP:g}x'}); with K/V in "
            + (
                f"device memory reading stays {_x(1 / s)} faster than recomputing, since {r_words} and "
                f"recompute adds {gemm}."
                if s < 1
                else f"device memory recompute reaches {_x(s)}."
            )
        )
    elif max(s, hs or s) <= 1:
        if host_rows:
            tail = (
                f"; even copying K/V from pinned host memory ({result['host_bytes_per_s'] / 1e9:.3g} GB/s) is "
                f"faster, by at least {_x(1 / best_host['host_speedup'])}"
            )
        else:
            tail = (
                "; the claim needs K/V held off the device (host memory over PCIe) — see the host-copy rows "
                "when run on CUDA"
            )
        sentence = (
            f"Does not hold on {where}: recompute is {_x(1 / s)} slower than reading cached K/V even at "
            f"its best cell ({at}), because {r_words} and recompute adds {gemm}, so {bound_words}"
            f"{tail}."
        )
    if not agree:
        sentence = sentence[:-1] + "; note: some cells fall on the other side of 1 from their bound."
    out.update(verdict=verdict, sentence=sentence)
    return out


def figure(result: dict):
    """Speed-up (read / recompute) against tokens (log-log), one line per batch size (dashed: host copy), the
    arithmetic-intensity bound (dotted), the break-even line at 1 and the paper's 5x."""
    rows = _measured(result)
    fig = go.Figure()
    batches = sorted({r["batch"] for r in rows})
    for i, b in enumerate(batches):
        mine = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["tokens"])
        colour = COLOURS[i % len(COLOURS)]
        fig.add_trace(
            go.Scatter(
                x=[r["tokens"] for r in mine],
                y=[r["speedup"] for r in mine],
                mode="lines+markers",
                name=f"batch {b}: device read / recompute",
                line=dict(color=colour, width=3),
                marker=dict(size=10),
                customdata=[[r["context"], r["read_ms"], r["recompute_ms"]] for r in mine],
                hovertemplate="context %{customdata[0]}: read %{customdata[1]:.3g} ms, recompute "
                "%{customdata[2]:.3g} ms, speed-up %{y:.3g}x<extra></extra>",
            )
        )
        host = [r for r in mine if r.get("host_speedup") is not None]
        if host:
            fig.add_trace(
                go.Scatter(
                    x=[r["tokens"] for r in host],
                    y=[r["host_speedup"] for r in host],
                    mode="lines+markers",
                    name=f"batch {b}: host-copy read / recompute",
                    line=dict(color=colour, width=3, dash="dash"),
                    marker=dict(size=10, symbol="diamond-open"),
                )
            )
    tokens = sorted({r["tokens"] for r in result["rows"]})
    xs = [tokens[0], tokens[-1]] if tokens else [1, 1]
    by_tokens = sorted((r for r in result["rows"] if r.get("bound_speedup") is not None), key=lambda r: r["tokens"])
    if by_tokens:
        fig.add_trace(
            go.Scatter(
                x=[r["tokens"] for r in by_tokens],
                y=[r["bound_speedup"] for r in by_tokens],
                mode="lines",
                name="bound: arithmetic intensity (K/V in device memory)",
                meta="bound",
                line=dict(color="#333", width=2, dash="dot"),
            )
        )
    host_bound = [r for r in by_tokens if r.get("host_bound_speedup") is not None]
    if host_bound:
        fig.add_trace(
            go.Scatter(
                x=[r["tokens"] for r in host_bound],
                y=[r["host_bound_speedup"] for r in host_bound],
                mode="lines",
                name="bound: K/V in host memory",
                meta="host_bound",
                line=dict(color="#888", width=2, dash="dot"),
            )
        )
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=[PAPER_SPEEDUP, PAPER_SPEEDUP],
            mode="lines",
            meta="paper",
            name=f"paper: up to {PAPER_SPEEDUP:g}x",
            line=dict(color="#C00000", width=2, dash="dashdot"),
        )
    )
    fig.add_hline(y=1, line=dict(color="#111", width=1.5))
    # On a log axis an annotation's y is log10 of the value: 0 is the break-even line at 1.
    fig.add_annotation(
        text="recompute wins above",
        xref="paper",
        x=0.005,
        xanchor="left",
        yref="y",
        y=0,
        yanchor="bottom",
        showarrow=False,
        font=dict(size=15, color="#111"),
    )
    values = (
        [v for r in rows for v in (r["speedup"], r.get("host_speedup")) if v]
        + [v for r in result["rows"] for v in (r.get("bound_speedup"), r.get("host_bound_speedup")) if v]
        + [PAPER_SPEEDUP, 1.0]
    )
    low, high = math.log10(min(values)) - 0.15, math.log10(max(values)) + 0.15
    ticks = sorted({10.0**p for p in range(math.floor(low), math.ceil(high) + 1)} | {PAPER_SPEEDUP})
    ticks = [t for t in ticks if low <= math.log10(t) <= high]
    fig.update_xaxes(type="log", title_text="tokens whose K/V one layer needs (batch × context)")
    fig.update_yaxes(
        type="log",
        range=[low, high],
        tickmode="array",
        tickvals=ticks,
        ticktext=[f"{t:g}x" for t in ticks],
        minor=dict(showgrid=False),
        title_text="speed-up: read time ÷ recompute time",
    )
    title = (
        f"Recompute K/V vs read cached K/V: {result['model']} layer {result['layer']}, "
        f"{result['device']}, {result['dtype']}, {_threads(result)}"
    )
    fig.update_layout(
        template="plotly_white",
        font=FONT,
        height=560,
        title=dict(text=title, x=0.01, y=0.98, yanchor="top", font=dict(size=20)),
        margin=dict(l=80, r=30, t=80, b=40),
        hoverlabel=dict(font_size=14),
        legend=dict(orientation="h", yanchor="top", y=-0.2, x=0, font=dict(size=14)),
    )
    skipped = [r for r in result["rows"] if r.get("skipped")]
    if skipped:
        fig.add_annotation(
            text=f"{len(skipped)} cell(s) skipped (memory cap)",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=1,
            y=1.02,
            xanchor="right",
            font=dict(size=14, color="#555"),
        )
    return fig
