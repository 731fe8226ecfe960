"""The page's tabs (`TABS`, in their order) and what each tab but Chat holds: the token map, time and agreement,
the frontier, the claims and the exports; `layout.build_demo` puts each in its place."""

from __future__ import annotations

import re

import gradio as gr

from ...claims import render, reproduce
from ...plain.frontier import frontier_figure
from ...plain.paths import data
from . import views
from .agreement_plot import agreement_figure
from .claims_cards import cards_html
from .components import FrontierTab
from .frontier_drawing import FRONTIER_CURRENT
from .latency_plot import latency_figure
from .session import Session
from .token_map_tab import attention_plot, map_pair_html

TABS = ("Chat", "Token map", "Time & agreement", "Frontier", "Geometry", "Tasks", "Claims", "Export", "Help")
ASSETS = data("assets")
CLAIMS = data("docs/claims")


def asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def map_tab(empty: Session) -> tuple:
    """The Token map tab: a strategy, another beside it and a layer; their token maps and the attention snapshot.
    Returns (strategy, beside, layer, token map, attention)."""
    with gr.Row():
        label0, other0, layer0 = views.telling_view(empty, empty.token_maps)
        map_label = gr.Dropdown(empty.shown, value=label0, label="Strategy", scale=3, elem_id="kvd-map-label")
        map_other = gr.Dropdown(empty.shown, value=other0, label="…beside", scale=3, elem_id="kvd-map-other")
        layers = len(next(iter(empty.token_maps.values()))["states"]) if empty.token_maps else 30
        map_layer = gr.Slider(
            0, max(1, layers - 1), value=layer0, step=1, label="Layer", scale=2, elem_id="kvd-map-layer"
        )
    token_map = gr.HTML(map_pair_html(empty, label0, layer0, other0), elem_id="kvd-token-map")
    attention = gr.Plot(attention_plot(empty, label0, layer0), show_label=False, elem_id="kvd-attention")
    return map_label, map_other, map_layer, token_map, attention


def time_tab(empty: Session) -> tuple[gr.Plot, gr.Plot]:
    """The Time & agreement tab: the latency figure and the agreement figure."""
    latency = gr.Plot(latency_figure(empty), show_label=False, elem_id="kvd-latency")
    agreement = gr.Plot(agreement_figure(empty), show_label=False, elem_id="kvd-agreement")
    return latency, agreement


def frontier_tab(table: dict) -> FrontierTab:
    """The Frontier tab: what it draws, the conversation to draw it on, its buttons, its status and its plot."""
    gr.Markdown(asset("frontier.md"))
    with gr.Row():
        source = gr.Dropdown([FRONTIER_CURRENT, *table], value=FRONTIER_CURRENT, scale=3, label="Conversation")
        draw = gr.Button("Draw the frontier", variant="secondary", scale=1, elem_id="kvd-draw")
        cancel = gr.Button(
            "Cancel the drawing", variant="stop", scale=1, interactive=False, elem_id="kvd-frontier-cancel"
        )
    frontier_status = gr.HTML("", elem_id="kvd-frontier-status")
    frontier_plot = gr.Plot(frontier_figure([]), show_label=False, elem_id="kvd-frontier")
    return FrontierTab(source, draw, cancel, frontier_status, frontier_plot)


def claims_tab():
    """The committed `bench reproduce` run (docs/claims/results.json): each claim, our measurement, a verdict in
    words.  Every verdict, reason and table is computed here from the run's numbers, by the functions
    `reproduce --render` uses; no stored verdict or report text is shown."""
    try:
        results = reproduce.load(CLAIMS)
    except reproduce.ResultsError as e:
        gr.Markdown(f"No report to show ({e}): run `python -m kvdirect_app.bench reproduce --quick --out docs/claims`.")
        return
    head, _, details = render.render(results).partition(render.DETAILS)
    gr.HTML(cards_html(results), elem_id="kvd-claims-cards")
    with gr.Row():
        for name in ("agreement", "recompute", "patching"):
            if (CLAIMS / f"{name}.png").is_file():
                gr.Image(str(CLAIMS / f"{name}.png"), show_label=False, interactive=False)
    with gr.Accordion("The table: every claim's figures and the whole reason", open=False):
        again = f"python -m kvdirect_app.bench reproduce {'--quick ' if results['quick'] else ''}--out DIR"
        gr.Markdown(
            head.replace("Every number below", f"Reproduce it with `{again}`. Every number below"),
            elem_id="kvd-claims-table",
        )
    with gr.Accordion("Details: every measured row", open=False):
        gr.Markdown(re.sub(r"!\[[^\]]*\]\([^)]*\)", "", details))


def export_tab() -> tuple[list[gr.DownloadButton], gr.DownloadButton]:
    """The Export tab's downloads of the last finished turn's run: (the run's files, its recording)."""
    gr.Markdown("Downloads hold the last finished (or stopped) turn's run.")
    with gr.Row():
        downloads = [
            gr.DownloadButton(text, interactive=False, variant="secondary")
            for text in ("Run (JSON)", "Steps (CSV)", "Summary (CSV)", "Plots (HTML)")
        ]
        record = gr.DownloadButton(
            "Recording (.json.gz)", interactive=False, variant="secondary", elem_id="kvd-download-recording"
        )
    return downloads, record
