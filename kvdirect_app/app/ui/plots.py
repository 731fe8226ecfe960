"""The live figures (plotly): state bytes, per-op latency, agreement with the full cache."""

from __future__ import annotations

import math

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from ...plain.palette import colours, symbol
from .session import Session
from .settings import REFERENCE, title

FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=16, color="#111")
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
MARKS = 10  # markers along each line
POSITION_AXIS = "conversation position (tokens)"  # prompt + reply tokens so far: one step is one x for every lane


def _white() -> go.layout.Template:
    """plotly_white cut to what these figures use (cartesian axes; scatter and bar traces): the same look, and each
    figure's copy of it costs ~8 ms instead of ~30 (the figures are drawn again and again while a turn runs)."""
    white = pio.templates["plotly_white"]
    keep = (
        "autotypenumbers",
        "colorway",
        "font",
        "hovermode",
        "hoverlabel",
        "paper_bgcolor",
        "plot_bgcolor",
        "xaxis",
        "yaxis",
        "shapedefaults",
        "annotationdefaults",
        "title",
    )
    layout = {k: v for k, v in white.layout.to_plotly_json().items() if k in keep}
    data = {k: v for k, v in white.data.to_plotly_json().items() if k in ("scatter", "bar")}
    return go.layout.Template(layout=layout, data=data)


TEMPLATE = _white()


def _scale(values: list[float]) -> tuple[float, str]:
    top = max(values, default=0)
    if top >= 2**30:
        return 2**30, "GiB"
    if top >= 2**20:
        return 2**20, "MiB"
    return 2**10, "KiB"


def _ticks(top: float) -> list[float]:
    """Round ticks from 0 to just past `top`: steps of 1, 2 or 5 times a power of ten, five to eleven of them."""
    if top <= 0:
        return [0, 1]
    power = 10 ** math.floor(math.log10(top / 4))
    step = max(m * power for m in (1, 2, 5) if m * power <= top / 4)
    return [round(i * step, 12) for i in range(math.floor(top / step) + 2)]


def _byte_axis(fig: go.Figure, values: list[float], what: str, **where) -> tuple[float, str]:
    """A byte axis in one unit (named in its title) with round ticks; returns the unit (bytes, name).
    Explicit ticks, because plotly syncs an overlaying axis's ticks to the main grid (293, 586, 879 MiB)."""
    unit, unit_name = _scale(values)
    ticks = _ticks(max(values, default=0) / unit)
    fig.update_yaxes(
        title_text=f"{what} ({unit_name})",
        tickmode="array",
        tickvals=ticks,
        ticktext=[f"{t:g}" for t in ticks],
        range=[0, ticks[-1]],
        **where,
    )
    return unit, unit_name


def _layout(
    fig: go.Figure, height: int, title_text: str, session: Session | None = None, legend_x: float = 1.02
) -> go.Figure:
    """Short title (with "recorded on ..." under it for a recording), the legend in a column right of the plot
    (it never covers an axis title), short axis titles (the long explanations are in the hovers and captions)."""
    if session is not None and session.recording:
        title_text += f"<br><sup>{session.recorded_label}</sup>"
    fig.update_layout(
        template=TEMPLATE,
        font=FONT,
        height=height,
        title=dict(
            text=title_text,
            x=0.01,
            xanchor="left",
            yref="container",
            y=1,
            yanchor="top",
            pad=dict(t=24),
            font=dict(size=20),
        ),
        margin=dict(l=70, r=20, t=105 if "<br>" in title_text else 80, b=60, autoexpand=True),
        legend=dict(orientation="v", yanchor="top", y=1.0, x=legend_x, xanchor="left", font=dict(size=13)),
        hoverlabel=dict(font_size=14),
    )
    return fig


def short_name(session: Session, label: str) -> str:
    """A legend's name: the strategy's title, with its settings only where two panes share that title."""
    name = title(label)
    same = [other for other in session.shown if title(other) == name]
    return name if len(same) <= 1 else label


def _empty(message: str, height: int, title_text: str) -> go.Figure:
    """Nothing measured yet: the hint alone, without axes or grid that would mean nothing."""
    fig = go.Figure()
    fig.add_annotation(
        text=message, showarrow=False, font=dict(size=18, color="#555"), xref="paper", yref="paper", x=0.5, y=0.5
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, height, title_text)


def _marker(label: str, colour: str, n: int, k: int, lines: int) -> dict:
    """The strategy's symbol at about MARKS points of its line, the k-th of `lines` lines shifted by k/lines of
    the spacing: where lines coincide (same bytes, same match) every strategy's markers still show."""
    every = max(1, n // MARKS)
    phase = k * every // lines
    return dict(
        symbol=symbol(label),
        color=colour,
        line=dict(width=2, color=colour),
        size=[11 if i % every == phase else 0 for i in range(n)],
    )


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
        return _empty(
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
    unit, unit_name = _byte_axis(fig, all_bytes, "strategy state", secondary_y=False)
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
                marker=_marker(label, c, len(rows), k, len(labels)),
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
        rss_unit, rss_name = _byte_axis(fig, rss, "process RSS", secondary_y=True, showgrid=False)
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
    fig = _layout(fig, 390, "State memory per strategy", session, legend_x=1.09 if session.rss else 1.02)
    return fig.update_layout(legend=dict(font=dict(size=11.5), tracegroupgap=1))  # a dozen entries in 390 px


def latency_figure(session: Session) -> go.Figure:
    """Mean ms per decode step, stacked by op, per strategy, its own total at the end of each bar; the step's wall
    time and the rate every pane streamed at (the same for all, in lockstep) under them."""
    labels = [label for label in session.shown if session.lanes[label].latency]
    if not labels:
        return _empty(
            "Send a message or play a scenario: per-op timings appear after the first decode step",
            380,
            "Own ms per decode step, by part",
        )
    fig = go.Figure()
    means = {label: session.lanes[label].op_means() for label in labels}
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
    steps = session.step_means()
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
    fig.update_xaxes(title_text="ms per decode step (mean)", range=[0, 1.5 * max(totals, default=1)])
    return _layout(
        fig, max(380, 130 + 44 * (len(labels) + 2 * (steps is not None))), "Own ms per decode step, by part", session
    )


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
        return _empty(
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
    positive = [r["kl"] for label in labels for r in session.lanes[label].agreement if r["kl"] > 0]
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
                y=[r["kl"] if r["kl"] > 0 else floor for r in rows],
                legendgroup=label,
                name=name,
                line=dict(color=c, width=2),
                mode="lines",
                customdata=[f"{r['kl']:.3g}" if r["kl"] > 0 else "0 (exact)" for r in rows],
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
    fig = _layout(fig, max(480, 260 + 30 * len(labels)), "Do the strategies change the output?", session)
    fig.update_annotations(font=dict(size=15))
    return fig


ATTENTION_FLOOR = 1e-4  # weights below it (a recording keeps 4 decimals) are drawn on the axis floor
ATTENTION_TITLE = "Where the question's last token looks"


def attention_figure(
    session: Session,
    label: str | None,
    layer: int,
    full: dict | None,
    other: dict | None,
    marks: tuple[set, set] = (set(), set()),
    note: str | None = None,
    answer: str | None = None,
) -> go.Figure:
    """The attention snapshot at `layer` (the last query of the latest turn's prompt, heads averaged), in two
    rows: the full cache's weights over the conversation's tokens, and `label`'s below, its evicted tokens
    marked ✕ (and, where both histories are the same, the share of the full cache's attention they held); the
    scenario's answer tokens (`marks`: indices in full's and in other's tokens) shaded.  `full`/`other` are
    `attention_map` dicts ({"position", "turn", "tokens", "weights"})."""
    if full is None:
        return _empty(
            note
            or "After a turn: the attention of the question's last token over the conversation, full "
            "cache against the strategy picked above",
            380,
            ATTENTION_TITLE,
        )
    palette = colours(session.shown or [REFERENCE])
    pair = other is not None and label != REFERENCE
    lanes = [(REFERENCE, full, marks[0])] + ([(label, other, marks[1])] if pair else [])
    names = [short_name(session, name) if session.shown else name for name, _, _ in lanes]
    fig = make_subplots(
        rows=len(lanes),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.16,
        subplot_titles=[f"{n}: its attention" for n in names],
    )
    same = pair and other["tokens"] == full["tokens"]  # histories equal up to the query
    for row, ((name, data, marked), shown) in enumerate(zip(lanes, names), 1):
        xs = list(range(len(data["weights"])))
        texts = [t.replace("\n", "↵") for t in data["tokens"]]
        fig.add_trace(
            go.Bar(
                x=xs,
                y=[None if w is None else max(w, ATTENTION_FLOOR) for w in data["weights"]],
                name=shown,
                marker_color=palette.get(name, "#333"),
                marker_line_width=0,
                customdata=texts,
                showlegend=False,
                hovertemplate=f"{name}<br>token %{{x}} “%{{customdata}}”: %{{y:.4f}}<extra></extra>",
            ),
            row=row,
            col=1,
        )
        for i in sorted(marked):
            fig.add_vrect(x0=i - 0.5, x1=i + 0.5, fillcolor="#f1c40f", opacity=0.45, line_width=0, row=row, col=1)
    if answer and any(marks):
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"“{answer}”: the answer",
                marker=dict(symbol="square", size=14, color="#f1c40f", opacity=0.6),
            ),
            row=1,
            col=1,
        )
    lost = None
    if pair:
        # Evicted: not handed to the strategy's attention where the full cache's was (a sliding layer's window
        # hands neither the older tokens).
        n = min(len(full["weights"]), len(other["weights"]))
        at = [i for i in range(n) if other["weights"][i] is None and full["weights"][i] is not None]
        if at:
            if same:
                lost = sum(full["weights"][i] for i in at)
            fig.add_trace(
                go.Scatter(
                    x=at,
                    y=[1.6 * ATTENTION_FLOOR] * len(at),
                    mode="markers",
                    name=f"evicted by {names[1]}",
                    marker=dict(symbol="x-thin", size=8, line=dict(width=2, color="#c0392b")),
                    customdata=[other["tokens"][i].replace("\n", "↵") for i in at],
                    hovertemplate="evicted: token %{x} “%{customdata}”<extra></extra>",
                ),
                row=2,
                col=1,
            )
    where = f"turn {full['turn']}'s last prompt token"
    if lost is not None:
        where += f" · evicted tokens held {100 * lost:.0f}% of the full cache's attention"
    elif pair and not same:
        where += " · replies diverged, each row has its own tokens"
    fig.update_yaxes(
        type="log",
        range=[math.log10(ATTENTION_FLOOR), 0.05],
        exponentformat="power",
        tickvals=[1e-4, 1e-3, 1e-2, 1e-1, 1],
        title_text="weight (heads avg)",
    )
    fig.update_xaxes(title_text="token of the conversation", row=len(lanes), col=1)
    fig.update_layout(bargap=0)
    if session.recording:  # on the same line: a third title line would run off the top
        where += f" · {session.recorded_label}"
    fig = _layout(fig, 200 + 170 * len(lanes), f"{ATTENTION_TITLE} · layer {layer}<br><sup>{where}</sup>")
    fig.update_layout(margin=dict(t=120))
    fig.update_annotations(font=dict(size=15))
    return fig


def all_figures(session: Session) -> dict[str, go.Figure]:
    return {
        "memory": memory_figure(session),
        "latency": latency_figure(session),
        "agreement": agreement_figure(session),
    }
