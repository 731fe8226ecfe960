"""Who waits for the run slot and what holds it: a place in line per session, said at once and kept up to date
(`Queueing`), and what each running job is doing (a turn's step, the frontier drawing's run)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import gradio as gr

from ...plain.hosted import hosted
from ...plain.limits import limits
from . import views
from .session import Session

FRONTIER_JOB = "the frontier drawing"
WAITING_EVERY_S = 1.0  # a waiting visitor's place in line is said again this often
MAX_WAITING = 24  # runs waiting in line beyond which a new one is refused as busy (hosted: 8)


class Job:
    """What holds the run slot now, in a visitor's words: "a turn of 7 panes" or "the frontier drawing", and how
    far it is (the runner updates `doing`: "step 30 of at most 64, about 20 s left")."""

    def __init__(self, what: str, owner: Session | None = None):
        self.what, self.owner, self.doing = what, owner, "starting"

    def words(self, session: Session | None) -> str:
        whose = " (yours)" if session is not None and self.owner is session else ""
        return f"{self.what}{whose}: {self.doing}"


class Line:
    """Who waits for the one run slot: a place in line per session, said at once when a run is asked for and kept
    up to date while it waits (`waiting`).

    Gradio's queue runs the runs (a turn, a frontier drawing); this counts them and says what holds the slot, so
    that a visitor sees "waiting for the frontier drawing, run 3 of 8, about 2 min left" (or "busy") instead of a
    silent wait.  A ticket leaves when its run starts, when its session closes, or after an hour.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.tickets: dict[int, float] = {}  # id(session) -> when it joined (insertion order is the line)
        self.running = 0
        self.jobs: list[Job] = []  # what runs now (oldest first)
        self.took: list[float] = []  # seconds of the last runs, for the expected wait
        self.begun: list[float] = []

    def join(self, session: Session) -> tuple[int, int]:
        """(runs ahead, runs running); raises gr.Error when the line is full."""
        now = time.monotonic()
        with self.lock:
            for key, since in list(self.tickets.items()):
                if now - since > 3600:
                    del self.tickets[key]
            limit = 8 if hosted() else MAX_WAITING
            if id(session) not in self.tickets and len(self.tickets) >= limit:
                raise gr.Error(
                    f"The demo is busy: {len(self.tickets)} runs are waiting. Try again in a minute.",
                    print_exception=False,
                )
            self.tickets.setdefault(id(session), now)
            ahead = list(self.tickets).index(id(session))
            return ahead, self.running

    def leave(self, session: Session):
        with self.lock:
            self.tickets.pop(id(session), None)

    def waits(self, session: Session) -> bool:
        with self.lock:
            return id(session) in self.tickets

    def started(self, job: Job | None = None) -> Job:
        job = job or Job("a run")
        with self.lock:
            self.running += 1
            self.begun.append(time.monotonic())
            self.jobs.append(job)
        return job

    def ended(self, job: Job | None = None):
        with self.lock:
            self.running -= 1
            if job in self.jobs:
                self.jobs.remove(job)
            if self.begun:
                self.took = (self.took + [time.monotonic() - self.begun.pop(0)])[-10:]

    def words(self, session: Session) -> str | None:
        """Where `session` stands, said for it: what holds the slot now, how many wait ahead, the expected wait;
        None once its run has started (or it left the line)."""
        with self.lock:
            if id(session) not in self.tickets:
                return None
            ahead = list(self.tickets).index(id(session))
            jobs = list(self.jobs)
            running = self.running
        if not jobs and not ahead:
            return "Starting…"
        holding = "; ".join(job.words(session) for job in jobs) or "a run that is starting"
        line = f"Waiting for {holding}." + (f" Then {ahead} run(s) ahead of yours." if ahead else " Yours is next.")
        if any(job.owner is session and job.what == FRONTIER_JOB for job in jobs):
            line += " Cancel the drawing on the Frontier tab to go first."
        return line + self.expected_wait(ahead, running)

    def expected_wait(self, ahead: int, running: int) -> str:
        """What a queued visitor can expect, from the last runs' measured durations (capped by the time budget)."""
        budget = limits().run_seconds
        with self.lock:
            typical = sorted(self.took)[len(self.took) // 2] if self.took else None
        if typical is None and budget is None:
            return " Your run starts when they finish."
        each = min(typical, budget) if typical is not None and budget is not None else (typical or budget)
        basis = (
            f"the last {len(self.took)} run(s) took about {typical:.0f} s each"
            if typical is not None
            else "no run has finished yet"
        )
        cap = f"; each run here stops after {budget:.0f} s" if budget else ""
        return f" Expected wait: about {(ahead + running) * each:.0f} s ({basis}{cap})."


LINE = Line()


@dataclass(eq=False)  # compared and hashed by identity: Gradio holds its bound methods as handlers
class Queueing:
    """The handlers that say where a run stands in line (a part `handlers.Handlers` holds)."""

    seen: Callable[[Session, gr.Request | None], None]  # notes a visitor's session (`Handlers._seen`)

    def enqueue(self, session: Session, request: gr.Request = None) -> str:
        """Said the moment a run is asked for: where it stands in line (`waiting` keeps it up to date)."""
        self.seen(session, request)
        if session.busy:
            return views.status("A turn is still running: wait for it or press Stop.", "error")
        LINE.join(session)
        return self._waiting_status(session) or views.status("Starting…", "busy")

    @staticmethod
    def _waiting_status(session: Session) -> str | None:
        words = LINE.words(session)
        if words is None:
            return None
        if words != "Starting…":
            words += " Meanwhile, ▶ Replay it plays a recorded run at once."
        return views.status(words, "busy")

    def waiting(self, session: Session) -> Iterator[str]:
        """While this session's run waits for the slot: its place, what holds the slot and how far that is, every
        second; nothing once its run has started."""
        said = None
        while True:
            time.sleep(WAITING_EVERY_S)
            now = self._waiting_status(session)
            if now is None:
                # Leave the line as the run left it.  A generator that ends having yielded nothing hands Gradio no
                # value, and the page then blanked the status: a refused Send's reason vanished a second later.
                yield gr.skip()
                return
            if now != said:
                said = now
                yield now
