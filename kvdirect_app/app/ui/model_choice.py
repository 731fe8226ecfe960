"""The model choice: loading a model from the page, saying where it came from, and which run buttons can act
(a part `handlers.Handlers` holds)."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator

import gradio as gr

from .. import service
from . import playback, runner, views
from .components import Studio
from .geometry_panel import geometry_html, memory_banner, memory_words
from .session import Session
from .settings import model_note

log = logging.getLogger(__name__)


@dataclass(eq=False)  # compared and hashed by identity: Gradio holds its bound methods as handlers
class ModelChoice:
    """Loading the chosen model (`load_model`) and the buttons a ready model enables."""

    studio: Studio  # the page's components (the status, the controls, the panes, the run buttons)
    seen: Callable[[Session, gr.Request | None], None]  # notes a visitor's session (`Handlers._seen`)
    loads: Iterator[int] = field(default_factory=lambda: itertools.count(1))  # each choice's number: the newest speaks

    # --- the model -------------------------------------------------------------
    def load_model(self, session: Session, request: gr.Request = None, **controls) -> Iterator[dict]:
        c, v = self.studio.controls, self.studio.views
        self.seen(session, request)
        session.asked = None
        number = session.load_number = next(self.loads)
        if session.busy:
            yield {v.status: views.status("A turn is running: the model cannot change now. Press Stop first.", "error")}
            return
        try:
            name = service.check_model_name((controls.get("custom_model") or "").strip() or controls.get("model"))
            device, dtype = service.check_device_dtype(controls.get("device"), controls.get("dtype"))
        except runner.USER_ERRORS as e:
            yield {v.status: views.status(str(e), "error")}
            return
        yield {v.status: views.status(f"Loading {name} on {device} ({dtype})…", "busy")}
        heard: list[str] = []
        box: dict = {}

        def work():
            try:
                box["info"] = service.load(name, dtype=dtype, device=device, progress=heard.append)
            except BaseException as e:  # handed to the handler's thread below
                box["error"] = e

        t0 = time.monotonic()
        loader = runner.compute().submit(work)
        while not loader.done():
            concurrent.futures.wait([loader], timeout=0.5)
            if not loader.done() and session.load_number == number:
                doing = views.without_paths(heard[-1]) if heard else f"loading {name}"
                yield {v.status: views.status(f"{doing[:1].upper()}{doing[1:]}… {time.monotonic() - t0:.0f} s", "busy")}
        error = box.get("error")
        if isinstance(error, runner.USER_ERRORS):
            message, kind = str(error), "error"
        elif error is not None:  # e.g. an architecture transformers cannot build: say so, stay up
            log.error(
                "loading %s failed:\n%s",
                name,
                "".join(traceback.format_exception(type(error), error, error.__traceback__)),
            )
            message, kind = f"Cannot load {name}: {type(error).__name__}: {str(error)[:200]}", "error"
        else:
            info, message, kind = box["info"], None, "ok"
        if session.load_number != number:  # a newer choice was made while this one loaded: it speaks instead
            return
        if message is not None:
            yield {v.status: views.status(message, kind)}
            return
        L = info["layers"]
        # The status names where the weights came from (a package or a Hub copy: never a silent fallback), and says
        # when the model continues text instead of chatting.
        note = f" {model_note(name).capitalize()}." if model_note(name) else ""
        earlier = len(session.user_turns)
        then = (
            f" Your next message replays the {earlier} earlier turn(s) on it first (Clear starts afresh)."
            if earlier and session.config is not None and session.config.model != name
            else " Type a message, or press Recall demo."
        )
        yield {
            v.geometry: geometry_html(name, info["geometry"], info["dtype"]),
            v.banner: views.header_html(memory_banner(name, info["geometry"])),
            **self._panes_told(session, name, info["geometry"]),
            v.map_layer: gr.Slider(maximum=L - 1),
            # Cascade replay runs every layer once whatever the spacing, so the deepest spacing (token ids only,
            # 4 bytes per token) saves the most memory at the same compute; it is >= the break-even s*.
            c.spacing: gr.Slider(maximum=L, value=L),
            v.status: views.status(
                f"{name} ready on {info['device']} ({L} layers), loaded from "
                f"{views.without_paths(info['source'])}.{note}{then}",
                "ok",
            ),
            **self._runs_enabled(session),
        }

    def _panes_told(self, session: Session, name: str, facts: dict) -> dict:
        """Keep what the exact strategies hold on the loaded model (`memory_words`) and redraw the pane heads that
        say it (the panes of a run on this model)."""
        session.memory_words = (name, memory_words(name, facts))
        playback.unfold(session)  # the first screen's recording, whose panes say it too
        return {pane.head: views.pane_header(session, label) for pane, label in zip(self.studio.panes, session.shown)}

    def _runs_enabled(self, session: Session) -> dict:
        """The buttons that start a run, shown disabled until a model is ready (a click before it would only wait)."""
        a, r = self.studio.actions, self.studio.recordings
        return {
            **{b: gr.Button(interactive=not session.busy) for b in (a.send, a.recall, a.play, r.live)},
            a.regenerate: gr.Button(interactive=regenerable(session, session.busy)),
        }


def regenerable(session: Session, busy: bool) -> bool:
    """Regenerate can act: a live conversation to replay, nothing running (before a turn it would only say
    "nothing to regenerate yet"; on a recording, that it is one)."""
    return not busy and bool(session.user_turns) and not session.recording
