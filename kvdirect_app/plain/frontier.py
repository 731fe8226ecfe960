"""The trade-off frontier: measured peak memory against token agreement with the full cache, one point per
strategy and setting, marker size for ms per token, the Pareto front drawn (plotly; no torch).

A point is Pareto-optimal when no other point reaches at least its agreement with a lower peak.  Written by
`bench sweep --plot` (HTML with plotly.js inlined, so it opens offline; PNG through kaleido, which needs a
Chromium) and drawn in the app's Frontier tab.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from .palette import base_colour, strategy_name
from .png import write_png
from .units import fmt_bytes

FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=16, color="#111")


@dataclass(frozen=True)
class Point:
    spec: str
    peak_bytes: int
    agreement: float  # token match with the full cache's free run
    ms_per_token: float | None
    teacher_forced: float | None = None
    between_bytes: int | None = None
    instrument: str = "allocator trace"  # what measured the peak (`state_bytes.instrument`)
    axis: str = "peak"  # which bytes: the peak during a turn, or those held after it (`HELD`)


def points_from_rows(rows: list[dict]) -> list[Point]:
    """Sweep rows (bench JSON per strategy and setting) with a measured peak -> points."""
    out = []
    for r in rows:
        peak = r["state_bytes"]["peak"]
        if peak is None or r["token_match"] is None:
            continue
        out.append(
            Point(
                r.get("spec") or r["canonical_spec"],
                peak,
                r["token_match"],
                r["latency_ms"]["decode_total_ms_mean"],
                r["teacher_forced_agreement"],
                r["state_bytes"]["between_turns_peak"],
                r["state_bytes"].get("instrument") or "allocator trace",
            )
        )
    return out


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point beats: lower or equal peak with higher agreement (ties: the cheaper)."""
    front, best = [], -1.0
    for p in sorted(points, key=lambda p: (p.peak_bytes, -p.agreement)):
        if p.agreement > best:
            front.append(p)
            best = p.agreement
    return front


def _byte_ticks(values: list[int]) -> list[int]:
    """Powers of two (in bytes) spanning the values, at most about eight of them."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    ticks = [2**k for k in range(max(0, lo.bit_length() - 2), hi.bit_length() + 1)]
    step = max(1, len(ticks) // 8)
    return ticks[::step]


def _size(ms: float | None, lo: float, hi: float) -> float:
    if ms is None:
        return 10
    if hi <= lo:
        return 18
    return 10 + 26 * (ms - lo) / (hi - lo)


AGREEMENT = "token match with the full cache"
HELD = "held"  # a point's bytes are what its cache holds after the turn (the task-score frontier)
TASK_SCORE = "task score"  # `bench tasks`: the share of references found in the answers


def frontier_figure(
    points: list[Point],
    title: str = "Memory against agreement: the trade-off frontier",
    subtitle: str = "",
    axis: str = AGREEMENT,
    reference: float | None = None,
) -> go.Figure:
    """`axis`: what a point's `agreement` is (token match, or a task score); `reference`: the full cache's value
    on that axis, drawn as a line (a task's ceiling)."""
    fig = go.Figure()
    if not points:
        fig.add_annotation(
            text="Run a sweep: each strategy and setting becomes a point here",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.5,
            font=dict(size=18, color="#555"),
        )
    speeds = [p.ms_per_token for p in points if p.ms_per_token is not None]
    lo, hi = (min(speeds), max(speeds)) if speeds else (0, 0)
    front = pareto(points)
    if front:
        fig.add_trace(
            go.Scatter(
                x=[p.peak_bytes for p in front],
                y=[100 * p.agreement for p in front],
                mode="lines",
                line=dict(color="#999", width=2, dash="dot", shape="hv"),
                name="Pareto front",
                hoverinfo="skip",
            )
        )
    for name in dict.fromkeys(strategy_name(p.spec) for p in points):
        mine = [p for p in points if strategy_name(p.spec) == name]
        fig.add_trace(
            go.Scatter(
                x=[p.peak_bytes for p in mine],
                y=[100 * p.agreement for p in mine],
                mode="markers",
                name=name,
                marker=dict(
                    color=base_colour(name),
                    size=[_size(p.ms_per_token, lo, hi) for p in mine],
                    line=dict(color=["#000" if p in front else "#fff" for p in mine], width=2),
                    opacity=0.9,
                ),
                customdata=[
                    [
                        p.spec,
                        fmt_bytes(p.peak_bytes),
                        "-" if p.ms_per_token is None else f"{p.ms_per_token:.1f}",
                        "-" if p.teacher_forced is None else f"{100 * p.teacher_forced:.1f}",
                        fmt_bytes(p.between_bytes),
                    ]
                    for p in mine
                ],
                hovertemplate=(
                    "%{customdata[0]}<br>held after the turn %{customdata[1]}"
                    if mine[0].axis == HELD
                    else "%{customdata[0]}<br>peak %{customdata[1]} · between turns %{customdata[4]}"
                )
                + f"<br>{axis} %{{y:.1f}}% · teacher-forced %{{customdata[3]}}%"
                "<br>%{customdata[2]} ms per token<extra></extra>",
            )
        )
    ticks = _byte_ticks([p.peak_bytes for p in points])
    by = "; ".join(dict.fromkeys(p.instrument.split(" (")[0] for p in points)) or "allocator trace"
    what = "bytes held after the turn" if points and all(p.axis == HELD for p in points) else "peak bytes during a turn"
    fig.update_xaxes(
        type="log",
        title_text=f"measured {what} (log scale; {by})",
        tickvals=ticks,
        ticktext=[fmt_bytes(t) for t in ticks],
    )
    fig.update_yaxes(title_text=f"{axis} (%)", range=[-3, 103])
    if reference is not None:
        fig.add_hline(
            y=100 * reference,
            line=dict(color="#333", dash="dash", width=1.5),
            annotation_text=f"full cache {100 * reference:.0f}%",
            annotation_position="bottom right",
        )
    # The caption stands in the title block, above the plot area: drawn inside it, it covered the top row of markers.
    caption = ("marker size: ms per token (bigger is slower) · " if speeds else "") + "outlined: on the Pareto front"
    text = title + (f"<br><sup>{subtitle}</sup>" if subtitle else "") + f"<br><sup>{caption}</sup>"
    fig.update_layout(
        template="plotly_white",
        font=FONT,
        height=560,
        title=dict(text=text, x=0.01, font=dict(size=20)),
        margin=dict(l=80, r=30, t=115, b=70),
        legend=dict(orientation="h", y=-0.18, x=0),
        hoverlabel=dict(font_size=14),
    )
    return fig


def write_frontier(fig: go.Figure, prefix: str) -> tuple[str, str | None, str | None]:
    """Writes PREFIX.html (plotly.js inlined) and PREFIX.png; returns their paths and, when the PNG cannot be
    made here, why (kaleido needs a Chromium: `apt-get install chromium`, or `make test` installs it)."""
    html = f"{prefix}.html"
    fig.write_html(html, include_plotlyjs=True, full_html=True)
    png = f"{prefix}.png"
    try:
        write_png(fig, png, width=1280, height=640)
    except Exception as e:  # kaleido missing, or no browser for it: the HTML stands, and the reason is printed
        return html, None, f"PNG not written: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return html, png, None
