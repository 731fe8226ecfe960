"""What the buttons do.  Generators stream dict updates {component: value} drawn from the Session.

A turn runs on the session's engine; a change of settings (or a regenerate)
builds a new engine and replays the conversation, which greedy decoding makes
identical.  Stop sets a flag that the engine's own thread (`runner.Pump`) checks
between steps, so the turn is always closed cleanly, on the thread that opened it, after the step Stop named.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
import traceback
import weakref
from typing import Callable, Iterator

import gradio as gr

from .. import service
from ..hosted import hosted
from ..limits import limits
from ..units import fmt_bytes
from ..scenarios import scenarios
from ..recording import RecordingError, describe
from . import playback, runner, views
from .components import Studio
from .export import write_exports
from .geometry_panel import geometry_html, memory_banner, memory_words
from .plots import agreement_figure, latency_figure, memory_figure
from .scoreboard import scoreboard_html
from .session import Session
from .settings import RunConfig, Settings, model_note

log = logging.getLogger(__name__)
FRONTIER_CURRENT = "this conversation"
FRONTIER_BUDGETS = (16, 64)
# At most this often a streamed update (the first token of a turn always goes out).  An update re-sends every
# pane's chat, the scoreboard and the status, and Gradio's serialising and the browser's drawing share the cores
# with the engine: a 64-token turn of the seven default panes took 21-22 s from Send to Done at 0.12 s here
# (2-core CPU, Chromium on the same cores), 19.7-20.3 s at 0.5 s, 18.4 s at 1 s.
UI_EVERY_S = 0.5
HEARTBEAT_S = 5.0  # with no event for this long (a long message is read in pieces of minutes), the time is redrawn
LONG_PROMPT_TOKENS = 1000  # a run that reads more prompt tokens than this asks first, with its time and memory
PLOTS_EVERY_S = 2.0  # live plots at most this often during a turn ...
PLOTS_SHARE = 0.05  # ... and, when building them takes longer, never more than this share of the turn's time
RECALL = "recall"  # the scenario the Recall demo button plays
FRONTIER_JOB = "the frontier drawing"
WAITING_EVERY_S = 1.0  # a waiting visitor's place in line is said again this often
MAX_WAITING = 24  # runs waiting in line beyond which a new one is refused as busy (hosted: 8)


def session_ttl_s() -> int:
    """An idle session's engine and caches are freed after this long (Gradio's state time-to-live)."""
    return 15 * 60 if hosted() else 2 * 3600


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
                raise gr.Error(f"The demo is busy: {len(self.tickets)} runs are waiting. Try again in a minute.",
                               print_exception=False)
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
        basis = (f"the last {len(self.took)} run(s) took about {typical:.0f} s each" if typical is not None else
                 "no run has finished yet")
        cap = f"; each run here stops after {budget:.0f} s" if budget else ""
        return f" Expected wait: about {(ahead + running) * each:.0f} s ({basis}{cap})."


LINE = Line()


class Handlers:
    def __init__(self, studio: Studio | None, demo: gr.Blocks | None = None):
        self.s, self.demo = studio, demo
        self.visitors: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()
        self.loads = itertools.count(1)  # each model choice's number: only the newest may write the status

    # --- visitors --------------------------------------------------------------
    def _seen(self, session: Session, request: gr.Request | None):
        if request is not None and getattr(request, "session_hash", None):
            self.visitors[request.session_hash] = session

    @staticmethod
    def forget(session: Session):
        """A session's state expired or its tab closed: stop its run, drop its engine and caches."""
        if isinstance(session, Session):
            session.stop_requested = True
            LINE.leave(session)
            if not session.busy:
                session.clear()
                runner.release_memory()

    def closed(self, request: gr.Request):
        """The tab was closed: free what its session holds now.  Gradio would keep the session's copy of the page
        (every component's last value: plots, chats) for an hour in case the tab comes back; a closed demo tab
        does not, so that copy goes too."""
        key = getattr(request, "session_hash", None) or ""
        session = self.visitors.pop(key, None)
        if session is not None:
            self.forget(session)
        holder = getattr(self.demo, "state_holder", None)
        if holder is not None and key in getattr(holder, "session_data", {}):
            with holder.lock:
                holder.session_data.pop(key, None)
                holder.time_last_used.pop(key, None)

    def enqueue(self, session: Session, request: gr.Request = None) -> str:
        """Said the moment a run is asked for: where it stands in line (`waiting` keeps it up to date)."""
        self._seen(session, request)
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
                return
            if now != said:
                said = now
                yield now

    # --- drawing ---------------------------------------------------------------
    def render(self, session: Session, *, busy: bool, message: str | None = None, kind: str = "info",
               plots: bool = False, final: bool = False) -> dict:
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
        out[a.regenerate] = gr.Button(interactive=self._regenerable(session, busy))
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
            figures = {"memory": memory_figure(session), "latency": latency_figure(session),
                       "agreement": agreement_figure(session)}
            out[v.memory], out[v.latency], out[v.agreement] = figures["memory"], figures["latency"], figures["agreement"]
            session.last_plot = time.monotonic()
            session.plot_cost = session.last_plot - t0
        if final:
            label, other, layer = views.telling_view(session, self._maps(session))
            out[v.map_label] = gr.Dropdown(choices=session.shown, value=label)
            out[v.map_other] = gr.Dropdown(choices=session.shown, value=other)
            out[v.token_map] = self._token_map_html(session, label, layer, other)
            out[v.attention] = runner.attention_plot(session, label, layer)
            out[v.map_layer] = gr.Slider(value=layer)
            out.update(self._downloads(session, figures))
        return out

    def _panes_told(self, session: Session, name: str, facts: dict) -> dict:
        """Keep what the exact strategies hold on the loaded model (`memory_words`) and redraw the pane heads that
        say it (the panes of a run on this model)."""
        session.memory_words = (name, memory_words(name, facts))
        playback.unfold(session)  # the first screen's recording, whose panes say it too
        return {pane.head: views.pane_header(session, label)
                for pane, label in zip(self.s.panes, session.shown)}

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
        return {b: gr.DownloadButton(value=paths.get(k), interactive=k in paths)
                for b, k in zip(buttons, ("json", "steps", "summary", "plots", "recording"))}

    def _token_map_html(self, session: Session, label: str | None, layer: int, other: str | None = None) -> str:
        if label is None or session.busy:
            return views.token_map_html(None, "", 0)
        return runner.map_pair_html(session, label, layer, other)

    # --- the model -------------------------------------------------------------
    def load_model(self, session: Session, request: gr.Request = None, **controls) -> Iterator[dict]:
        c, v = self.s.controls, self.s.views
        self._seen(session, request)
        session.asked = None
        number = session.load_number = next(self.loads)
        if session.busy:
            yield {v.status: views.status("A turn is running: the model cannot change now. Press Stop first.",
                                          "error")}
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
                yield {v.status: views.status(f"{doing[:1].upper()}{doing[1:]}… {time.monotonic() - t0:.0f} s",
                                              "busy")}
        error = box.get("error")
        if isinstance(error, runner.USER_ERRORS):
            message, kind = str(error), "error"
        elif error is not None:  # e.g. an architecture transformers cannot build: say so, stay up
            log.error("loading %s failed:\n%s", name,
                      "".join(traceback.format_exception(type(error), error, error.__traceback__)))
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
        then = (f" Your next message replays the {earlier} earlier turn(s) on it first (Clear starts afresh)."
                if earlier and session.config is not None and session.config.model != name else
                " Type a message, or press Recall demo.")
        yield {
            v.geometry: geometry_html(name, info["geometry"], info["dtype"]),
            v.banner: views.header_html(memory_banner(name, info["geometry"])),
            **self._panes_told(session, name, info["geometry"]),
            v.map_layer: gr.Slider(maximum=L - 1),
            # Cascade replay runs every layer once whatever the spacing, so the deepest spacing (token ids only,
            # 4 bytes per token) saves the most memory at the same compute; it is >= the break-even s*.
            c.spacing: gr.Slider(maximum=L, value=L),
            v.status: views.status(f"{name} ready on {info['device']} ({L} layers), loaded from "
                                   f"{views.without_paths(info['source'])}.{note}{then}", "ok"),
            **self._runs_enabled(session),
        }

    def _runs_enabled(self, session: Session) -> dict:
        """The buttons that start a run, shown disabled until a model is ready (a click before it would only wait)."""
        a, r = self.s.actions, self.s.recordings
        return {**{b: gr.Button(interactive=not session.busy) for b in (a.send, a.recall, a.play, r.live)},
                a.regenerate: gr.Button(interactive=self._regenerable(session, session.busy))}

    @staticmethod
    def _regenerable(session: Session, busy: bool) -> bool:
        """Regenerate can act: a live conversation to replay, nothing running (before a turn it would only say
        "nothing to regenerate yet"; on a recording, that it is one)."""
        return not busy and bool(session.user_turns) and not session.recording

    # --- a run -----------------------------------------------------------------
    def _stream(self, session: Session, config: RunConfig, turns: list[str], fresh: bool,
                note: str, expect: tuple[int, str] | None = None, scenario: str | None = None,
                job: Job | None = None) -> Iterator[dict]:
        """Play `turns` (all of them on a fresh engine, else only the new one) and stream the panes; `job` says how
        far it is to whoever waits for the slot."""
        job = job or Job("a turn")
        session.busy, session.stop_requested, session.stopping = True, False, None
        yield {**self.render(session, busy=True, message=note, kind="busy"),
               self.s.actions.prompt: gr.Textbox(value="", interactive=False)}
        events = None
        t_start = time.monotonic()
        stopped = timed_out = False
        budget = limits().run_seconds
        progress = runner.Progress(config)
        try:
            if fresh or session.engine is None or runner.on_zero_gpu():
                engine = None if runner.on_zero_gpu() else runner.conversation(config)
                session.clear()
                session.busy, session.expect = True, expect
                session.config, session.engine, session.scenario = config, engine, scenario
                session.recorder = runner.recorder(config, scenario, expect)
                played = turns
            else:
                if session.recorder is not None:
                    session.recorder.resume()
                played = turns[-1:]
            turns_before, steps_before = len(session.user_turns), session.steps
            events = session.pump = runner.Pump(runner.play(config, played, session.engine),
                                                lambda: session.stop_requested, HEARTBEAT_S)
            last = 0.0
            for event in events:  # every event the engine produced, also those after a stop request
                now = time.monotonic()
                if event is None:  # nothing for a while: the time so far and the time left
                    yield {self.s.views.status: views.status(self._progress(session, progress, turns, fresh, now),
                                                             "busy")}
                    continue
                if session.recorder is not None:  # the session reads the recorded copy: its time is the recording's
                    session.recorder.add(event)
                    event = session.recorder.events[-1]
                session.apply(event)
                progress.add(event, now)
                doing = self._progress(session, progress, turns, fresh, now).rstrip("…")
                job.doing = doing[:1].lower() + doing[1:]
                stopped = session.stop_requested
                if budget is not None and not stopped and now - t_start > budget:
                    session.stop_requested = timed_out = True  # the engine's thread ends the turn after this step
                first = event["type"] == "step" and event["index"] == 0
                if event["type"] in ("turn", "turn_end", "prefill") or first or now - last >= UI_EVERY_S:
                    plots = (event["type"] == "turn_end" or
                             now - session.last_plot >= max(PLOTS_EVERY_S, session.plot_cost / PLOTS_SHARE))
                    yield self.render(session, busy=True, message=self._progress(session, progress, turns, fresh, now),
                                      kind="busy", plots=plots)
                    last = now
        except runner.USER_ERRORS as e:
            gr.Warning(str(e))
            message, kind = str(e), "error"
        except runner.OUT_OF_MEMORY as e:  # the guard's estimate fell short: free this session, stay up
            log.error("run ran out of memory:\n%s", traceback.format_exc())
            session.engine, session.config = None, None
            message, kind = (f"Out of memory during the run ({type(e).__name__}); this conversation's caches were "
                             "freed. Try fewer tokens or strategies, or AnchorKV with rebuild=step."), "error"
            gr.Warning(message)
        except Exception as e:  # the app stays up; the message says what broke (the traceback stays in the log)
            log.error("run failed:\n%s", traceback.format_exc())
            message, kind = f"Run failed: {type(e).__name__}: {str(e)[:200]}", "error"
            gr.Warning(message)
        else:
            took = time.monotonic() - t_start
            turn, ran = len(session.user_turns), len(session.user_turns) - turns_before
            where = (f"after step {progress.steps} of turn {progress.turn}" if progress.steps else
                     f"while reading turn {progress.turn}'s message ({progress.read:,} of {progress.total:,} tokens)")
            which = f"turn {turn}" if ran == 1 else f"turns {turns_before + 1}-{turn}"
            # The steps and the time are this run's: the turns it played, not the earlier ones'.
            message, kind = ((f"Stopped at this server's time budget ({budget:.0f} s per run) {where}: what was "
                              "produced is shown. Fewer panes or a shorter prompt fit more; the recordings show whole "
                              "runs.", "ok") if timed_out else
                             (f"Stopped {where}.", "ok") if stopped else
                             (f"Done: {turn} turn(s); {which}: {session.steps - steps_before} steps in {took:.1f} s; "
                              f"{session.kernels_line or 'kernels: ?'}.", "ok"))
        finally:
            # Also when Gradio closes this generator (the client went away): the turn must end and free the model.
            if events is not None:
                events.close()
            session.busy, session.pump = False, None
        yield self._final(session, message, kind)

    @staticmethod
    def _stopping(session: Session) -> str:
        turn, step = session.stopping
        return f"Stopping after step {step} of turn {turn}…" if step else "Stopping after this piece of the message…"

    def _progress(self, session: Session, progress: runner.Progress, turns: list[str], fresh: bool, now: float) -> str:
        """The status during a run; once Stop is pressed, only the step it ends after (no later number)."""
        if session.stopping is not None:
            return self._stopping(session)
        turn = len(session.user_turns)
        return f"Turn {turn}/{len(turns) if fresh else turn}: {progress.line(now)}…"

    def _final(self, session: Session, message: str, kind: str) -> dict:
        if session.engine is not None and session.user_turns:
            try:
                session.result = session.engine.results()
            except Exception as e:  # a summary that cannot be made must not leave the page stuck
                log.error("results failed:\n%s", traceback.format_exc())
                session.result = None
                message, kind = f"{message} (No summary: {type(e).__name__}: {e})", "error"
            try:  # measured once per process (~1 s after the first turn), on the compute thread
                session.roofline = runner.on_compute(session.engine.roofline)
            except Exception:
                log.error("roofline failed:\n%s", traceback.format_exc())
                session.roofline = None
        try:
            return self.render(session, busy=False, message=message, kind=kind, plots=True, final=True)
        except Exception as e:
            log.error("drawing the final state failed:\n%s", traceback.format_exc())
            return self.render(session, busy=False, message=f"{message} (Drawing failed: {e})", kind="error")

    def _refuse(self, session: Session, message: str) -> Iterator[dict]:
        gr.Warning(message)
        yield {self.s.views.status: views.status(message, "error")}

    def _run(self, session: Session, controls: dict, turns: list[str], raw: bool, fresh: bool | None,
             note: Callable[[bool], str], problem: str | None = None,
             expect: tuple[int, str] | None = None, scenario: str | None = None,
             ask: tuple | None = None) -> Iterator[dict]:
        """Check everything (`validate`, then the memory guard), then stream `turns`; `fresh` None: rebuild only if
        the settings changed.  `ask`: a run that reads more than `LONG_PROMPT_TOKENS` prompt tokens does not start;
        the status says its time and memory, and the same action again (`session.asked`) runs it."""
        LINE.leave(session)
        if session.busy:
            problem = "A turn is still running: wait for it or press Stop."
        if problem:
            yield from self._refuse(session, problem)
            return
        try:
            config = Settings.from_controls(controls).run_config(raw)
            if not runner.is_loaded(config):
                yield {self.s.views.status: views.status(f"Loading {config.model}…", "busy")}
            cost = runner.prepare(config, turns)
        except runner.USER_ERRORS as e:
            yield from self._refuse(session, str(e))
            return
        except Exception as e:  # a model that fails to build, say: the page says so and stays usable
            log.error("checking the run failed:\n%s", traceback.format_exc())
            yield from self._refuse(session, f"Cannot start: {type(e).__name__}: {str(e)[:200]}")
            return
        fresh = config != session.config if fresh is None else fresh
        reads = sum(cost["prompt_tokens"]) if fresh else cost["prompt_tokens"][-1]
        if ask is not None and reads > LONG_PROMPT_TOKENS:
            session.asked = ask
            yield {self.s.views.status: views.status(self._long_run(config, reads, len(turns) if fresh else 1,
                                                                    cost["bytes"]), "info")}
            return
        job = LINE.started(Job(f"a turn of {len(config.specs)} pane(s)", session))
        try:
            yield from self._stream(session, config, turns, fresh, note(fresh),
                                    expect if fresh else session.expect, scenario if fresh else session.scenario, job)
        finally:
            LINE.ended(job)

    @staticmethod
    def _long_run(config: RunConfig, reads: int, turns: int, peak: int) -> str:
        """What a long run will cost, asked before it starts: its time at this machine's measured speed, its memory
        by the guard."""
        steps = turns * config.max_new_tokens
        known = runner.estimate_s(config, reads, steps)
        when = (f"about {runner.duration(known[0])} ({known[1]})" if known else
                "a time not known yet (nothing ran here with these settings; the status shows the time left as it "
                "runs)")
        return (f"This run reads {reads:,} prompt tokens (more than {LONG_PROMPT_TOKENS:,}) and makes up to {steps:,} "
                f"steps: {when}, and about {fmt_bytes(peak)} of memory at its peak (the memory guard's estimate). "
                "Press Send again to go on.")

    def send(self, session: Session, prompt: str, request: gr.Request = None, **controls) -> Iterator[dict]:
        self._seen(session, request)
        again, session.asked = session.asked == ("send", prompt), None
        playback.unfold(session)
        if not isinstance(prompt, str):
            yield from self._refuse(session, "prompt: expected text")
            return
        # A recording on screen is not a conversation to continue: a message starts a new one.
        earlier = 0 if session.recording else len(session.user_turns)
        note = lambda fresh: "Starting…" if not earlier else (
            f"Settings changed: rebuilding and replaying {earlier} earlier turn(s)…" if fresh
            else "Continuing the conversation in every pane…")
        raw = session.config.raw if session.config else False
        turns = [*session.user_turns[:earlier], prompt] if earlier else [prompt]
        yield from self._run(session, controls, turns, raw, True if session.recording else None, note,
                             ask=None if again else ("send", prompt))

    def regenerate(self, session: Session, request: gr.Request = None, **controls) -> Iterator[dict]:
        self._seen(session, request)
        session.asked = None
        playback.unfold(session)
        if session.recording:
            yield from self._refuse(session, "A recording is on screen: ▶ Run it live runs its conversation here.")
            return
        turns = list(session.user_turns)
        raw = session.config.raw if session.config else False
        yield from self._run(session, controls, turns, raw, True,
                             lambda _: f"Rebuilding the engine and replaying {len(turns)} turn(s) (greedy: same tokens)…",
                             None if turns else "Nothing to regenerate yet.")

    def play_scenario(self, session: Session, scenario: str, request: gr.Request = None,
                      **controls) -> Iterator[dict]:
        self._seen(session, request)
        session.asked = None
        table = scenarios()
        chosen = table.get(scenario, {}) if isinstance(scenario, str) else {}
        turns = list(chosen.get("turns", []))
        expect = (len(turns) - 1, chosen["expect"]) if chosen.get("expect") else None
        yield from self._run(session, controls, turns, bool(chosen.get("raw", False)), True,
                             lambda _: f"Playing “{scenario}”: {len(turns)} turns…",
                             None if chosen else f"scenario: unknown {str(scenario)[:40]!r}; allowed: {', '.join(table)}",
                             expect, scenario if chosen else None)

    def play_recall(self, session: Session, request: gr.Request = None, **controls) -> Iterator[dict]:
        yield from self.play_scenario(session, RECALL, request, **controls)

    # --- recordings ------------------------------------------------------------
    def replay(self, session: Session, choice: str | None, speed: str, upload: str | None = None,
               request: gr.Request = None) -> Iterator[dict]:
        """Play a recording (a shipped one by name, or an uploaded file) at `speed`: the recorded events folded
        into this session exactly as the live run folded them; nothing is recomputed.  A live conversation on screen
        is replaced only when asked twice: the first time the status says what would be lost."""
        self._seen(session, request)
        again, session.asked = session.asked == ("replay", bool(upload)), None
        if session.busy:
            yield from self._refuse(session, "A turn is still running: wait for it or press Stop.")
            return
        if speed not in playback.SPEEDS:
            yield from self._refuse(session, f"speed: {str(speed)[:40]!r} is not allowed; allowed: "
                                             f"{', '.join(playback.SPEEDS)}")
            return
        try:
            recording = playback.open_recording(choice, upload)
        except RecordingError as e:
            yield from self._refuse(session, str(e))
            return
        if session.user_turns and session.recording is None and not again:
            session.asked = ("replay", bool(upload))
            how = "Upload it again" if upload else "Press ▶ Replay it again"
            yield {self.s.views.status: views.status(
                f"Replaying would replace this conversation: its {len(session.user_turns)} live turn(s) and "
                f"{session.steps} steps on {session.config.model if session.config else 'this model'} (the Export tab "
                f"keeps them as files). {how} to replace it.", "info")}
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
                    yield self.render(session, busy=True, plots=plots, kind="busy",
                                      message=f"Replaying ({speed}): turn {len(session.user_turns)}, step "
                                              f"{session.steps}; every number is the recorded one")
                    last = now
            stopped = session.stop_requested
        finally:
            session.busy = False
            playback.finish(session)
        message = (f"Replay stopped at step {session.steps}." if stopped else
                   f"Replayed: {about}. Every number is the recorded one; ▶ Run it live runs it on this machine.")
        yield self.render(session, busy=False, message=message, kind="ok", plots=True, final=True)

    def run_live(self, session: Session, request: gr.Request = None, **controls) -> Iterator[dict]:
        """The conversation of the recording on screen (or the recall scenario), live on this machine with the
        sidebar's settings; says where they differ from the recording's."""
        self._seen(session, request)
        session.asked = None
        playback.unfold(session)
        meta = session.recording or {}
        turns = list(meta.get("turns") or scenarios().get(RECALL, {}).get("turns", []))
        if not turns:
            yield from self._refuse(session, "Nothing to run: open a recording first.")
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
        note = (f"Running “{scenario or 'the recording'}” live here: {len(turns)} turns" +
                (f"; the sidebar's settings differ from the recording's ({', '.join(differs)})" if differs else "") +
                "…")
        yield from self._run(session, controls, turns, bool(meta.get("raw", False)), True, lambda _: note, None,
                             expect, scenario)

    def stop(self, session: Session) -> str:
        """The run ends after the step being computed now; the status names it, and names no later one after."""
        session.asked = None
        if not session.busy:
            return views.status("Nothing is running.", "info")
        if session.pump is None:  # a replay, or an engine still being built
            session.stop_requested = True
            return views.status("Stopping…", "busy")
        session.stopping = session.pump.stop_after()  # before the flag: the pump stops there, not at its next event
        session.stop_requested = True
        return views.status(self._stopping(session), "busy")

    def clear(self, session: Session) -> dict:
        session.pending = None
        if session.busy:
            gr.Warning("A turn is still running: press Stop first.")
            return {self.s.views.status: views.status("A turn is still running: press Stop first.", "error")}
        session.clear()
        return self.render(session, busy=False, message="Cleared. Type a message to start a new conversation.",
                           plots=True, final=True)

    # --- the frontier ----------------------------------------------------------
    def frontier(self, session: Session, source: str, **controls) -> Iterator[dict]:
        """Every ticked strategy at a few settings on one conversation, run after run; the frontier plot when done
        (or, cancelled, of the runs done).  Whoever waits for the slot meanwhile is told it is the frontier drawing
        and how far it is; its Cancel ends it after the step in progress."""
        f = self.s.frontier
        busy = lambda message: {f.status: views.status(message, "busy"), f.draw: gr.Button(interactive=False),
                                f.cancel: gr.Button(interactive=True)}
        done = lambda message, kind: {f.status: views.status(message, kind), f.draw: gr.Button(interactive=True),
                                      f.cancel: gr.Button(interactive=False)}
        session.asked = None
        if session.busy:
            yield done("A turn is still running: wait for it or press Stop.", "error")
            return
        playback.unfold(session)
        known = isinstance(source, str) and (source == FRONTIER_CURRENT or source in scenarios())
        turns = [] if not known else list(session.user_turns) if source == FRONTIER_CURRENT else \
            list(scenarios()[source]["turns"])
        if not turns:
            yield done("Nothing to draw yet: send a message first, or choose a scenario." if source == FRONTIER_CURRENT
                       else f"scenario: unknown {str(source)[:40]!r}; allowed: {FRONTIER_CURRENT}, "
                       f"{', '.join(scenarios())}", "error")
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
                ran = sweep.run(entries, lambda: session.frontier_cancel)
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
            words = (f"Cancelled after {len(rows)} point(s) of {sum(map(len, plan))} ({took:.0f} s): the points of "
                     "the runs that finished are drawn." if rows else f"Cancelled before a run finished ({took:.0f} s).")
            yield {**done(words, "ok"), **({f.plot: runner.frontier_plot(rows, sweep, source)} if rows else {})}
            return
        yield {**done(f"{len(rows)} points from {len(plan)} runs in {took:.0f} s.", "ok"),
               f.plot: runner.frontier_plot(rows, sweep, source)}

    def cancel_frontier(self, session: Session) -> str:
        """The frontier drawing ends after the step in progress (its finished runs are drawn)."""
        if not any(job.owner is session and job.what == FRONTIER_JOB for job in list(LINE.jobs)):
            return views.status("No frontier drawing is running.", "info")
        session.frontier_cancel = True
        return views.status("Cancelling after the step in progress…", "busy")

    def token_map(self, session: Session, label: str | None, layer: int, other: str | None = None) -> tuple:
        """The token maps of `label` (beside `other`) at `layer`, and the attention snapshot there."""
        playback.unfold(session)
        return (self._token_map_html(session, label, layer, other),
                runner.attention_plot(session, None if session.busy else label, layer))
