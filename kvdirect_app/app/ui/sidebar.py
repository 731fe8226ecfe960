"""The settings drawer's contents: the model, device and dtype, the strategies and their shared settings, and the
recorded runs' picker."""

from __future__ import annotations

import gradio as gr

from ...plain.catalog import DTYPE_NAMES
from ...plain.hosted import hosted
from ...plain.limits import limits
from .. import service
from . import playback
from .components import Controls
from .session import Session
from .settings import any_declares, catalogue, default_model, default_names, missing_models_note, model_choices, title

LIVE_REBUILD = "turn"  # the live defaults (docs/perf.md, "Live defaults": what a 64-token turn costs with them)
LIVE_TWINS = False


def settings_controls(model: str, strategies: list[str] | None, budget: int, max_new_tokens: int) -> Controls:
    names = catalogue()
    choices = model_choices()
    offered = [name for _, name in choices]
    cap = limits()
    with gr.Group():
        preset = gr.Dropdown(
            choices,
            value=model if model in offered else default_model(),
            label="Model (preset)",
            elem_id="kvd-model",
            info="Locked while a turn runs. A new model replays the conversation's earlier turns "
            "on it at your next message (Clear starts afresh). " + missing_models_note(),
        )
        custom = gr.Textbox(
            value="" if model in offered else model,
            label="…or a Hub id / local path",
            placeholder="e.g. HuggingFaceTB/SmolLM2-360M-Instruct",
            info="Press Enter to load.",
            visible=not hosted(),
        )
        with gr.Row():
            device = gr.Dropdown(service.devices(), value="auto", label="Device", min_width=100)
            dtype = gr.Dropdown(list(DTYPE_NAMES), value="float32", label="dtype", min_width=100)
    picked = gr.CheckboxGroup(
        [(f"{title(n)} ({n})", n) for n in names],
        value=strategies or default_names(),
        label="Strategies (one pane each)",
    )
    with gr.Group():
        budget_s = gr.Slider(1, 512, value=budget, step=1, label="Budget (tokens of K/V kept)")
        spacing = gr.Slider(
            1, 64, value=4, step=1, label="AnchorKV spacing s (layers)", visible=any_declares("spacing")
        )
        mode = gr.Radio(
            ["exact", "fast"],
            value="exact",
            label="Recompute mode",
            info="exact: bit-equal K/V; fast: one batched GEMM, error measured",
            visible=any_declares("mode"),
        )
        rebuild = gr.Radio(
            ["step", "turn"],
            value=LIVE_REBUILD,
            label="Rebuild old K/V",
            elem_id="kvd-rebuild",
            info="turn (the live default, the papers' mode): rebuilt once per turn, full K/V held "
            "while the turn lasts: about the full cache's speed. step: every old token rebuilt "
            "at every step: the least memory, but in lockstep every pane waits for it (AnchorKV "
            "replays the whole conversation through its layers per token, ~1 s a token at a few "
            "hundred tokens on a laptop CPU). The recordings use step.",
            visible=any_declares("rebuild"),
        )
        max_new = gr.Slider(
            1,
            min(512, cap.max_new_tokens),
            value=min(max_new_tokens, cap.max_new_tokens),
            step=1,
            elem_id="kvd-max-new",
            label="Max new tokens per turn",
        )
        twins = gr.Checkbox(
            LIVE_TWINS,
            label="Measure agreement after a divergence",
            elem_id="kvd-twins",
            info="a teacher-forced twin per diverged pane, fed the full cache's tokens, for KL after "
            "its first divergence: a second pass over the weights at every step (~+25% of a "
            "turn here). Off for live turns, on in the recordings.",
        )
        kernels = gr.Radio(
            ["invariant", "native"],
            value="invariant",
            label="Kernels",
            elem_id="kvd-kernels",
            info="invariant: every row's bits independent of the call (one GEMM for all lanes and "
            "replays; probed at start); native: the model's own kernels, replays repeat shapes",
        )
    with gr.Accordion("More panes (extra specs)", open=False):
        extra = gr.Textbox(
            label="Extra specs, comma-separated",
            placeholder="kvdirect:budget=16:mode=fast",
            elem_id="kvd-extra",
            info="name[:key=value]…, or a class of your own: PATH.py:Class[:key=value]… (not on a "
            "hosted Space); budget/spacing/mode above fill in what a spec leaves unset.",
        )
    return Controls(
        preset, custom, device, dtype, picked, extra, budget_s, spacing, mode, rebuild, max_new, twins, kernels
    )


def recordings_picker(first: Session):
    """The sidebar's recordings: the shipped ones in a picker, the pace, a file of one's own."""
    choices = playback.offered()
    picker = gr.Dropdown(
        choices,
        value=playback.first_name(),
        label="Recorded runs",
        elem_id="kvd-recordings",
        info="played back at the recorded pace (or faster); every number is the recorded one",
    )
    speed = gr.Radio(list(playback.SPEEDS), value=playback.DEFAULT_SPEED, label="Replay speed", elem_id="kvd-speed")
    upload = gr.UploadButton(
        "Open a recording file (.json / .json.gz)",
        file_types=[".json", ".gz"],
        file_count="single",
        type="filepath",
        variant="secondary",
        elem_id="kvd-upload",
        visible=not hosted(),
    )  # a hosted demo opens no visitor's file (`RecordingButtons.replay`)
    return picker, speed, upload
