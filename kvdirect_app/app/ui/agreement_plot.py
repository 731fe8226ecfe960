"""The Time & agreement tab's agreement figure: who diverged from the full cache and when, and the mean
teacher-forced KL to it."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...plain.palette import colours
from .plot_style import empty_figure, laid_out, short_name
from .session import Session


def divergence_step(session: Session, label: str) -> int | None:
    """The decode step at which a strategy first produced another token than the full cache (None: never)."""
    for row in session.lanes[label].agreement:
        if row["match"] < 1.0:
            return row["step"]
    return None


def agreement_figure(session: Session) -> go.Figure:
    """Who diverged when: one strip per strategy over the decode steps (solid while its tokens equal the full
    cache's, a marker where it first differs, thin after), and mean teacher-forced KL on a log axis below (KL
    spans decades: a window far above, the exact strategies at 0, drawn on the axis floor)."""
    labels = [label for label in session.shown if session.lanes[label].agreement]
    if not labels:
        return empty_figure(
            "Send a message or play a scenario: who diverged from the full cache, and when, appears here",
            480,
            "Do the strategies change the output?",
        )
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12,
        row_heights=[0.55, 0.45],
        subplot_titles=("same tokens as the full cache until ✕", "mean KL to the full cache (log)"),
    )
    palette = colours(session.shown)
    positive = [r["kl"] for label in labels for r in session.lanes[label].agreement if (r["kl"] or 0) > 0]
    floor = 10 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1e-6
    names = [short_name(session, label) for label in labels]
    for label, name in zip(labels, names):
        rows, c = session.lanes[label].agreement, palette[label]
        lane = session.lanes[label]
        first, last = rows[0]["step"], rows[-1]["step"]
        split = divergence_step(session, label)
        same_until = last if split is None else split
        fig.add_trace(
            go.Scatter(
                x=[first, same_until],
                y=[name, name],
                mode="lines",
                legendgroup=label,
                name=name,
                line=dict(color=c, width=12),
                showlegend=False,
                hovertemplate=f"{label}<br>same tokens as the full cache up to step {same_until}<extra></extra>",
            ),
            row=1,
            col=1,
        )
        if split is not None:
            turn, index = lane.divergence
            fig.add_trace(
                go.Scatter(
                    x=[split, last],
                    y=[name, name],
                    mode="lines",
                    legendgroup=label,
                    showlegend=False,
                    line=dict(color=c, width=2, dash="dot"),
                    hovertemplate=f"{label}<br>after its first divergence: match "
                    f"{100 * lane.match:.0f}% of the full cache's tokens"
                    "<extra></extra>",
                ),
                row=1,
                col=1,
            )
            fig.add_trace(
                go.Scatter(
                    x=[split],
                    y=[name],
                    mode="markers+text",
                    legendgroup=label,
                    showlegend=False,
                    marker=dict(symbol="x-thin", size=22, line=dict(width=4, color="#c0392b")),
                    text=[f" turn {turn + 1}, token {index + 1}"],
                    textposition="middle right",
                    textfont=dict(size=13, color="#c0392b"),
                    hovertemplate=f"{label}<br>first differs at step {split}: turn {turn + 1}, "
                    f"token {index + 1}<extra></extra>",
                ),
                row=1,
                col=1,
            )
        else:
            fig.add_trace(
                go.Scatter(
                    x=[last],
                    y=[name],
                    mode="markers+text",
                    legendgroup=label,
                    showlegend=False,
                    marker=dict(symbol="circle", size=12, color=c),
                    text=[" ✓ all tokens"],
                    textposition="middle right",
                    textfont=dict(size=13, color="#1e8449"),
                    hovertemplate=f"{label}<br>every token equals the full cache's<extra></extra>",
                ),
                row=1,
                col=1,
            )
        fig.add_trace(
            go.Scatter(
                x=[r["step"] for r in rows],
                # (None: a joined pane's replayed steps, where no reference logits were kept: a gap)
                y=[None if r["kl"] is None else r["kl"] if r["kl"] > 0 else floor for r in rows],
                legendgroup=label,
                name=name,
                line=dict(color=c, width=2),
                mode="lines",
                customdata=[
                    "not measured (replayed when the pane joined)"
                    if r["kl"] is None
                    else f"{r['kl']:.3g}"
                    if r["kl"] > 0
                    else "0 (exact)"
                    for r in rows
                ],
                hovertemplate=f"{label}<br>KL %{{customdata}}<extra></extra>",
            ),
            row=2,
            col=1,
        )
    fig.add_hline(y=floor, row=2, col=1, line=dict(color="#999", width=1, dash="dot"))
    # An annotation on a log axis takes log10 of its y.
    fig.add_annotation(
        text="KL 0 (exact) drawn here",
        x=0,
        xref="x2 domain",
        y=math.log10(floor),
        yref="y2",
        xanchor="left",
        yanchor="bottom",
        showarrow=False,
        font=dict(color="#555"),
    )
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=list(reversed(names)), row=1, col=1)
    fig.update_yaxes(
        type="log",
        exponentformat="power",
        row=2,
        col=1,
        range=[math.log10(floor) - 0.2, math.log10(max(positive, default=floor)) + 0.5],
    )
    fig.update_xaxes(title_text="decode step (all turns)", row=2, col=1)
    steps = max(session.lanes[label].agreement[-1]["step"] for label in labels)
    fig.update_xaxes(range=[0, steps * 1.22])  # room for the words at the end of each strip
    fig = laid_out(fig, max(480, 260 + 30 * len(labels)), "Do the strategies change the output?", session)
    fig.update_annotations(font=dict(size=15))
    return fig
