"""The live figures' shared look (plotly): the template, fonts, byte axes, titles, legend names, the empty hint
and the line markers that the memory, latency, agreement and attention figures all draw with."""

from __future__ import annotations

import math

import plotly.graph_objects as go
import plotly.io as pio

from ...plain.palette import symbol
from .session import Session
from .settings import title

FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=16, color="#111")
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


def byte_axis(fig: go.Figure, values: list[float], what: str, **where) -> tuple[float, str]:
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


def laid_out(
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


def empty_figure(message: str, height: int, title_text: str) -> go.Figure:
    """Nothing measured yet: the hint alone, without axes or grid that would mean nothing."""
    fig = go.Figure()
    fig.add_annotation(
        text=message, showarrow=False, font=dict(size=18, color="#555"), xref="paper", yref="paper", x=0.5, y=0.5
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return laid_out(fig, height, title_text)


def line_marker(label: str, colour: str, n: int, k: int, lines: int) -> dict:
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
