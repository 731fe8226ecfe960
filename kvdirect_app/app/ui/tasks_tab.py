"""The Tasks tab: the shipped `bench tasks` results (presets/tasks/) per model, drawn from the files alone (no model).

A model picker on top chooses whose results are shown.  "Answers across turns" draws a multi-turn result, the
history kept (a conversation) or dropped (each question from the compressed context: kvpress's multi-question
mode), its score found in the context by default (an answer copied from the lane's own earlier replies scores 0)
or raw; "One question per context" draws a single-turn one (needle heatmaps, table, frontier).  A results file of
one's own replaces the section of its kind.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr

from ...plain.hosted import hosted
from ...plain.paths import data
from ...plain.schema import SchemaError
from . import tasks_view
from .handlers import session_ttl_s

HISTORIES = [
    ("kept: a conversation", tasks_view.KEEP),
    ("dropped: each question from the compressed context", tasks_view.DROP),
]


def _nothing(problem: str, flags: str, name: str) -> str:
    return (
        f"<p class='kvd-tasks-head'>Nothing to show ({html.escape(problem)}): run `python -m kvdirect_app.bench "
        f"tasks {flags}--json presets/tasks/{name}`.</p>"
    )


@dataclass
class _Section:
    """One section's components: its result (state), pickers, provenance line, and what is drawn."""

    state: gr.State
    setting: gr.Dropdown
    task: gr.Dropdown
    head: gr.HTML

    def pickers_update(self, result: dict | None, keep: int | float | None = None) -> list:
        """The setting and task pickers for `result` (the setting kept where the result has it)."""
        if not result:
            return [gr.update(choices=[], value=None), gr.update(choices=[tasks_view.ALL], value=tasks_view.ALL)]
        choices = tasks_view.settings(result)
        value = keep if keep in [v for _, v in choices] else choices[0][1]
        return [
            gr.update(choices=choices, value=value),
            gr.update(choices=[tasks_view.ALL, *result["tasks"]], value=tasks_view.ALL),
        ]


def _pickers(result: dict | None, prefix: str) -> tuple[gr.Dropdown, gr.Dropdown]:
    choices = tasks_view.settings(result) if result else []
    # allow_custom_value (both pickers): a change queued behind another (a hurried visitor) may still carry the
    # setting or task a result shown a moment ago had, after the choices changed; Gradio would refuse it with an
    # error in the page, and the handlers here check both against the result themselves (`_known`).
    setting = gr.Dropdown(
        choices,
        value=choices[0][1] if choices else None,
        scale=1,
        allow_custom_value=True,
        label="Budget (tokens per layer) or compression ratio",
        elem_id=f"{prefix}-budget",
    )
    task = gr.Dropdown(
        [tasks_view.ALL, *(result["tasks"] if result else [])],
        value=tasks_view.ALL,
        allow_custom_value=True,
        label="Task",
        scale=2,
        elem_id=f"{prefix}-task",
    )
    return setting, task


def _known(result: dict | None, setting, task) -> bool:
    """Whether `setting` and `task` are `result`'s (a stale value from before the choices changed is not)."""
    return (
        bool(result)
        and setting in [v for _, v in tasks_view.settings(result)]
        and task in [tasks_view.ALL, *result["tasks"]]
    )


def tasks_tab():
    """The tab's components and their wiring (inside a `gr.Tab`)."""
    found, problems = tasks_view.shipped_results()
    models = tasks_view.models(found)
    first_model = models[0] if models else None
    single = found.get((first_model, tasks_view.SINGLE))
    multi = found.get((first_model, tasks_view.KEEP)) or found.get((first_model, tasks_view.DROP))
    problem = "; ".join(problems) or "no result is shipped in presets/tasks/"
    gr.Markdown((data("assets") / "tasks.md").read_text(encoding="utf-8"))
    ttl = session_ttl_s()  # a visitor's file expires with their session, as their page does
    with gr.Row():
        model = gr.Dropdown(
            models, value=first_model, label="Model (the shipped results)", scale=2, elem_id="kvd-tasks-model"
        )
        upload = gr.UploadButton(
            "Open a results file (bench tasks --json, with or without --multiturn)",
            file_types=[".json"],
            type="filepath",
            variant="secondary",
            elem_id="kvd-tasks-upload",
            scale=3,
            visible=not hosted(),
        )  # a hosted demo opens no visitor's file

    gr.Markdown("### Answers across turns", elem_id="kvd-turns-title")
    with gr.Row():
        turn_setting, turn_task = _pickers(multi, "kvd-turns")
        history = gr.Radio(
            HISTORIES,
            value=tasks_view.kind(multi) if multi else tasks_view.KEEP,
            label="History between questions",
            scale=2,
            elem_id="kvd-turns-history",
        )
        score = gr.Radio(
            [tasks_view.FROM_CONTEXT, tasks_view.RAW],
            value=tasks_view.FROM_CONTEXT,
            label="Score",
            scale=1,
            elem_id="kvd-turns-score",
            info="found in the context: an answer copied from the lane's own earlier replies scores 0",
        )
    turns = _Section(
        gr.State(multi, time_to_live=ttl),
        turn_setting,
        turn_task,
        gr.HTML(
            tasks_view.head_html(multi) if multi else _nothing(problem, "--multiturn ", "smollm2-135m-multiturn.json"),
            elem_id="kvd-turns-head",
        ),
    )
    first = turn_setting.value
    turns_plot = gr.Plot(
        tasks_view.turns_figure(multi, first) if multi else None, show_label=False, elem_id="kvd-turns-plot"
    )
    turns_table = gr.HTML(tasks_view.turns_table_html(multi, first) if multi else "", elem_id="kvd-turns-summary")

    gr.Markdown("### One question per context", elem_id="kvd-single-title")
    with gr.Row():
        budget, task = _pickers(single, "kvd-tasks")
    one = _Section(
        gr.State(single, time_to_live=ttl),
        budget,
        task,
        gr.HTML(
            tasks_view.head_html(single) if single else _nothing(problem, "", "smollm2-135m.json"),
            elem_id="kvd-tasks-head",
        ),
    )
    first = budget.value
    heat = gr.Plot(
        tasks_view.heatmap_figure(single, first) if single else None, show_label=False, elem_id="kvd-tasks-heatmap"
    )
    summary = gr.HTML(tasks_view.table_html(single, first) if single else "", elem_id="kvd-tasks-summary")
    front = gr.Plot(tasks_view.frontier(single) if single else None, show_label=False, elem_id="kvd-tasks-frontier")

    def draw_turns(result, setting, task, how):
        if not _known(result, setting, task):
            return gr.skip(), gr.skip()
        return tasks_view.turns_table_html(result, setting, task), tasks_view.turns_figure(result, setting, task, how)

    def draw(result, setting, task):
        if not _known(result, setting, task):
            return gr.skip(), gr.skip(), gr.skip()
        return (
            tasks_view.table_html(result, setting, task),
            tasks_view.heatmap_figure(result, setting, task),
            tasks_view.frontier(result, task),
        )

    def shown_turns(result, keep, missing: str) -> list:
        """The turns section for `result` (None: the line saying what is missing): state, pickers, head."""
        head = tasks_view.head_html(result) if result else f"<p class='kvd-tasks-head'>{html.escape(missing)}</p>"
        return [result, *turns.pickers_update(result, keep), head]

    def shown_single(result, keep, missing: str) -> list:
        head = tasks_view.head_html(result) if result else f"<p class='kvd-tasks-head'>{html.escape(missing)}</p>"
        return [result, *one.pickers_update(result, keep), head]

    def pick_model(name, kept_history, turn_keep, single_keep):
        got = tasks_view.shipped_results()[0]
        mine = got.get((name, kept_history))
        return shown_turns(
            mine, turn_keep, f"No multi-turn result with the history {kept_history} is shipped for {name}."
        ) + shown_single(
            got.get((name, tasks_view.SINGLE)), single_keep, f"No single-turn result is shipped for {name}."
        )

    def pick_history(name, kept_history, turn_keep):
        mine = tasks_view.shipped_results()[0].get((name, kept_history))
        return shown_turns(
            mine,
            turn_keep,
            f"No multi-turn result with the history {kept_history} is shipped for "
            f"{name}: choose the other history, or open a file.",
        )

    def opened(path, turn_keep, single_keep, current, current_multi):
        skip = [gr.skip()] * 9
        if not path:
            return skip
        try:
            if hosted():  # the button is hidden there; a request that sends a file anyway is refused unread
                raise SchemaError("opening a results file is off on this hosted demo; the shipped results are shown")
            mine = tasks_view.load(path)
        except SchemaError as e:  # said where the single-turn result's provenance is; nothing shown changes
            shown = current or current_multi
            skip[8] = f"<p class='kvd-error'>Not opened: {html.escape(str(e))}</p>" + (
                tasks_view.head_html(shown) if shown else ""
            )
            return skip
        if mine.get("multiturn"):
            return [*shown_turns(mine, turn_keep, ""), gr.update(value=tasks_view.kind(mine)), *skip[:4]]
        return [*skip[:5], *shown_single(mine, single_keep, "")]

    turn_out = [turns.state, turns.setting, turns.task, turns.head]
    single_out = [one.state, one.setting, one.task, one.head]
    for control in (turn_setting, turn_task, score):
        control.change(
            draw_turns,
            [turns.state, turn_setting, turn_task, score],
            [turns_table, turns_plot],
            queue=False,
            show_progress="hidden",
        )
    turns.state.change(
        draw_turns,
        [turns.state, turn_setting, turn_task, score],
        [turns_table, turns_plot],
        queue=False,
        show_progress="hidden",
    )
    for control in (budget, task):
        control.change(draw, [one.state, budget, task], [summary, heat, front], queue=False, show_progress="hidden")
    one.state.change(draw, [one.state, budget, task], [summary, heat, front], queue=False, show_progress="hidden")
    # A State set by a handler does not fire its own .change here (a browser check: the history picked, the chart
    # stayed the old result's), so every handler that replaces a result draws it next.
    redraw = [
        (draw_turns, [turns.state, turn_setting, turn_task, score], [turns_table, turns_plot]),
        (draw, [one.state, budget, task], [summary, heat, front]),
    ]
    for event, fn, inputs, outputs, draws in (
        (model.input, pick_model, [model, history, turn_setting, budget], turn_out + single_out, redraw),
        (history.input, pick_history, [model, history, turn_setting], turn_out, redraw[:1]),
        (
            upload.upload,
            opened,
            [upload, turn_setting, budget, one.state, turns.state],
            turn_out + [history] + single_out,
            redraw,
        ),
    ):
        chain = event(fn, inputs, outputs, queue=False)
        for then_fn, then_in, then_out in draws:
            chain = chain.then(then_fn, then_in, then_out, queue=False, show_progress="hidden")
