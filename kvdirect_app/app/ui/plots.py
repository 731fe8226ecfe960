"""The live figures of the Chat and Time & agreement tabs drawn together: what the page shows after a turn and
what the Export tab's plots file holds."""

from __future__ import annotations

import plotly.graph_objects as go

from .agreement_plot import agreement_figure
from .latency_plot import latency_figure
from .memory_plot import memory_figure
from .session import Session


def all_figures(session: Session) -> dict[str, go.Figure]:
    return {
        "memory": memory_figure(session),
        "latency": latency_figure(session),
        "agreement": agreement_figure(session),
    }
