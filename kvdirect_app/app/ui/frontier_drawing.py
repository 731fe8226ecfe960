"""The Frontier tab's drawing: every ticked strategy at a few budgets on one conversation, run after run, said to
whoever waits for the slot, cancellable (a part `handlers.Handlers` holds)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Iterator

import gradio as gr

from ...plain.scenarios import scenarios
from . import playback, runner, views
from .components import Studio
from .line import FRONTIER_JOB, LINE, Job
from .session import Session
from .settings import Settings

log = logging.getLogger(__name__)
FRONTIER_CURRENT = "this conversation"
FRONTIER_BUDGETS = (16, 64)
POLL_S = 0.2  # how often the drawing looks whether its Cancel was pressed while a run computes


@dataclass(eq=False)  # compared and hashed by identity: Gradio holds its bound methods as handlers
class FrontierDrawing:
    """Draw the frontier, and cancel the drawing."""

    studio: Studio  # the page's components (the Frontier tab's)

    # --- the frontier ----------------------------------------------------------
    def frontier(self, session: Session, source: str, **controls) -> Iterator[dict]:
        """Every ticked strategy at a few settings on one conversation, run after run; the frontier plot when done
        (or, cancelled, of the runs done).  Whoever waits for the slot meanwhile is told it is the frontier drawing
        and how far it is; its Cancel ends it after the step in progress."""
        f = self.studio.frontier
        busy = lambda message: {
            f.status: views.status(message, "busy"),
            f.draw: gr.Button(interactive=False),
            f.cancel: gr.Button(interactive=True),
        }
        done = lambda message, kind: {
            f.status: views.status(message, kind),
            f.draw: gr.Button(interactive=True),
            f.cancel: gr.Button(interactive=False),
        }
        session.asked = None
        if session.busy:
            yield done("A turn is still running: wait for it or press Stop.", "error")
            return
        playback.unfold(session)
        known = isinstance(source, str) and (source == FRONTIER_CURRENT or source in scenarios())
        turns = (
            []
            if not known
            else list(session.user_turns)
            if source == FRONTIER_CURRENT
            else list(scenarios()[source]["turns"])
        )
        if not turns:
            yield done(
                "Nothing to draw yet: send a message first, or choose a scenario."
                if source == FRONTIER_CURRENT
                else f"scenario: unknown {str(source)[:40]!r}; allowed: {FRONTIER_CURRENT}, {', '.join(scenarios())}",
                "error",
            )
            return
        try:
            settings = Settings.from_controls(controls)
            config = settings.run_config()
            plan = runner.frontier_plan(config, settings, FRONTIER_BUDGETS)
        except runner.USER_ERRORS as e:
            yield done(str(e), "error")
            return
        sweep = runner.frontier_run(config, turns)
        rows = []
        t0 = time.monotonic()
        session.frontier_cancel = False
        job = LINE.started(Job(FRONTIER_JOB, session))
        cancelled = False
        try:
            for i, entries in enumerate(plan):
                left = "" if not i else f", about {runner.duration((time.monotonic() - t0) / i * (len(plan) - i))} left"
                job.doing = f"run {i + 1} of {len(plan)}{left}"
                yield busy(f"Run {i + 1}/{len(plan)}: {len(entries)} strategies on {len(turns)} turn(s){left}…")
                ran = yield from self._run(session, sweep, entries, busy)
                if ran is None:
                    cancelled = True
                    break
                rows += ran
        except runner.USER_ERRORS as e:
            yield done(str(e), "error")
            return
        except Exception as e:  # the app stays up; the message says what broke
            log.error("frontier failed:\n%s", traceback.format_exc())
            yield done(f"Frontier failed: {type(e).__name__}: {e}", "error")
            return
        finally:
            LINE.ended(job)
        took = time.monotonic() - t0
        if cancelled:
            words = (
                f"Cancelled after {len(rows)} point(s) of {sum(map(len, plan))} ({took:.0f} s): the points of "
                "the runs that finished are drawn."
                if rows
                else f"Cancelled before a run finished ({took:.0f} s)."
            )
            yield {**done(words, "ok"), **({f.plot: runner.frontier_plot(rows, sweep, source)} if rows else {})}
            return
        yield {
            **done(f"{len(rows)} points from {len(plan)} runs in {took:.0f} s.", "ok"),
            f.plot: runner.frontier_plot(rows, sweep, source),
        }

    def _run(self, session: Session, sweep, entries: list[tuple], busy) -> Iterator[dict]:
        """One lockstep run on the compute thread (`runner.compute`, where every engine runs); its rows, or None
        when Cancel (or the reader going away) ended it.  The drawing is the only writer of its status line: the
        Cancel button only sets a flag, and this says "Cancelling…" when it sees it, so no answer of the button's
        can arrive after the drawing's last word and overwrite it."""
        gone = threading.Event()
        future = runner.compute().submit(sweep.run, entries, lambda: session.frontier_cancel or gone.is_set())
        told = False
        try:
            while not concurrent.futures.wait([future], timeout=POLL_S).done:
                if session.frontier_cancel and not told:
                    told = True
                    yield {
                        **busy("Cancelling after the step in progress…"),
                        self.studio.frontier.cancel: gr.Button(interactive=False),
                    }
        finally:  # also when Gradio closes the drawing (the visitor left): the run ends after its step
            gone.set()
            concurrent.futures.wait([future])
        return future.result()

    def cancel_frontier(self, session: Session) -> None:
        """The frontier drawing ends after the step in progress (its finished runs are drawn); the drawing says so
        on its status line."""
        if any(job.owner is session and job.what == FRONTIER_JOB for job in list(LINE.jobs)):
            session.frontier_cancel = True
