"""The turn's buttons: Send, Regenerate, a scenario (and the Recall demo), Stop; each checks a run (`validate`, the
memory guard, a long prompt asked first), then streams its turns into the panes (a part `handlers.Handlers` holds).

A turn runs on the session's engine; a change of settings (or a regenerate)
builds a new engine and replays the conversation, which greedy decoding makes
identical.  Stop sets a flag that the engine's own thread (`runner.Pump`) checks
between steps, so the turn is always closed cleanly, on the thread that opened it, after the step Stop named.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator

import gradio as gr

from ...plain.limits import limits
from ...plain.scenarios import scenarios
from ...plain.units import fmt_bytes
from . import playback, runner, views
from .components import Studio
from .line import LINE, Job
from .pace import HEARTBEAT_S, PLOTS_EVERY_S, PLOTS_SHARE, UI_EVERY_S
from .recording_buttons import RECALL
from .session import JOINING, Session
from .settings import REFERENCE, RunConfig, Settings, changed, panes_only

log = logging.getLogger(__name__)
LONG_PROMPT_TOKENS = 1000  # a run that reads more prompt tokens than this asks first, with its time and memory


@dataclass(eq=False)  # compared and hashed by identity: Gradio holds its bound methods as handlers
class TurnButtons:
    """Send, Regenerate, ▶ Play scenario, ▶ Recall demo and ■ Stop: a run's checks, its stream and its end."""

    studio: Studio  # the page's components (the status line, the prompt)
    seen: Callable[[Session, gr.Request | None], None]  # notes a visitor's session (`Handlers._seen`)
    refuse: Callable[[Session, str], Iterator[dict]]  # warns and says why in the status (`Handlers._refuse`)
    render: Callable[..., dict]  # the page drawn from the session (`Handlers.render`)

    # --- a run -----------------------------------------------------------------
    def _stream(
        self,
        session: Session,
        config: RunConfig,
        turns: list[str],
        fresh: bool,
        note: str,
        expect: tuple[int, str] | None = None,
        scenario: str | None = None,
        job: Job | None = None,
        rearrange: bool = False,
    ) -> Iterator[dict]:
        """Play `turns` (all of them on a fresh engine, else only the new one) and stream the panes; `job` says how
        far it is to whoever waits for the slot.  `rearrange`: the conversation's panes become `config`'s first, the
        new ones replaying the earlier turns alone; the run's config is the session's once the new turn starts."""
        job = job or Job("a turn")
        session.busy, session.stop_requested, session.stopping = True, False, None
        yield {
            **self.render(session, busy=True, message=note, kind="busy"),
            self.studio.actions.prompt: gr.Textbox(value="", interactive=False),
        }
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
            events = session.pump = runner.Pump(
                runner.play(config, played, session.engine, rearrange), lambda: session.stop_requested, HEARTBEAT_S
            )
            last = 0.0
            for event in events:  # every event the engine produced, also those after a stop request
                now = time.monotonic()
                if event is None:  # nothing for a while: the time so far and the time left
                    yield {
                        self.studio.views.status: views.status(
                            self._progress(session, progress, turns, fresh, now), "busy"
                        )
                    }
                    continue
                if session.recorder is not None:  # the session reads the recorded copy: its time is the recording's
                    session.recorder.add(event)
                    event = session.recorder.events[-1]
                session.apply(event)
                if rearrange and event["type"] == "turn":  # the new panes have caught up: this is their run now
                    session.config = config
                    if session.recorder is not None:  # ("Run it live" plays every pane from the start)
                        session.recorder.meta["specs"] = list(config.specs)
                progress.add(event, now)
                doing = self._progress(session, progress, turns, fresh, now).rstrip("…")
                job.doing = doing[:1].lower() + doing[1:]
                stopped = session.stop_requested
                if budget is not None and not stopped and now - t_start > budget:
                    session.stop_requested = timed_out = True  # the engine's thread ends the turn after this step
                first = event["type"] == "step" and event["index"] == 0
                if event["type"] in ("turn", "turn_end", "prefill", *JOINING) or first or now - last >= UI_EVERY_S:
                    plots = event["type"] == "turn_end" or now - session.last_plot >= max(
                        PLOTS_EVERY_S, session.plot_cost / PLOTS_SHARE
                    )
                    yield self.render(
                        session,
                        busy=True,
                        message=self._progress(session, progress, turns, fresh, now),
                        kind="busy",
                        plots=plots,
                        live=True,
                    )
                    last = now
        except runner.USER_ERRORS as e:
            gr.Warning(str(e))
            message, kind = str(e), "error"
        except runner.OUT_OF_MEMORY as e:  # the guard's estimate fell short: free this session, stay up
            log.error("run ran out of memory:\n%s", traceback.format_exc())
            session.engine, session.config = None, None
            message, kind = (
                (
                    f"Out of memory during the run ({type(e).__name__}); this conversation's caches were "
                    "freed. Try fewer tokens or strategies, or AnchorKV with rebuild=step."
                ),
                "error",
            )
            gr.Warning(message)
        except Exception as e:  # the app stays up; the message says what broke (the traceback stays in the log)
            log.error("run failed:\n%s", traceback.format_exc())
            message, kind = f"Run failed: {type(e).__name__}: {str(e)[:200]}", "error"
            gr.Warning(message)
        else:
            took = time.monotonic() - t_start
            turn, ran = len(session.user_turns), len(session.user_turns) - turns_before
            where = (
                f"after step {progress.steps} of turn {progress.turn}"
                if progress.steps
                else f"while reading turn {progress.turn}'s message ({progress.read:,} of {progress.total:,} tokens)"
            )
            which = f"turn {turn}" if ran == 1 else f"turns {turns_before + 1}-{turn}"
            # The steps and the time are this run's: the turns it played, not the earlier ones'.
            message, kind = (
                (
                    f"Stopped at this server's time budget ({budget:.0f} s per run) {where}: what was "
                    "produced is shown. Fewer panes or a shorter prompt fit more; the recordings show whole "
                    "runs.",
                    "ok",
                )
                if timed_out
                else (f"Stopped {where}.", "ok")
                if stopped
                else (
                    f"Done: {turn} turn(s); {which}: {session.steps - steps_before} steps in {took:.1f} s; "
                    f"{session.kernels_line or 'kernels: ?'}.",
                    "ok",
                )
            )
        finally:
            # Also when Gradio closes this generator (the client went away): the turn must end and free the model.
            if events is not None:
                events.close()
            session.busy, session.pump = False, None
            if rearrange and session.config is not config:
                message = self._unjoined(session, message)
        yield self._final(session, message, kind)

    @staticmethod
    def _unjoined(session: Session, message: str) -> str:
        """Stopped (or failed) before the new panes caught up: the engine took them back (`Engine.catch_up`); the
        page shows the panes it still has, and the next Send rebuilds the conversation with the settings then."""
        session.joining = None
        if session.engine is not None:
            session.shown = list(session.engine.shown)
            session.lanes = {k: v for k, v in session.lanes.items() if k in session.shown or k == REFERENCE}
        session.config = None
        return f"{message} The new pane(s) were not added: the next Send rebuilds and replays every pane."

    @staticmethod
    def _stopping(session: Session) -> str:
        turn, step = session.stopping
        return f"Stopping after step {step} of turn {turn}…" if step else "Stopping after this piece of the message…"

    def _progress(self, session: Session, progress: runner.Progress, turns: list[str], fresh: bool, now: float) -> str:
        """The status during a run; once Stop is pressed, only the step it ends after (no later number)."""
        if session.stopping is not None:
            return self._stopping(session)
        if session.joining is not None:
            turn, step, turns = session.joining
            return (
                f"Adding pane(s): replaying earlier turn {turn + 1}/{turns} for them alone, step {step} (the other "
                "panes keep theirs)…"
            )
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

    def run(
        self,
        session: Session,
        controls: dict,
        turns: list[str],
        raw: bool,
        fresh: bool | None,
        note: Callable[[bool], str],
        problem: str | None = None,
        expect: tuple[int, str] | None = None,
        scenario: str | None = None,
        ask: tuple | None = None,
    ) -> Iterator[dict]:
        """Check everything (`validate`, then the memory guard), then stream `turns`; `fresh` None: rebuild only if
        the settings changed.  `ask`: a run that reads more than `LONG_PROMPT_TOKENS` prompt tokens does not start;
        the status says its time and memory, and the same action again (`session.asked`) runs it."""
        LINE.leave(session)
        if session.busy:
            problem = "A turn is still running: wait for it or press Stop."
        if problem:
            yield from self.refuse(session, problem)
            return
        try:
            config = Settings.from_controls(controls).run_config(raw)
            if not runner.is_loaded(config):
                yield {self.studio.views.status: views.status(f"Loading {config.model}…", "busy")}
            cost = runner.prepare(config, turns)
        except runner.USER_ERRORS as e:
            yield from self.refuse(session, str(e))
            return
        except Exception as e:  # a model that fails to build, say: the page says so and stays usable
            log.error("checking the run failed:\n%s", traceback.format_exc())
            yield from self.refuse(session, f"Cannot start: {type(e).__name__}: {str(e)[:200]}")
            return
        rearrange = fresh is None and session.engine is not None and panes_only(session.config, config)
        fresh = config != session.config and not rearrange if fresh is None else fresh
        reads = sum(cost["prompt_tokens"]) if fresh else cost["prompt_tokens"][-1]
        if ask is not None and reads > LONG_PROMPT_TOKENS:
            session.asked = ask
            yield {
                self.studio.views.status: views.status(
                    self._long_run(config, reads, len(turns) if fresh else 1, cost["bytes"]), "info"
                )
            }
            return
        job = LINE.started(Job(f"a turn of {len(config.specs)} pane(s)", session))
        try:
            yield from self._stream(
                session,
                config,
                turns,
                fresh,
                note(fresh),
                expect if fresh else session.expect,
                scenario if fresh else session.scenario,
                job,
                rearrange,
            )
        finally:
            LINE.ended(job)

    @staticmethod
    def _long_run(config: RunConfig, reads: int, turns: int, peak: int) -> str:
        """What a long run will cost, asked before it starts: its time at this machine's measured speed, its memory
        by the guard."""
        steps = turns * config.max_new_tokens
        known = runner.estimate_s(config, reads, steps)
        when = (
            f"about {runner.duration(known[0])} ({known[1]})"
            if known
            else "a time not known yet (nothing ran here with these settings; the status shows the time left as it "
            "runs)"
        )
        return (
            f"This run reads {reads:,} prompt tokens (more than {LONG_PROMPT_TOKENS:,}) and makes up to {steps:,} "
            f"steps: {when}, and about {fmt_bytes(peak)} of memory at its peak (the memory guard's estimate). "
            "Press Send again to go on."
        )

    def send(self, session: Session, prompt: str, request: gr.Request = None, **controls) -> Iterator[dict]:
        self.seen(session, request)
        again, session.asked = session.asked == ("send", prompt), None
        playback.unfold(session)
        if not isinstance(prompt, str):
            yield from self.refuse(session, "prompt: expected text")
            return
        # A recording on screen is not a conversation to continue: a message starts a new one.
        earlier = 0 if session.recording else len(session.user_turns)
        note = lambda fresh: (
            "Starting…"
            if not earlier
            else (
                f"Settings changed: rebuilding and replaying {earlier} earlier turn(s)…"
                if fresh
                else "Continuing the conversation in every pane…"
            )
        )
        raw = session.config.raw if session.config else False
        turns = [*session.user_turns[:earlier], prompt] if earlier else [prompt]
        yield from self.run(
            session,
            controls,
            turns,
            raw,
            True if session.recording else None,
            note,
            ask=None if again else ("send", prompt),
        )

    def next_send(self, session: Session, **controls) -> str:
        """What the next Send will replay when the settings differ from the conversation's: the panes that join
        (replaying the earlier turns alone) and leave, or a rebuild of every pane; "" when nothing would be
        replayed or the settings are not valid (Send then says why)."""
        turns = len(session.user_turns)
        if session.busy or session.recording or not turns or session.config is None:
            return ""
        try:
            config = Settings.from_controls(controls).run_config(session.config.raw)
        except Exception:  # (any bad setting: Send refuses it with its reason)
            return ""
        old = session.config
        if config == old:
            return ""
        earlier = f"the {turns} earlier turn{'s' if turns > 1 else ''}"
        if session.engine is not None and panes_only(old, config):
            added = [spec for spec in config.specs if spec not in old.specs]
            removed = [spec for spec in old.specs if spec not in config.specs]
            said = []
            if added:
                said.append(f"adds {', '.join(added)}, replaying {earlier} for {'it' if len(added) == 1 else 'them'}")
            if removed:
                said.append(f"removes {', '.join(removed)}")
            what = " and ".join(said) or "shows the panes in the new order"
            return views.notice(f"Next Send {what}; the other panes keep their state and are not recomputed.")
        return views.notice(
            f"Next Send rebuilds the conversation ({', '.join(changed(old, config))} changed) and replays {earlier} "
            "in every pane."
        )

    def regenerate(self, session: Session, request: gr.Request = None, **controls) -> Iterator[dict]:
        self.seen(session, request)
        session.asked = None
        playback.unfold(session)
        if session.recording:
            yield from self.refuse(session, "A recording is on screen: ▶ Run it live runs its conversation here.")
            return
        turns = list(session.user_turns)
        raw = session.config.raw if session.config else False
        yield from self.run(
            session,
            controls,
            turns,
            raw,
            True,
            lambda _: f"Rebuilding the engine and replaying {len(turns)} turn(s) (greedy: same tokens)…",
            None if turns else "Nothing to regenerate yet.",
        )

    def play_scenario(self, session: Session, scenario: str, request: gr.Request = None, **controls) -> Iterator[dict]:
        self.seen(session, request)
        session.asked = None
        table = scenarios()
        chosen = table.get(scenario, {}) if isinstance(scenario, str) else {}
        turns = list(chosen.get("turns", []))
        expect = (len(turns) - 1, chosen["expect"]) if chosen.get("expect") else None
        yield from self.run(
            session,
            controls,
            turns,
            bool(chosen.get("raw", False)),
            True,
            lambda _: f"Playing “{scenario}”: {len(turns)} turns…",
            None if chosen else f"scenario: unknown {str(scenario)[:40]!r}; allowed: {', '.join(table)}",
            expect,
            scenario if chosen else None,
        )

    def play_recall(self, session: Session, request: gr.Request = None, **controls) -> Iterator[dict]:
        yield from self.play_scenario(session, RECALL, request, **controls)

    def stop(self, session: Session):
        """The run ends after the step being computed now; the status names it, and names no later one after.  A
        turn says so itself, woken at once: its status line has one writer, since this button's answer could land
        after the turn's last word ("Stopped …") and overwrite it."""
        session.asked = None
        if not session.busy:
            return views.status("Nothing is running.", "info")
        if session.pump is None:  # a replay, or an engine still being built
            session.stop_requested = True
            return views.status("Stopping…", "busy")
        session.stopping = session.pump.stop_after()  # before the flag: the pump stops there, not at its next event
        session.stop_requested = True
        session.pump.wake()
        return gr.skip()
