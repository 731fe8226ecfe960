"""The page: components grouped in small dataclasses, wired to the handlers in one place."""

from __future__ import annotations

import re
from pathlib import Path

import gradio as gr

from .. import service
from ..catalog import DTYPE_NAMES
from ..frontier import frontier_figure
from ..hosted import hosted
from ..limits import limits
from ..scenarios import scenarios
from . import runner
from .components import Actions, Controls, FrontierTab, Pane, Studio, Views
from .handlers import FRONTIER_CURRENT, RECALL, Handlers, session_ttl_s
from .plots import agreement_figure, latency_figure, memory_figure
from .scoreboard import scoreboard_html
from .session import Session
from .settings import (any_declares, catalogue, default_model, default_names, max_panes, missing_models_note,
                       model_choices, title)

ASSETS = Path(__file__).resolve().parents[2] / "assets"


def asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def _controls(model: str, strategies: list[str] | None, budget: int, max_new_tokens: int) -> Controls:
    names = catalogue()
    choices = model_choices()
    offered = [name for _, name in choices]
    cap = limits()
    with gr.Group():
        preset = gr.Dropdown(choices, value=model if model in offered else default_model(), label="Model (preset)",
                             elem_id="kvd-model",
                             info="Locked while a turn runs. A new model replays the conversation's earlier turns "
                                  "on it at your next message (Clear starts afresh). " + missing_models_note())
        custom = gr.Textbox(value="" if model in offered else model, label="…or a Hub id / local path",
                            placeholder="e.g. HuggingFaceTB/SmolLM2-360M-Instruct", info="Press Enter to load.",
                            visible=not hosted())
        with gr.Row():
            device = gr.Dropdown(service.devices(), value="auto", label="Device", min_width=100)
            dtype = gr.Dropdown(list(DTYPE_NAMES), value="float32", label="dtype", min_width=100)
    picked = gr.CheckboxGroup([(f"{title(n)} ({n})", n) for n in names], value=strategies or default_names(),
                              label="Strategies (one pane each)")
    with gr.Group():
        budget_s = gr.Slider(1, 512, value=budget, step=1, label="Budget (tokens of K/V kept)")
        spacing = gr.Slider(1, 64, value=4, step=1, label="AnchorKV spacing s (layers)",
                            visible=any_declares("spacing"))
        mode = gr.Radio(["exact", "fast"], value="exact", label="Recompute mode",
                        info="exact: bit-equal K/V; fast: one batched GEMM, error measured",
                        visible=any_declares("mode"))
        rebuild = gr.Radio(["step", "turn"], value="step", label="Rebuild old K/V",
                           info="step: at every token (least memory, more compute); turn: once per turn, then "
                                "full K/V held while the turn lasts",
                           visible=any_declares("rebuild"))
        max_new = gr.Slider(1, min(512, cap.max_new_tokens), value=min(max_new_tokens, cap.max_new_tokens), step=1,
                            elem_id="kvd-max-new",
                            label="Max new tokens per turn")
        twins = gr.Checkbox(True, label="Measure agreement after a divergence",
                            info="a teacher-forced twin per diverged pane, fed the full cache's tokens: one more "
                                 "forward per step for each")
        kernels = gr.Radio(["invariant", "native"], value="invariant", label="Kernels", elem_id="kvd-kernels",
                           info="invariant: every row's bits independent of the call (one GEMM for all lanes and "
                                "replays; probed at start); native: the model's own kernels, replays repeat shapes")
    with gr.Accordion("More panes (extra strategy specs)", open=False):
        extra = gr.Textbox(label="Extra specs, comma-separated", placeholder="kvdirect:budget=16:mode=fast",
                           info="name[:key=value]…; budget/spacing/mode above fill in what a spec leaves unset.")
    return Controls(preset, custom, device, dtype, picked, extra, budget_s, spacing, mode, rebuild, max_new, twins, kernels)


CLAIMS = ASSETS.parent / "docs" / "claims"


def _claims_tab():
    """The committed `bench reproduce` report (docs/claims): each claim, our measurement, a verdict in words."""
    report = CLAIMS / "report.md"
    if not report.is_file():
        gr.Markdown("No report yet: run `python -m kvdirect_app.bench reproduce --quick --out docs/claims`.")
        return
    text = report.read_text(encoding="utf-8")
    head, _, details = text.partition("## Details")
    gr.Markdown(head.replace("Every number below", "Reproduce it with `python -m kvdirect_app.bench reproduce "
                                                  "--quick --out DIR`. Every number below"), elem_id="kvd-claims-table")
    with gr.Row():
        for name in ("agreement", "recompute"):
            if (CLAIMS / f"{name}.png").is_file():
                gr.Image(str(CLAIMS / f"{name}.png"), show_label=False, interactive=False)
    with gr.Accordion("Details: every measured row", open=False):
        gr.Markdown(re.sub(r"!\[[^\]]*\]\([^)]*\)", "", details))


def _panes() -> list[Pane]:
    panes = []
    with gr.Row(elem_id="kvd-panes"):
        for i in range(max_panes()):
            with gr.Column(visible=False, min_width=340, elem_classes="kvd-pane") as box:
                head = gr.HTML("")
                chat = gr.Chatbot([], show_label=False, height=340, layout="panel", buttons=["copy"], elem_classes="kvd-chat",
                                  placeholder="Replies stream here.", feedback_options=None)
            panes.append(Pane(box, head, chat))
    return panes


def build_demo(model: str | None = None, strategies: list[str] | None = None, budget: int = 64,
               max_new_tokens: int = 64) -> gr.Blocks:
    """The Studio page.  Launch it with `launch_options()` (theme and CSS go to `launch()` in Gradio 6).

    Laid out for a projector: at 1280x720 the header, the prompt row (with the recall demo one click away) and
    the scoreboard (every pane's verdict, memory and speed) are on the first screen; panes, plots and tabs follow.
    """
    model = model or default_model()
    empty = Session()
    table = scenarios()
    with gr.Blocks(title="KV-Direct Studio", analytics_enabled=False) as demo:
        handlers = Handlers(None, demo)
        session = gr.State(empty, time_to_live=session_ttl_s(), delete_callback=handlers.forget)
        gr.HTML(asset("header.html"), elem_id="kvd-header")
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=280, elem_id="kvd-side"):
                controls = _controls(model, strategies, budget, max_new_tokens)
                scenario = gr.Dropdown([(f"{name} · {s.get('about', '')}", name) for name, s in table.items()],
                                       value=next(iter(table), None), label="Scripted conversation",
                                       elem_id="kvd-scenario")
                play = gr.Button("▶ Play scenario", variant="secondary", elem_id="kvd-play")
            with gr.Column(scale=4, min_width=600):
                status = gr.HTML("", elem_id="kvd-status")
                with gr.Row(elem_id="kvd-ask"):
                    prompt = gr.Textbox(show_label=False, placeholder="Ask something; every pane gets the same turn",
                                        scale=6, lines=1, max_lines=6, autofocus=True, elem_id="kvd-prompt",
                                        max_length=limits().max_prompt_chars)
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="kvd-send")
                    stop = gr.Button("■ Stop", variant="stop", scale=1, min_width=80, interactive=False,
                                     elem_id="kvd-stop")
                    recall = gr.Button("▶ Recall demo", scale=1, min_width=130, elem_id="kvd-recall",
                                       visible=RECALL in table)
                    regenerate = gr.Button("↻ Regenerate", scale=1, min_width=120, elem_id="kvd-regenerate")
                    clear = gr.Button("Clear", scale=1, min_width=70, elem_id="kvd-clear")
                board = gr.HTML(scoreboard_html(empty), elem_id="kvd-board")
                panes = _panes()
                memory = gr.Plot(memory_figure(empty), show_label=False, elem_id="kvd-memory")
                with gr.Row():
                    latency = gr.Plot(latency_figure(empty), show_label=False, elem_id="kvd-latency", min_width=620)
                    agreement = gr.Plot(agreement_figure(empty), show_label=False, elem_id="kvd-agreement",
                                        min_width=620)
                with gr.Tabs():
                    with gr.Tab("Token map"):
                        with gr.Row():
                            map_label = gr.Dropdown([], label="Strategy", scale=3)
                            map_layer = gr.Slider(0, 29, value=0, step=1, label="Layer", scale=2)
                        token_map = gr.HTML(elem_id="kvd-token-map")
                    with gr.Tab("Frontier: memory vs agreement"):
                        gr.Markdown(asset("frontier.md"))
                        with gr.Row():
                            source = gr.Dropdown([FRONTIER_CURRENT, *table], value=FRONTIER_CURRENT, scale=3,
                                                 label="Conversation")
                            draw = gr.Button("Draw the frontier", variant="secondary", scale=1, elem_id="kvd-draw")
                        frontier_status = gr.HTML("", elem_id="kvd-frontier-status")
                        frontier_plot = gr.Plot(frontier_figure([]), show_label=False, elem_id="kvd-frontier")
                    with gr.Tab("Geometry: bytes per token"):
                        geometry = gr.HTML(elem_id="kvd-geometry")
                    with gr.Tab("Export"):
                        gr.Markdown("Downloads hold the last finished (or stopped) turn's run.")
                        with gr.Row():
                            downloads = [gr.DownloadButton(text, interactive=False, variant="secondary")
                                         for text in ("Run (JSON)", "Steps (CSV)", "Summary (CSV)", "Plots (HTML)")]
                    with gr.Tab("Claims", elem_id="kvd-claims"):
                        _claims_tab()
                    with gr.Tab("What am I looking at?", elem_id="kvd-about"):
                        gr.Markdown(asset("about.md"))
        actions = Actions(prompt, send, stop, regenerate, clear, scenario, play, recall)
        views = Views(status, board, memory, latency, agreement, map_label, map_layer, token_map, geometry, *downloads)
        studio = Studio(session, controls, actions, views, panes,
                        FrontierTab(source, draw, frontier_status, frontier_plot))
        handlers.s = studio
        _wire(demo, studio, handlers)
        gr.api(runner.compare, api_name="compare")
    demo.kvd_handlers = handlers  # the tests drive the handlers directly too
    return demo


def _wire(demo: gr.Blocks, studio: Studio, h: Handlers):
    c, a, v = studio.controls, studio.actions, studio.views
    out = studio.outputs()
    model_inputs = c.by_name("model", "custom_model", "device", "dtype")
    # A newer choice supersedes an older one still loading (always_last); loads do not wait behind runs.
    load = dict(fn=h.load_model, inputs=[studio.session], inputs_kwargs=model_inputs, outputs=out,
                api_visibility="private", trigger_mode="always_last", concurrency_id="load", concurrency_limit=4,
                show_progress="hidden")
    demo.load(**load)
    for trigger in (c.model.input, c.device.input, c.dtype.input, c.custom_model.submit):
        trigger(**load)
    run = dict(outputs=out, concurrency_id="generate", trigger_mode="once", show_progress="hidden")

    def queued(trigger, fn, inputs, **kw):
        """Say the run's place in line at once (no queue), then run it in the queue."""
        first = trigger(h.enqueue, inputs=[studio.session], outputs=[v.status], queue=False,
                        api_visibility="private", show_progress="hidden")
        first.success(fn, inputs=inputs, inputs_kwargs=c.by_name(), **run, **kw)

    # The API's endpoints (send, regenerate, play_scenario) are the runs themselves; API clients see the queue's
    # own rank, and a full queue answers with Gradio's "queue is full".
    queued(a.send.click, h.send, [studio.session, a.prompt], api_name="send")
    queued(a.prompt.submit, h.send, [studio.session, a.prompt], api_visibility="private")
    queued(a.regenerate.click, h.regenerate, [studio.session], api_name="regenerate")
    queued(a.play.click, h.play_scenario, [studio.session, a.scenario], api_name="play_scenario")
    queued(a.recall.click, h.play_recall, [studio.session], api_visibility="private")
    a.stop.click(h.stop, inputs=[studio.session], outputs=[v.status], queue=False, api_visibility="private")
    a.clear.click(h.clear, inputs=[studio.session], outputs=out, api_visibility="private")
    f = studio.frontier
    f.draw.click(h.frontier, inputs=[studio.session, f.source], inputs_kwargs=c.by_name(),
                 outputs=[f.status, f.plot, f.draw], concurrency_id="generate", trigger_mode="once",
                 show_progress="hidden", api_name="frontier")
    demo.unload(h.closed)
    for trigger in (v.map_label.input, v.map_layer.release, v.map_layer.input):  # input: arrow keys too
        trigger(h.token_map, inputs=[studio.session, v.map_label, v.map_layer], outputs=[v.token_map],
                api_visibility="private")
