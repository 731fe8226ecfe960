"""The Chat tab's memory figure: the state each strategy holds after every step (and its peak) against the
conversation position, measured and by formula, with the process's RSS beside it."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...plain.palette import colours
from .plot_style import POSITION_AXIS, byte_axis, empty_figure, laid_out, line_marker, short_name
from .session import Session
from .settings import REFERENCE


def _shared(session: Session, labels: list[str], key: str) -> dict[tuple, list[str]]:
    """(position, bytes) -> the strategies holding exactly those bytes at that step."""
    out: dict[tuple, list[str]] = {}
    for label in labels:
        for row in session.lanes[label].memory:
            out.setdefault((row["position"], row[key]), []).append(label)
    return out


def _ran_on(session: Session, labels: list[str]) -> list[tuple[int, int]]:
    """(turn, position) of each turn's last step of the full cache where a shown strategy's reply went on."""
    ref = session.reference
    ends = {}
    for row in ref.memory if ref is not None else []:
        ends[row["turn"]] = row["position"]
    return [
        (turn, end)
        for turn, end in ends.items()
        if any(row["turn"] == turn and row["position"] > end for label in labels for row in session.lanes[label].memory)
    ]


def memory_figure(session: Session) -> go.Figure:
    """Per strategy against the conversation position: state held after each step and the peak within it, both
    measured by the run's instrument (solid, dotted: the allocator's trace or the tensors' storages, named in the
    legend), and the state by formula (dashed); process RSS on the right."""
    labels = [label for label in session.shown if session.lanes[label].memory]
    if not labels:
        return empty_figure(
            "Send a message or play a scenario: memory per strategy appears here", 480, "State memory per strategy"
        )
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    palette = colours(session.shown)
    measured = any(row["persistent"] is not None for label in labels for row in session.lanes[label].memory)
    main = "persistent" if measured else "formula"
    all_bytes = [
        row[k]
        for label in labels
        for row in session.lanes[label].memory
        for k in ("persistent", "peak", "formula")
        if row[k] is not None
    ]
    unit, unit_name = byte_axis(fig, all_bytes, "strategy state", secondary_y=False)
    shared = _shared(session, labels, main)
    ref_tokens = [len(reply.tokens) for reply in session.reference.replies] if session.reference else []
    for k, label in enumerate(labels):
        rows, c = session.lanes[label].memory, palette[label]
        x = [r["position"] for r in rows]
        notes = []
        for r in rows:
            others = [o for o in shared[(r["position"], r[main])] if o != label]
            note = f"<br>same bytes as {', '.join(others)}" if others else ""
            if label != REFERENCE and r["turn"] < len(ref_tokens) and r["index"] >= ref_tokens[r["turn"]]:
                note += "<br>after the full cache's reply ended"
            notes.append([r["turn"] + 1, r["index"] + 1, r["seen"], note])
        name = short_name(session, label)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[r[main] / unit for r in rows],
                name=name,
                legendgroup=label,
                line=dict(color=c, width=3),
                mode="lines+markers",
                marker=line_marker(label, c, len(rows), k, len(labels)),
                customdata=notes,
                hovertemplate=f"{label}<br>state %{{y:.3f}} {unit_name}<br>position %{{x}} "
                "(turn %{customdata[0]}, reply token %{customdata[1]})<br>"
                "its cache has read %{customdata[2]} tokens%{customdata[3]}"
                "<extra></extra>",
            )
        )
        if measured:
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[None if r["peak"] is None else r["peak"] / unit for r in rows],
                    legendgroup=label,
                    showlegend=False,
                    line=dict(color=c, width=1.5, dash="dot"),
                    mode="lines",
                    hovertemplate=f"{label}<br>peak %{{y:.3f}} {unit_name}<extra></extra>",
                )
            )
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[r["formula"] / unit for r in rows],
                    legendgroup=label,
                    showlegend=False,
                    line=dict(color=c, width=1.2, dash="dash"),
                    mode="lines",
                    opacity=0.7,
                    hovertemplate=f"{label}<br>formula %{{y:.3f}} {unit_name}<extra></extra>",
                )
            )
    ends = _ran_on(session, labels)
    if ends:
        top = max(all_bytes) / unit
        fig.add_trace(
            go.Scatter(
                x=[x for _, end in ends for x in (end, end, None)],
                y=[y for _ in ends for y in (0, top, None)],
                customdata=[turn + 1 for turn, _ in ends for _ in range(3)],
                mode="lines",
                name="full cache's reply ends",
                line=dict(color="#777", width=1.5, dash="dashdot"),
                hovertemplate="turn %{customdata}: the full cache's reply ends here; "
                "strategies drawn further ran on<extra></extra>",
            )
        )
    if session.rss:
        rss = [r["rss"] for r in session.rss]
        rss_unit, rss_name = byte_axis(fig, rss, "process RSS", secondary_y=True, showgrid=False)
        fig.add_trace(
            go.Scatter(
                x=[r["position"] for r in session.rss],
                y=[b / rss_unit for b in rss],
                name="process RSS (right)",
                line=dict(color="#888", width=2, dash="longdashdot"),
                mode="lines",
                hovertemplate=f"process RSS %{{y:.3g}} {rss_name}<extra></extra>",
            ),
            secondary_y=True,
        )
    by = "declared" if "declared" in session.memory_instrument else "allocator"
    styles = (
        ((f"state ({by})", "solid", 3), (f"peak in a step ({by})", "dot", 1.5), ("state by formula", "dash", 1.2))
        if measured
        else (("state by formula (no instrument)", "solid", 3),)
    )
    for name, dash, width in styles:
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                name=name,
                mode="lines",
                legendgroup="styles",
                line=dict(color="#000", dash=dash, width=width),
            )
        )
    fig.update_xaxes(title_text=POSITION_AXIS)
    fig = laid_out(fig, 390, "State memory per strategy", session, legend_x=1.09 if session.rss else 1.02)
    return fig.update_layout(legend=dict(font=dict(size=11.5), tracegroupgap=1))  # a dozen entries in 390 px
