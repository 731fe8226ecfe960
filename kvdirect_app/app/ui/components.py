"""The page's components, grouped in small dataclasses: built by `layout`, read and updated by `handlers`."""

from __future__ import annotations

from dataclasses import dataclass, fields

import gradio as gr


@dataclass
class Pane:
    """One strategy's column: header with live figures, and its chat."""

    box: gr.Column
    head: gr.HTML
    chat: gr.Chatbot


@dataclass
class Controls:
    """Every setting of a run; handlers receive them by these names (`Settings` fields)."""

    model: gr.Dropdown
    custom_model: gr.Textbox
    device: gr.Dropdown
    dtype: gr.Dropdown
    strategies: gr.CheckboxGroup
    extra_specs: gr.Textbox
    budget: gr.Slider
    spacing: gr.Slider
    mode: gr.Radio
    rebuild: gr.Radio
    max_new_tokens: gr.Slider
    twins: gr.Checkbox
    kernels: gr.Radio

    def by_name(self, *names: str) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if not names or f.name in names}


@dataclass
class Actions:
    prompt: gr.Textbox
    send: gr.Button
    stop: gr.Button
    regenerate: gr.Button
    clear: gr.Button
    scenario: gr.Dropdown
    play: gr.Button
    recall: gr.Button  # the recall scenario, one click from the prompt
    next: gr.HTML  # what the next Send will replay, said as soon as a setting changes (`TurnButtons.next_send`)


@dataclass
class Recordings:
    """Recorded runs: the one on screen in a line, the shipped ones in a picker, a file of one's own, the pace."""

    line: gr.HTML  # what the recording on screen shows, recorded where and when
    picker: gr.Dropdown
    speed: gr.Radio
    upload: gr.UploadButton
    replay: gr.Button  # "▶ Replay it": the picked recording at the chosen pace
    live: gr.Button  # "▶ Run it live": the same conversation on this machine, with the sidebar's settings
    download: gr.DownloadButton  # the Export tab's recording of the run on screen


@dataclass
class Views:
    status: gr.HTML
    board: gr.HTML  # the scoreboard: every pane's verdict, memory and speed on the first screen
    memory: gr.Plot
    latency: gr.Plot
    agreement: gr.Plot
    map_label: gr.Dropdown
    map_other: gr.Dropdown  # a second strategy's map beside the first
    map_layer: gr.Slider
    token_map: gr.HTML
    attention: gr.Plot  # the question's last query: full cache against the map's strategy, its evicted tokens marked
    geometry: gr.HTML
    download_json: gr.DownloadButton
    download_steps: gr.DownloadButton
    download_summary: gr.DownloadButton
    download_plots: gr.DownloadButton
    banner: gr.HTML  # the header: its memory line is the loaded model's (`geometry_panel.memory_banner`)


@dataclass
class FrontierTab:
    """The trade-off frontier: which conversation, the buttons (draw, cancel), progress, the figure."""

    source: gr.Dropdown
    draw: gr.Button
    cancel: gr.Button
    status: gr.HTML
    plot: gr.Plot


@dataclass
class Studio:
    session: gr.State
    controls: Controls
    actions: Actions
    views: Views
    panes: list[Pane]
    frontier: FrontierTab
    recordings: Recordings

    def outputs(self) -> list:
        c, r = self.controls, self.recordings
        parts = [c.spacing, c.model, c.custom_model, c.device, c.dtype]  # the model's controls lock during a turn
        parts += [r.line, r.replay, r.live, r.download]
        for group in (self.actions, self.views):
            parts += [getattr(group, f.name) for f in fields(group) if f.name != "scenario"]
        for pane in self.panes:
            parts += [pane.box, pane.head, pane.chat]
        return parts
