"""The page: components grouped in small dataclasses, wired to the handlers in one place, and its launch options.
The Chat tab is built here; the settings drawer's contents are in `sidebar`, the other tabs' in `tabs`."""

from __future__ import annotations

import logging

import gradio as gr

from ...plain.hosted import hosted
from ...plain.jsonfile import MAX_BYTES
from ...plain.limits import limits
from ...plain.recording import RecordingError
from ...plain.scenarios import scenarios
from . import playback, views
from .compare_api import compare
from .components import Actions, Pane, Recordings, Studio, Views
from .handlers import Handlers, forget, session_ttl_s
from .memory_plot import memory_figure
from .recording_buttons import RECALL
from .scoreboard import scoreboard_html
from .session import Session
from .settings import default_model, max_panes
from .sidebar import recordings_picker, settings_controls
from .tabs import ASSETS, TABS, asset, claims_tab, export_tab, frontier_tab, map_tab, time_tab
from .tasks_tab import tasks_tab

PANE_MAX_PX = 320  # a pane's chat at most: the last 64-token reply whole (~290 px), two rows of panes in ~900 px


def _panes(first: Session) -> list[Pane]:
    """One column per pane: earlier turns clamped to two lines (hover or focus shows all of them), the last reply
    in full (a 64-token reply fits `PANE_MAX_PX`; a longer conversation scrolls, kept at its end); the first
    screen's recording fills them.  A reply is Markdown, never LaTeX (`latex_delimiters=[]`)."""
    panes = []
    with gr.Row(elem_id="kvd-panes"):
        for i in range(max_panes()):
            label = first.shown[i] if i < len(first.shown) else None
            with gr.Column(visible=label is not None, min_width=290, elem_classes="kvd-pane") as box:
                head = gr.HTML(views.pane_header(first, label) if label else "")
                chat = gr.Chatbot(
                    views.messages(first, label) if label else [],
                    show_label=False,
                    height="auto",
                    min_height=120,
                    max_height=PANE_MAX_PX,
                    layout="panel",
                    buttons=[],
                    elem_classes="kvd-chat",
                    placeholder="Replies stream here.",
                    feedback_options=None,
                    # No LaTeX: Gradio's default typesets $$...$$ by scanning every message at every streamed update;
                    # the replies show their tokens as they are, and a turn streams ~1.5 s sooner (docs/perf.md).
                    latex_delimiters=[],
                )
            panes.append(Pane(box, head, chat))
    return panes


def first_screen() -> Session:
    """The page as it opens: the recall recording's end (its scoreboard, panes, plots), or nothing."""
    name = playback.first_name()
    if name is None:
        return Session()
    try:
        return playback.fold(playback.open_recording(name))
    except RecordingError as e:  # a broken shipped file: the page opens empty and the log says why
        logging.getLogger(__name__).error("the first screen's recording %s cannot be played: %s", name, e)
        return Session()


def build_demo(
    model: str | None = None, strategies: list[str] | None = None, budget: int = 64, max_new_tokens: int = 64
) -> gr.Blocks:
    """The Studio page.  Launch it with `launch_options()` (theme and CSS go to `launch()` in Gradio 6).

    Laid out for a projector: at 1280x720 a one-line header, the tab row (`TABS`, the chat first), the message
    box and the scoreboard (every pane's verdict, memory and time) are on the first screen; the memory curve
    and the panes follow in the Chat tab; the settings live in a drawer, closed at start.
    """
    model = model or default_model()
    empty = first_screen()
    table = scenarios()
    with gr.Blocks(title="KV-Direct Studio", analytics_enabled=False) as demo:
        # Each visitor's state starts as a name only (Gradio copies the initial value per session): the first
        # screen's recording is folded into a visitor's session when a handler first needs it.
        session = gr.State(
            Session(pending=playback.first_name() if empty.recording else None),
            time_to_live=session_ttl_s(),
            delete_callback=forget,
        )
        with gr.Sidebar(label="Settings", open=False, width=360, elem_id="kvd-side"):
            controls = settings_controls(model, strategies, budget, max_new_tokens)
            scenario = gr.Dropdown(
                [(f"{name} · {s.get('about', '')}", name) for name, s in table.items()],
                value=next(iter(table), None),
                label="Scripted conversation",
                elem_id="kvd-scenario",
            )
            play = gr.Button("▶ Play scenario", variant="secondary", elem_id="kvd-play", interactive=False)
            picker, speed, upload = recordings_picker(empty)
        banner = gr.HTML(views.header_html(), elem_id="kvd-header")
        with gr.Tabs(elem_id="kvd-tabs"):
            with gr.Tab(TABS[0], elem_id="kvd-tab-chat"):
                status = gr.HTML(
                    views.status(
                        "Loading the model… The recorded run below needs none: ▶ Replay it plays it now.", "busy"
                    ),
                    elem_id="kvd-status",
                )
                with gr.Row(elem_id="kvd-ask"):
                    prompt = gr.Textbox(
                        show_label=False,
                        placeholder="Ask something; every pane gets the same turn",
                        scale=5,
                        min_width=560,
                        lines=1,
                        max_lines=6,
                        autofocus=True,
                        elem_id="kvd-prompt",
                        max_length=limits().max_prompt_chars,
                    )
                    # The buttons that start a run work once a model is ready (`ModelChoice._runs_enabled`).
                    send = gr.Button(
                        "Send", variant="primary", scale=0, min_width=100, elem_id="kvd-send", interactive=False
                    )
                    stop = gr.Button(
                        "■ Stop", variant="stop", scale=0, min_width=100, interactive=False, elem_id="kvd-stop"
                    )
                next_send = gr.HTML("", elem_id="kvd-next")
                with gr.Row(elem_id="kvd-recorded", equal_height=True):
                    recall = gr.Button(
                        "▶ Recall demo",
                        scale=0,
                        min_width=140,
                        size="sm",
                        elem_id="kvd-recall",
                        visible=RECALL in table,
                        interactive=False,
                    )
                    regenerate = gr.Button(
                        "↻ Regenerate", scale=0, min_width=130, size="sm", elem_id="kvd-regenerate", interactive=False
                    )
                    clear = gr.Button("Clear", scale=0, min_width=80, size="sm", elem_id="kvd-clear")
                    settings = gr.Button("⚙ Settings", scale=0, min_width=120, size="sm", elem_id="kvd-settings")
                    line = gr.HTML(views.recording_line(empty), elem_id="kvd-recording-line")
                    replay = gr.Button(
                        "▶ Replay it",
                        scale=0,
                        min_width=120,
                        elem_id="kvd-replay",
                        size="sm",
                        visible=bool(playback.offered()),
                    )
                    live = gr.Button(
                        "▶ Run it live",
                        scale=0,
                        min_width=130,
                        elem_id="kvd-live",
                        size="sm",
                        visible=bool(empty.recording),
                        interactive=False,
                    )
                board = gr.HTML(scoreboard_html(empty), elem_id="kvd-board")
                # The scoreboard and the memory curve within two screens (the bytes' story), the panes after them.
                memory = gr.Plot(memory_figure(empty), show_label=False, elem_id="kvd-memory")
                panes = _panes(empty)
            with gr.Tab(TABS[1], elem_id="kvd-tab-map"):
                map_label, map_other, map_layer, token_map, attention = map_tab(empty)
            with gr.Tab(TABS[2], elem_id="kvd-tab-time"):
                latency, agreement = time_tab(empty)
            with gr.Tab(TABS[3], elem_id="kvd-tab-frontier"):
                frontier = frontier_tab(table)
            with gr.Tab(TABS[4], elem_id="kvd-tab-geometry"):
                geometry = gr.HTML(elem_id="kvd-geometry")
            with gr.Tab(TABS[5], elem_id="kvd-tasks"):
                tasks_tab()
            with gr.Tab(TABS[6], elem_id="kvd-claims"):
                claims_tab()
            with gr.Tab(TABS[7], elem_id="kvd-tab-export"):
                downloads, record = export_tab()
            with gr.Tab(TABS[8], elem_id="kvd-about"):
                gr.Markdown(asset("about.md"))
        actions = Actions(prompt, send, stop, regenerate, clear, scenario, play, recall, next_send)
        shown = Views(
            status,
            board,
            memory,
            latency,
            agreement,
            map_label,
            map_other,
            map_layer,
            token_map,
            attention,
            geometry,
            *downloads,
            banner,
        )
        studio = Studio(
            session,
            controls,
            actions,
            shown,
            panes,
            frontier,
            Recordings(line, picker, speed, upload, replay, live, record),
        )
        handlers = Handlers(studio, demo)
        _wire(demo, studio, handlers)
        # The sidebar opens from the Chat tab too (its own toggle is a small arrow at the page's edge).
        settings.click(None, js="() => document.querySelector('#kvd-side .toggle-button').click()")
        gr.api(compare, api_name="compare")
    demo.kvd_handlers = handlers  # the tests drive the handlers directly too
    return demo


def launch_options() -> dict:
    """Theme, CSS and the upload cap for `demo.launch(...)` (Gradio 6 takes them there, not in `Blocks`).

    `max_file_size`: Gradio's upload route refuses a larger file itself (HTTP 413) while it streams in, before any
    of our code reads it: the largest file the page opens (`jsonfile.MAX_BYTES`, a recording or a tasks result),
    and nothing at all on a hosted demo, whose page opens no visitor's file."""
    # Local fonts only: the demo must render offline (no web fonts).
    theme = gr.themes.Default(
        primary_hue="blue",
        neutral_hue="slate",
        text_size=gr.themes.sizes.text_lg,
        font=["system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"],
        font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"],
    )
    # The styles are drawn for a light page (projectors wash out dark ones): drop the dark class if the OS asked for it.
    # A pane's chat keeps its last reply in view (the first screen's recording has eight turns; a live reply grows),
    # unless the visitor is reading it with the pointer on it.  A dropdown's value and its options, cut to their
    # box's width (the Token map's strategies: `anchorkv:spacing=30:budget=64:rebuild=turn`), read whole on hover.
    start = """() => {
      document.body.classList.remove('dark'); document.documentElement.classList.remove('dark');
      const stick = () => document.querySelectorAll('.block.kvd-chat').forEach(chat => {
        if (!chat.matches(':hover')) chat.scrollTop = chat.scrollHeight; });
      new MutationObserver(stick).observe(document.body, {childList: true, subtree: true, characterData: true});
      const whole = e => { const t = e.target;
        if (!(t instanceof Element)) return;
        const pick = t.closest('input[role=combobox], li[role=option]');
        if (pick) pick.title = pick.tagName === 'INPUT' ? pick.value : pick.getAttribute('aria-label') || ''; };
      document.addEventListener('mouseover', whole); document.addEventListener('focusin', whole);
    }"""
    return {
        "theme": theme,
        "css_paths": [ASSETS / name for name in ("studio.css", "claims.css") if (ASSETS / name).is_file()],
        "js": start,
        "max_file_size": 0 if hosted() else MAX_BYTES,
    }


def _wire(demo: gr.Blocks, studio: Studio, h: Handlers):
    c, a, v = studio.controls, studio.actions, studio.views
    out = studio.outputs()
    model_inputs = c.by_name("model", "custom_model", "device", "dtype")
    # A newer choice supersedes an older one still loading (always_last); loads do not wait behind runs.
    load = dict(
        fn=h.load_model,
        inputs=[studio.session],
        inputs_kwargs=model_inputs,
        outputs=out,
        api_visibility="private",
        trigger_mode="always_last",
        concurrency_id="load",
        concurrency_limit=4,
        show_progress="hidden",
    )
    demo.load(**load)
    for trigger in (c.model.input, c.device.input, c.dtype.input, c.custom_model.submit):
        trigger(**load)
    run = dict(outputs=out, concurrency_id="generate", trigger_mode="once", show_progress="hidden")
    # What the next Send will replay, said beside the box when a setting changes, and again after each run.
    told = dict(
        fn=h.next_send,
        inputs=[studio.session],
        inputs_kwargs=c.by_name(),
        outputs=[a.next],
        queue=False,
        show_progress="hidden",
        api_visibility="private",
    )
    # (Not on a model's controls: a model switch says itself what the next message replays, and its load changes the
    # spacing slider's maximum, which a request sent at the switch would then exceed: an HTTP 500 from Gradio.)
    for name, control in c.by_name().items():
        if name not in ("model", "custom_model", "device", "dtype"):
            control.change(**told)

    def queued(trigger, fn, inputs, **kw):
        """Say the run's place in line at once (no queue), then run it in the queue, and while it waits say again,
        every second, what holds the slot and how far that is (a queue of its own: it never waits itself)."""
        first = trigger(
            h.enqueue,
            inputs=[studio.session],
            outputs=[v.status],
            queue=False,
            api_visibility="private",
            show_progress="hidden",
        )
        first.success(fn, inputs=inputs, inputs_kwargs=c.by_name(), **run, **kw).then(**told)
        first.success(
            h.waiting,
            inputs=[studio.session],
            outputs=[v.status],
            concurrency_id="line",
            concurrency_limit=None,
            api_visibility="private",
            show_progress="hidden",
        )

    # The API's endpoints (send, regenerate, play_scenario) are the runs themselves; API clients see the queue's
    # own rank, and a full queue answers with Gradio's "queue is full".
    queued(a.send.click, h.send, [studio.session, a.prompt], api_name="send")
    queued(a.prompt.submit, h.send, [studio.session, a.prompt], api_visibility="private")
    queued(a.regenerate.click, h.regenerate, [studio.session], api_name="regenerate")
    queued(a.play.click, h.play_scenario, [studio.session, a.scenario], api_name="play_scenario")
    queued(a.recall.click, h.play_recall, [studio.session], api_visibility="private")
    a.stop.click(h.stop, inputs=[studio.session], outputs=[v.status], queue=False, api_visibility="private")
    a.clear.click(h.clear, inputs=[studio.session], outputs=out, api_visibility="private", show_progress="hidden").then(
        **told
    )
    f = studio.frontier
    f.draw.click(
        h.frontier,
        inputs=[studio.session, f.source],
        inputs_kwargs=c.by_name(),
        outputs=[f.status, f.plot, f.draw, f.cancel],
        concurrency_id="generate",
        trigger_mode="once",
        show_progress="hidden",
        api_name="frontier",
    )
    f.cancel.click(h.cancel_frontier, inputs=[studio.session], outputs=[], queue=False, api_visibility="private")
    demo.unload(h.closed)
    for trigger in (v.map_label.input, v.map_other.input, v.map_layer.release, v.map_layer.input):  # arrow keys too
        trigger(
            h.token_map,
            inputs=[studio.session, v.map_label, v.map_layer, v.map_other],
            outputs=[v.token_map, v.attention],
            api_visibility="private",
        )
    r = studio.recordings
    # Playing a recording needs no model and waits behind no run: its own queue, a few at once.
    replay = dict(
        outputs=out,
        concurrency_id="replay",
        concurrency_limit=8,
        trigger_mode="always_last",
        show_progress="hidden",
        api_visibility="private",
    )
    r.replay.click(h.replay, inputs=[studio.session, r.picker, r.speed], **replay)
    r.upload.upload(h.replay, inputs=[studio.session, r.picker, r.speed, r.upload], **replay)
    queued(r.live.click, h.run_live, [studio.session], api_visibility="private")
