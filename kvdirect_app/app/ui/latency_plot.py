"""The Time & agreement tab's latency figure: each strategy's own ms per decode step, stacked by op, with the
instruments' share, the unattributed rest and the roofline of the shared pass."""

from __future__ import annotations

import plotly.graph_objects as go

from .plot_style import empty_figure, laid_out, short_name
from .session import Session

# The shared pass's share first: the part every pane pays alike lines up on the left (with the roofline's line
# against it), each pane's own work after it.
OP_COLOURS = {
    "shared": "#BBBBBB",
    "recompute": "#0072B2",
    "replay": "#56B4E9",
    "scoring": "#CC79A7",
    "attention": "#E69F00",
    "cache_update": "#009E73",
    "other": "#999999",
}
OP_ORDER = list(OP_COLOURS)
MEASURE_COLOURS = ["#6B7280", "#9CA3AF", "#4B5563", "#D1D5DB", "#374151", "#E5E7EB", "#1F2937", "#F3F4F6"]


def latency_figure(session: Session) -> go.Figure:
    """Mean ms per decode step, stacked by op, per strategy, its own total at the end of each bar; the step's wall
    time and the rate every pane streamed at (the same for all, in lockstep) under them."""
    labels = [label for label in session.shown if session.lanes[label].latency]
    if not labels:
        return empty_figure(
            "Send a message or play a scenario: per-op timings appear after the first decode step",
            380,
            "Own ms per decode step, by part",
        )
    fig = go.Figure()
    steps = session.step_means()
    # The turn the scoreboard shows (the current, or last): the same steps, so the same own ms per pane.
    turn = session.step_times[-1]["turn"] if session.step_times else None
    means = {label: session.lanes[label].op_means(turn, steps["steps"] if steps else None) for label in labels}
    ops = [op for op in OP_ORDER if any(op in m for m in means.values())]
    ops += sorted({op for m in means.values() for op in m} - set(ops))
    names = [short_name(session, label) for label in reversed(labels)]  # first strategy on top
    by_name = dict(zip(names, reversed(labels)))
    for op in ops:
        fig.add_trace(
            go.Bar(
                y=names,
                x=[means[by_name[n]].get(op, 0.0) for n in names],
                name=op.replace("_", " "),
                orientation="h",
                marker_color=OP_COLOURS.get(op, "#bbbbbb"),
                hovertemplate=f"%{{y}}<br>{op} %{{x:.2f}} ms<extra></extra>",
            )
        )
    totals = [sum(means[by_name[n]].values()) for n in names]
    fig.add_trace(
        go.Scatter(
            y=names,
            x=totals,
            mode="text",
            showlegend=False,
            textposition="middle right",
            text=[f"  {t:.0f} ms own" for t in totals],
            textfont=dict(size=15),
            hoverinfo="skip",
        )
    )
    if steps is not None:  # the instruments' own bar, and the rest that is nobody's: never inside a pane's
        for k, (name, ms) in enumerate(sorted(steps["measurement"].items())):
            fig.add_trace(
                go.Bar(
                    y=["measurement"],
                    x=[ms],
                    name=name,
                    orientation="h",
                    showlegend=False,
                    marker_color=MEASURE_COLOURS[k % len(MEASURE_COLOURS)],
                    text=[name],
                    textposition="inside",
                    insidetextanchor="middle",
                    textangle=0,
                    textfont=dict(color="white"),
                    hovertemplate=f"instrument {name} %{{x:.2f}} ms per step<extra></extra>",
                )
            )
        fig.add_trace(
            go.Bar(
                y=["unattributed"],
                x=[steps.get("engine", 0.0)],
                name="engine",
                orientation="h",
                showlegend=False,
                marker_color="#BBBBBB",
                hovertemplate="the engine's own (choosing tokens, detokenising, events) %{x:.2f} ms<extra></extra>",
            )
        )
        fig.add_trace(
            go.Bar(
                y=["unattributed"],
                x=[steps["unattributed"]],
                name="unattributed",
                orientation="h",
                showlegend=False,
                marker_color="#DDDDDD",
                hovertemplate="no clock covered it %{x:.2f} ms<extra></extra>",
            )
        )
        measured = sum(steps["measurement"].values())
        fig.add_trace(
            go.Scatter(
                y=["measurement", "unattributed"],
                x=[measured, steps.get("engine", 0.0) + max(0.0, steps["unattributed"])],
                mode="text",
                showlegend=False,
                textposition="middle right",
                hoverinfo="skip",
                text=[
                    f"  {measured:.0f} ms",
                    f"  step {steps['wall']:.0f} ms"
                    + ("" if session.seen_rate() is None else f"; every pane streamed {session.seen_rate():.1f} tok/s"),
                ],
                textfont=dict(size=15),
            )
        )
        fig.update_yaxes(categoryorder="array", categoryarray=["unattributed", "measurement", *names])
        fig.update_layout(uniformtext_minsize=11, uniformtext_mode="hide")  # a name only where it fits
        totals.append(measured)
    roof = session.roofline
    if roof is not None and "shared" in ops and session.recording is None:
        # Each pane's share of the shared pass (the first, grey part of its bar) against its share of the best the
        # machine allows that pass's linears: the roofline measured here, over the same rows.
        share = roof["best_ms"] / roof["rows"]
        fig.add_vline(
            x=share,
            line_dash="dot",
            line_color="#111",
            line_width=2,
            annotation_text=f"roofline {share:.1f} ms a pane",
            annotation_position="top",
            annotation_font_size=14,
        )
        fig.add_trace(
            go.Scatter(
                x=[share],
                y=[names[0]],
                mode="markers",
                marker=dict(opacity=0),
                showlegend=False,
                hovertemplate=(
                    f"the best this machine allows the shared pass's linears over "
                    f"{roof['rows']} rows: {roof['best_ms']:.1f} ms ({roof['bound']}-bound: "
                    f"{roof['bandwidth_gbs']:.0f} GB/s, {roof['gemm_gflops']:.0f} GFLOP/s; "
                    "bench roofline), per pane<extra></extra>"
                ),
            )
        )
    fig.update_layout(barmode="stack")
    which = (
        "every turn's decode steps (a recording without step times)"
        if steps is None
        else f"the {steps['steps']} decode steps of turn {turn + 1}, as on the scoreboard"
    )
    fig.update_xaxes(title_text=f"ms per decode step: mean of {which}", range=[0, 1.5 * max(totals, default=1)])
    return laid_out(
        fig, max(380, 130 + 44 * (len(labels) + 2 * (steps is not None))), "Own ms per decode step, by part", session
    )
