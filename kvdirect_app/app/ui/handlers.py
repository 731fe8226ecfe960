"""What the buttons do.  Generators stream dict updates {component: value} drawn from the Session.

`Handlers` draws the page from a session, frees a closed tab's, and holds one part per reason: the turn's
buttons (`turn_buttons`: send, regenerate, a scenario, stop), the place in line, loading a model, the recordings'
buttons and the frontier's drawing.
"""

from __future__ import annotations

import logging
import time
import traceback
import weakref
from typing import Iterator

import gradio as gr

from ...plain.hosted import hosted
from . import playback, runner, views
from .components import Studio
from .export import write_exports
from .frontier_drawing import FrontierDrawing
from .line import LINE, Queueing
from .model_choice import ModelChoice, regenerable
from .plots import all_figures
from .recording_buttons import RecordingButtons
from .scoreboard import scoreboard_html
from .session import Session
from .token_map_tab import attention_plot, map_pair_html
from .turn_buttons import TurnButtons

__all__ = ["Handlers", "forget", "session_ttl_s"]
log = logging.getLogger(__name__)


_NONE = object()  # nothing sent yet


def _plain(value) -> bool:
    """A value a later update can be compared with (text, a chat's messages), not a component's update."""
    return isinstance(value, (str, list))


def session_ttl_s() -> int:
    """An idle session's engine and caches are freed after this long (Gradio's state time-to-live)."""
    return 15 * 60 if hosted() else 2 * 3600


def forget(session: Session):
    """A session's state expired or its tab closed: stop its run, drop its engine and caches (the page's state's
    `delete_callback`)."""
    if isinstance(session, Session):
        LINE.leave(session)
        if not session.busy:
            session.clear()
            runner.release_memory()
        # Its turn and its frontier drawing end after their step (after `clear`, which would lower the flags): a
        # drawing of a closed tab ran on for minutes (it yields nothing while a run computes, so Gradio never closes
        # it), holding the compute thread from everyone.
        session.stop_requested = session.frontier_cancel = True


class Handlers:
    """Every button's handler: drawing the page, clear and the token map here, each other reason in a part it holds,
    given what that part uses: `turn_buttons` (`turn_buttons.TurnButtons`: send, regenerate, a scenario, stop),
    `queueing` (`line.Queueing`: the place in line), `model_choice` (`model_choice.ModelChoice`: loading a model),
    `recording_buttons` (`recording_buttons.RecordingButtons`: replaying a recording, running it live) and
    `frontier_drawing` (`frontier_drawing.FrontierDrawing`).  The parts' handlers are named here too (`self.load_model`,
    ...), as the page wires them (`layout._wire`) and the tests call them."""

    def __init__(self, studio: Studio, demo: gr.Blocks | None = None):
        self.s, self.demo = studio, demo
        self.visitors: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()
        self.queueing = Queueing(seen=self._seen)
        self.model_choice = ModelChoice(studio, seen=self._seen)
        self.turn_buttons = TurnButtons(studio, seen=self._seen, refuse=self._refuse, render=self.render)
        self.recording_buttons = RecordingButtons(
            studio, seen=self._seen, refuse=self._refuse, render=self.render, run=self.turn_buttons.run
        )
        self.frontier_drawing = FrontierDrawing(studio)
        self.enqueue, self.waiting = self.queueing.enqueue, self.queueing.waiting
        self.load_model = self.model_choice.load_model
        t = self.turn_buttons
        self.send, self.regenerate, self.stop, self.next_send = t.send, t.regenerate, t.stop, t.next_send
        self.play_scenario, self.play_recall = t.play_scenario, t.play_recall
        self.replay, self.run_live = self.recording_buttons.replay, self.recording_buttons.run_live
        self.frontier, self.cancel_frontier = self.frontier_drawing.frontier, self.frontier_drawing.cancel_frontier

    # --- visitors --------------------------------------------------------------
    def _seen(self, session: Session, request: gr.Request | None):
        if request is not None and getattr(request, "session_hash", None):
            self.visitors[request.session_hash] = session

    def closed(self, request: gr.Request):
        """The tab was closed: free what its session holds now.  Gradio would keep the session's copy of the page
        (every component's last value: plots, chats) for an hour in case the tab comes back; a closed demo tab
        does not, so that copy goes too."""
        key = getattr(request, "session_hash", None) or ""
        session = self.visitors.pop(key, None)
        if session is not None:
            forget(session)
        holder = getattr(self.demo, "state_holder", None)
        if holder is not None and key in getattr(holder, "session_data", {}):
            with holder.lock:
                holder.session_data.pop(key, None)
                holder.time_last_used.pop(key, None)

    # --- drawing ---------------------------------------------------------------
    def render(
        self,
        session: Session,
        *,
        busy: bool,
        message: str | None = None,
        kind: str = "info",
        plots: bool = False,
        final: bool = False,
        live: bool = False,
    ) -> dict:
        """The page drawn from `session`.  `live`: an update streamed while a run computes, as light as it can be:
        only what changed since the last update (a pane's chat and header, the scoreboard, the status, the panes'
        boxes where panes joined or left) and the plots when due; the buttons and controls keep the state the
        run's first update gave them.  Each update shares the two cores with the engine (Gradio's serialising,
        the browser's drawing)."""
        out = self._draw(session, busy=busy, message=message, kind=kind, plots=plots, final=final)
        if not live:
            session.sent = {key: value for key, value in out.items() if _plain(value)}
            session.sent_shown = tuple(session.shown)
            return out
        changed, keys = {}, self._live_keys(session)
        for key, value in out.items():
            if key in keys and (key is self.s.views.status or session.sent.get(key, _NONE) != value):
                changed[key] = value
                if _plain(value):
                    session.sent[key] = value
        return changed

    def _live_keys(self, session: Session) -> set:
        """What a live update may carry: the visible panes' chats and headers, the panes' boxes while panes join or
        leave, the scoreboard, the status and the plots."""
        v = self.s.views
        keys = {v.board, v.status, v.memory, v.latency, v.agreement}
        for pane in self.s.panes:
            keys |= {pane.chat, pane.head}
        if tuple(session.shown) != session.sent_shown:
            keys |= {pane.box for pane in self.s.panes}
            session.sent_shown = tuple(session.shown)
        return keys

    def _draw(self, session: Session, *, busy: bool, message, kind: str, plots: bool, final: bool) -> dict:
        a, v = self.s.actions, self.s.views
        out = {}
        for i, pane in enumerate(self.s.panes):
            if i < len(session.shown):
                label = session.shown[i]
                out[pane.box] = gr.Column(visible=True)
                out[pane.head] = views.pane_header(session, label)
                out[pane.chat] = views.messages(session, label)
            else:
                out[pane.box] = gr.Column(visible=False)
        r = self.s.recordings
        for button in (a.send, a.clear, a.play, a.recall, r.replay, r.live):
            out[button] = gr.Button(interactive=not busy)
        out[a.regenerate] = gr.Button(interactive=regenerable(session, busy))
        out[r.line] = views.recording_line(session)
        out[r.live] = gr.Button(interactive=not busy, visible=bool(session.recording))  # reruns what is on screen
        c = self.s.controls
        for control in (c.model, c.custom_model, c.device, c.dtype):  # no model switch while a turn streams
            out[control] = gr.update(interactive=not busy)
        out[v.board] = scoreboard_html(session)
        out[a.stop] = gr.Button(interactive=busy)
        out[a.prompt] = gr.Textbox(interactive=not busy)
        if message is not None:
            out[v.status] = views.status(message, kind)
        figures = None
        if plots:
            t0 = time.monotonic()
            figures = all_figures(session)
            out[v.memory], out[v.latency], out[v.agreement] = (
                figures["memory"],
                figures["latency"],
                figures["agreement"],
            )
            session.last_plot = time.monotonic()
            session.plot_cost = session.last_plot - t0
        if final:
            label, other, layer = views.telling_view(session, self._maps(session))
            out[v.map_label] = gr.Dropdown(choices=session.shown, value=label)
            out[v.map_other] = gr.Dropdown(choices=session.shown, value=other)
            out[v.token_map] = self._token_map_html(session, label, layer, other)
            out[v.attention] = attention_plot(session, label, layer)
            out[v.map_layer] = gr.Slider(value=layer)
            out.update(self._downloads(session, figures))
        return out

    @staticmethod
    def _maps(session: Session) -> dict | None:
        """Every pane's token map at every layer, where it is at hand (a recording, a ZeroGPU run), else None."""
        if session.token_maps is not None:
            return session.token_maps
        return None

    def _downloads(self, session: Session, figures: dict | None = None) -> dict:
        v = self.s.views
        buttons = (v.download_json, v.download_steps, v.download_summary, v.download_plots, self.s.recordings.download)
        if session.result is None:
            return {b: gr.DownloadButton(value=None, interactive=False) for b in buttons}
        try:
            paths = write_exports(session, figures)
        except Exception as e:  # a download that cannot be written must not break the page
            log.error("writing the exports failed:\n%s", traceback.format_exc())
            gr.Warning(f"The downloads could not be written: {type(e).__name__}: {str(e)[:200]}")
            return {b: gr.DownloadButton(value=None, interactive=False) for b in buttons}
        return {
            b: gr.DownloadButton(value=paths.get(k), interactive=k in paths)
            for b, k in zip(buttons, ("json", "steps", "summary", "plots", "recording"))
        }

    def _token_map_html(self, session: Session, label: str | None, layer: int, other: str | None = None) -> str:
        if label is None or session.busy:
            return views.token_map_html(None, "", 0)
        return map_pair_html(session, label, layer, other)

    def _refuse(self, session: Session, message: str) -> Iterator[dict]:
        gr.Warning(message)
        yield {self.s.views.status: views.status(message, "error")}

    def clear(self, session: Session) -> dict:
        session.pending = None
        if session.busy:
            gr.Warning("A turn is still running: press Stop first.")
            return {self.s.views.status: views.status("A turn is still running: press Stop first.", "error")}
        session.clear()
        return self.render(
            session, busy=False, message="Cleared. Type a message to start a new conversation.", plots=True, final=True
        )

    def token_map(self, session: Session, label: str | None, layer: int, other: str | None = None) -> tuple:
        """The token maps of `label` (beside `other`) at `layer`, and the attention snapshot there."""
        playback.unfold(session)
        return (
            self._token_map_html(session, label, layer, other),
            attention_plot(session, None if session.busy else label, layer),
        )
