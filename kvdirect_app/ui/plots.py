"""The live figures (plotly): state bytes, per-op latency, agreement with the full cache."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..palette import colours
from .session import Session
from .settings import REFERENCE, title

FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=16, color="#111")
OP_COLOURS = {"recompute": "#0072B2", "replay": "#56B4E9", "scoring": "#CC79A7", "attention": "#E69F00",
              "cache_update": "#009E73", "shared": "#BBBBBB", "other": "#999999"}
OP_ORDER = list(OP_COLOURS)


def _scale(values: list[float]) -> tuple[float, str]:
    top = max(values, default=0)
    if top >= 2**30:
        return 2**30, "GiB"
    if top >= 2**20:
        return 2**20, "MiB"
    return 2**10, "KiB"


def _layout(fig: go.Figure, height: int, title_text: str) -> go.Figure:
    fig.update_layout(
        template="plotly_white", font=FONT, height=height, title=dict(text=title_text, x=0.01, y=0.98, yanchor="top", font=dict(size=20)),
        margin=dict(l=70, r=30, t=80, b=40), legend=dict(orientation="h", yanchor="top", y=-0.18, x=0,
                                                         font=dict(size=14)),
        hoverlabel=dict(font_size=14),
    )
    return fig


def _empty(fig: go.Figure, message: str):
    fig.add_annotation(text=message, showarrow=False, font=dict(size=18, color="#555"), xref="paper", yref="paper",
                       x=0.5, y=0.5)


def memory_figure(session: Session) -> go.Figure:
    """Per strategy against tokens processed: state held after each step and the peak within it, both measured
    by the allocator (solid, dotted), and the state by formula (dashed); process RSS on the right."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    palette = colours(session.shown)
    all_bytes = [row[k] for label in session.shown for row in session.lanes[label].memory
                 for k in ("persistent", "peak", "formula") if row[k] is not None]
    unit, unit_name = _scale(all_bytes)
    measured = any(row["persistent"] is not None for label in session.shown for row in session.lanes[label].memory)
    for label in session.shown:
        rows, c = session.lanes[label].memory, palette[label]
        x = [r["seen"] for r in rows]
        name = title(label) if label == REFERENCE else label
        main = "persistent" if measured else "formula"
        fig.add_trace(go.Scatter(x=x, y=[r[main] / unit for r in rows], name=name, legendgroup=label,
                                 line=dict(color=c, width=3), mode="lines",
                                 hovertemplate=f"{label}<br>state %{{y:.3f}} {unit_name}<br>tokens %{{x}}<extra></extra>"))
        if measured:
            fig.add_trace(go.Scatter(x=x, y=[None if r["peak"] is None else r["peak"] / unit for r in rows],
                                     legendgroup=label, showlegend=False, line=dict(color=c, width=1.5, dash="dot"),
                                     mode="lines", hovertemplate=f"{label}<br>peak %{{y:.3f}} {unit_name}<extra></extra>"))
            fig.add_trace(go.Scatter(x=x, y=[r["formula"] / unit for r in rows], legendgroup=label, showlegend=False,
                                     line=dict(color=c, width=1.2, dash="dash"), mode="lines", opacity=0.7,
                                     hovertemplate=f"{label}<br>formula %{{y:.3f}} {unit_name}<extra></extra>"))
    if session.rss:
        fig.add_trace(go.Scatter(x=[r["seen"] for r in session.rss], y=[r["rss"] / 2**20 for r in session.rss],
                                 name="process RSS (right axis)", line=dict(color="#888", width=2, dash="longdashdot"),
                                 mode="lines", hovertemplate="process RSS %{y:.0f} MiB<extra></extra>"),
                      secondary_y=True)
    styles = ((("state after a step (allocator)", "solid", 3), ("peak within a step (allocator)", "dot", 1.5),
               ("state by formula (config only)", "dash", 1.2)) if measured else
              (("state by formula (allocator tracing off)", "solid", 3),))
    for name, dash, width in styles:
        fig.add_trace(go.Scatter(x=[None], y=[None], name=name, mode="lines", legendgroup="styles",
                                 line=dict(color="#000", dash=dash, width=width)))
    if not session.shown:
        _empty(fig, "Send a message: each strategy's state bytes appear here as tokens are processed")
    fig.update_xaxes(title_text="tokens processed (prompt + replies, all turns)")
    fig.update_yaxes(title_text=f"strategy state ({unit_name})", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="process RSS (MiB)", rangemode="tozero", showgrid=False, secondary_y=True)
    return _layout(fig, 480, "State memory per strategy")


def latency_figure(session: Session) -> go.Figure:
    """Mean ms per decode step, stacked by op, per strategy; decode tokens/s written at the end of each bar."""
    fig = go.Figure()
    labels = [label for label in session.shown if session.lanes[label].latency]
    means = {label: session.lanes[label].op_means() for label in labels}
    ops = [op for op in OP_ORDER if any(op in m for m in means.values())]
    ops += sorted({op for m in means.values() for op in m} - set(ops))
    names = list(reversed(labels))  # first strategy on top
    for op in ops:
        fig.add_trace(go.Bar(y=names, x=[means[label].get(op, 0.0) for label in names], name=op.replace("_", " "),
                             orientation="h", marker_color=OP_COLOURS.get(op, "#bbbbbb"),
                             hovertemplate=f"%{{y}}<br>{op} %{{x:.2f}} ms<extra></extra>"))
    totals = [sum(means[label].values()) for label in names]
    rates = [session.lanes[label].tokens_per_s() for label in names]
    fig.add_trace(go.Scatter(y=names, x=totals, mode="text", showlegend=False, textposition="middle right",
                             text=[f"  {r:.1f} tok/s" if r else "" for r in rates], textfont=dict(size=15),
                             hoverinfo="skip"))
    fig.update_layout(barmode="stack")
    batched = any(op == "shared" for op in ops)
    fig.update_xaxes(title_text="ms per decode step (mean), by op" + (
        "; 'shared': 1/N of the pass all N lanes make together (projections, MLP)" if batched else ""),
        range=[0, 1.5 * max(totals, default=1)])
    if not labels:
        _empty(fig, "Per-op timings appear after the first decode step")
    return _layout(fig, max(380, 130 + 44 * len(labels)),
                   "Per-op latency and tokens/s" + (" (lanes batched: own work + a share of the pass)" if batched else ""))


def agreement_figure(session: Session) -> go.Figure:
    """Running token match with the full cache, and mean teacher-forced KL, per strategy."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.6, 0.4],
                        subplot_titles=("token match with the full cache (%)", "mean KL to the full cache (nats)"))
    palette = colours(session.shown)
    for label in session.shown:
        rows = session.lanes[label].agreement
        x = [r["step"] for r in rows]
        fig.add_trace(go.Scatter(x=x, y=[100 * r["match"] for r in rows], name=label, legendgroup=label,
                                 line=dict(color=palette[label], width=3), mode="lines",
                                 hovertemplate=f"{label}<br>match %{{y:.1f}}%<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=[r["kl"] for r in rows], legendgroup=label, showlegend=False,
                                 line=dict(color=palette[label], width=2), mode="lines",
                                 hovertemplate=f"{label}<br>KL %{{y:.3g}}<extra></extra>"), row=2, col=1)
    if not session.shown:
        _empty(fig, "Token match and KL against the full cache appear here")
    fig.update_yaxes(range=[-3, 103], row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="decode step (all turns)", row=2, col=1)
    fig = _layout(fig, 480, "Do the strategies change the output?")
    fig.update_annotations(font=dict(size=15))
    return fig


def all_figures(session: Session) -> dict[str, go.Figure]:
    return {"memory": memory_figure(session), "latency": latency_figure(session),
            "agreement": agreement_figure(session)}
