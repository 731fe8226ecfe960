"""The Token map tab's drawings: each strategy's token map at a layer beside another's, and where the question's
last token looks (the attention snapshot) against the full cache; from the session's engine or its recording."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...plain.palette import colours
from ...plain.recording import attention_layer, map_layer
from .. import service
from . import views
from .plot_style import empty_figure, laid_out, short_name
from .session import Session
from .settings import REFERENCE

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
        return empty_figure(
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
    fig = laid_out(fig, 200 + 170 * len(lanes), f"{ATTENTION_TITLE} · layer {layer}<br><sup>{where}</sup>")
    fig.update_layout(margin=dict(t=120))
    fig.update_annotations(font=dict(size=15))
    return fig


def token_map(talk: service.Conversation | None, maps: dict | None, label: str, layer: int) -> dict | None:
    if maps is not None and label in maps:
        states = maps[label]["states"]
        if states and isinstance(states[0], str):  # a recording's compact map: one code per token
            return map_layer(maps, label, layer)
        return {"tokens": maps[label]["tokens"], "states": states[min(layer, len(states) - 1)]}
    if talk is None:
        return None
    return talk.token_map(label, layer)


def map_pair_html(session, label: str | None, layer: int, other: str | None = None) -> str:
    """The token map of `label` at `layer` (beside `other`'s, if given), the scenario's answer outlined; from the
    session's engine, or from its recorded maps."""
    if label is None:
        return views.token_map_html(None, "", 0)
    words = session.expect[1] if session.expect else None
    parts = []
    for name in dict.fromkeys([label] + ([other] if other and other != label else [])):
        try:
            data = token_map(session.engine, session.token_maps, name, int(layer))
        except (IndexError, KeyError, StopIteration):
            data = None
        parts.append(views.token_map_html(data, name, int(layer), mark=words))
    return views.side_by_side(parts, session.recorded_label)


def attention_data(session, label: str) -> callable:
    """`layer -> attention_map` of `label` (None where there is none): from a recording on screen (once it has been
    played to its end), from the run's own snapshots, or from the session's engine."""
    if session.recorded is not None:
        if session.token_maps is None:  # still playing
            return lambda layer: None
        return lambda layer: attention_layer(session.recorded, label, layer)
    maps = session.attention_maps
    if maps is not None:
        m = maps.get(label)
        return lambda layer: (
            None
            if m is None
            else {
                **{k: m[k] for k in ("position", "turn", "tokens")},
                "weights": m["layers"][min(layer, len(m["layers"]) - 1)],
            }
        )
    talk = session.engine
    if talk is None:
        return lambda layer: None
    return lambda layer: talk.attention_map(label, layer)


def attention_plot(session, label: str | None, layer: int):
    """The attention figure of the token map's strategy at `layer`, against the full cache."""
    if label is None:
        return attention_figure(session, None, 0, None, None)
    try:
        full = attention_data(session, REFERENCE)(int(layer))
        other = attention_data(session, label)(int(layer)) if label != REFERENCE else None
    except (IndexError, KeyError, StopIteration):
        full = other = None
    words = session.expect[1] if session.expect else None
    marks = tuple(views.marked_tokens(d["tokens"], words) if d else set() for d in (full, other))
    note = None
    if full is None and session.recorded is not None and session.token_maps is not None:
        note = "This recording holds no attention snapshot (it was made before they were recorded): ▶ Run it live"
    return attention_figure(session, label, int(layer), full, other, marks, note, words)
