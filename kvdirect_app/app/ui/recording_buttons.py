"""The recordings' buttons: play a recording (shipped or uploaded) as it was recorded, or run its conversation live
here (a part `handlers.Handlers` holds)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import gradio as gr

from ...plain.hosted import hosted
from ...plain.recording import RecordingError, describe
from ...plain.scenarios import scenarios
from . import playback, runner, views
from .components import Studio
from .pace import PLOTS_EVERY_S, UI_EVERY_S
from .session import Session
from .settings import Settings

RECALL = "recall"  # the scenario the Recall demo button plays (and Run it live without a recording)


@dataclass(eq=False)  # compared and hashed by identity: Gradio holds its bound methods as handlers
class RecordingButtons:
    """▶ Replay it (a recording's events folded into the session at its pace) and ▶ Run it live."""

    studio: Studio  # the page's components (the status line)
    seen: Callable[[Session, gr.Request | None], None]  # notes a visitor's session (`Handlers._seen`)
    refuse: Callable[[Session, str], Iterator[dict]]  # warns and says why in the status (`Handlers._refuse`)
    render: Callable[..., dict]  # the page drawn from the session (`Handlers.render`)
    run: Callable[..., Iterator[dict]]  # checks a run, then streams it (`TurnButtons.run`)

    # --- recordings ------------------------------------------------------------
    def replay(
        self, session: Session, choice: str | None, speed: str, upload: str | None = None, request: gr.Request = None
    ) -> Iterator[dict]:
        """Play a recording (a shipped one by name, or an uploaded file) at `speed`: the recorded events folded
        into this session exactly as the live run folded them; nothing is recomputed.  A live conversation on screen
        is replaced only when asked twice: the first time the status says what would be lost."""
        self.seen(session, request)
        again, session.asked = session.asked == ("replay", bool(upload)), None
        if session.busy:
            yield from self.refuse(session, "A turn is still running: wait for it or press Stop.")
            return
        if speed not in playback.SPEEDS:
            yield from self.refuse(
                session, f"speed: {str(speed)[:40]!r} is not allowed; allowed: {', '.join(playback.SPEEDS)}"
            )
            return
        if upload and hosted():  # the button is hidden there; a request that sends a file anyway is refused
            yield from self.refuse(
                session, "Opening a recording file is off on this hosted demo; pick one of the recorded runs."
            )
            return
        try:
            recording = playback.open_recording(choice, upload)
        except RecordingError as e:
            yield from self.refuse(session, str(e))
            return
        if session.user_turns and session.recording is None and not again:
            session.asked = ("replay", bool(upload))
            how = "Upload it again" if upload else "Press ▶ Replay it again"
            yield {
                self.studio.views.status: views.status(
                    f"Replaying would replace this conversation: its {len(session.user_turns)} live turn(s) and "
                    f"{session.steps} steps on {session.config.model if session.config else 'this model'} "
                    f"(the Export tab keeps them as files). {how} to replace it.",
                    "info",
                )
            }
            return
        playback.start(session, recording)
        session.busy, session.stop_requested = True, False
        about = describe(recording["meta"])
        yield self.render(session, busy=True, message=f"Replaying {about} at {speed}…", kind="busy", plots=True)
        last, stopped, pace = 0.0, False, playback.SPEEDS[speed]
        try:
            for event in playback.paced(recording, pace, lambda: session.stop_requested):
                session.apply(event)
                now = time.monotonic()
                if pace and (event["type"] in ("turn", "turn_end") or now - last >= UI_EVERY_S):
                    plots = event["type"] == "turn_end" or now - session.last_plot >= PLOTS_EVERY_S
                    yield self.render(
                        session,
                        busy=True,
                        plots=plots,
                        live=True,
                        kind="busy",
                        message=f"Replaying ({speed}): turn {len(session.user_turns)}, step "
                        f"{session.steps}; every number is the recorded one",
                    )
                    last = now
            stopped = session.stop_requested
        finally:
            session.busy = False
            playback.finish(session)
        message = (
            f"Replay stopped at step {session.steps}."
            if stopped
            else f"Replayed: {about}. Every number is the recorded one; ▶ Run it live runs it on this machine."
        )
        yield self.render(session, busy=False, message=message, kind="ok", plots=True, final=True)

    def run_live(self, session: Session, request: gr.Request = None, **controls) -> Iterator[dict]:
        """The conversation of the recording on screen (or the recall scenario), live on this machine with the
        sidebar's settings; says where they differ from the recording's."""
        self.seen(session, request)
        session.asked = None
        playback.unfold(session)
        meta = session.recording or {}
        turns = list(meta.get("turns") or scenarios().get(RECALL, {}).get("turns", []))
        if not turns:
            yield from self.refuse(session, "Nothing to run: open a recording first.")
            return
        expect = tuple(meta["expect"]) if meta.get("expect") else None
        scenario = meta.get("scenario")
        if not meta:
            chosen = scenarios().get(RECALL, {})
            expect, scenario = ((len(turns) - 1, chosen["expect"]) if chosen.get("expect") else None), RECALL
        try:
            specs = Settings.from_controls(controls).specs()
        except runner.USER_ERRORS:
            specs = []
        differs = [s for s in specs if meta.get("specs") and s not in meta["specs"]]
        note = (
            f"Running “{scenario or 'the recording'}” live here: {len(turns)} turns"
            + (f"; the sidebar's settings differ from the recording's ({', '.join(differs)})" if differs else "")
            + "…"
        )
        yield from self.run(
            session, controls, turns, bool(meta.get("raw", False)), True, lambda _: note, None, expect, scenario
        )
