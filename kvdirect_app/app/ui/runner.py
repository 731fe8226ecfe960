"""Where the UI meets the engine's facade (`kvdirect_app/app/service.py`): playing turns on the compute thread,
their progress and pace, the frontier's plan.  Plain Python: no torch here (the `compare` API is `compare_api`, the
Token map tab's drawings `token_map_tab`).

On Hugging Face ZeroGPU the generation functions run in a short-lived GPU
worker (`spaces.GPU`), so no engine outlives a call there: each call rebuilds
the conversation and replays it (greedy decoding makes the replay
identical).  Elsewhere `spaces.GPU` is not applied, or is a no-op, and a
session keeps its conversation between turns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import threading
from typing import Callable, Iterator

from ...plain import rss
from ...plain.errors import OutOfMemory, UserError
from ...plain.frontier import frontier_figure, points_from_rows
from ...plain.hosted import hosted
from ...plain.recording import Recorder
from ...plain.specs import external
from ...plain.units import fmt_bytes
from .. import service
from .settings import REFERENCE, RunConfig, Settings, expand

USER_ERRORS = (UserError,)
OUT_OF_MEMORY = (OutOfMemory,)


def gpu(fn):
    """`spaces.GPU` where the `spaces` package is importable (it does nothing off ZeroGPU), else `fn`."""
    try:
        import spaces  # lazy: an optional dependency (installed on Hugging Face Spaces only)
    except ImportError:
        return fn
    return spaces.GPU(duration=180)(fn)


def on_zero_gpu() -> bool:
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def release_memory():
    """After a session's conversation is dropped: collect it, and hand glibc's freed heap back to the OS, so that
    the process's RSS shows what is really still held."""
    rss.trim()


def queue_options() -> dict:
    """Gradio's queue for this device: one run at a time on a CPU (the cores are the bottleneck), two on a GPU;
    a bounded line (a full one is answered "busy", not left hanging)."""
    concurrency = 2 if service.gpu_available() else 1
    return {"default_concurrency_limit": concurrency, "max_size": 16 if hosted() else 64}


def session_capacity() -> int:
    """Sessions whose page copy Gradio keeps (the oldest go first): a bound on what idle visitors hold."""
    return 200 if hosted() else 1000


_COMPUTE: list[concurrent.futures.ThreadPoolExecutor] = []
_COMPUTE_LOCK = threading.Lock()
COMPUTE_THREAD = "kvdirect-compute"


def compute() -> concurrent.futures.ThreadPoolExecutor:
    """The app's compute thread(s): every turn (`Pump`), every engine built (`conversation`) and every model loaded
    from the page runs here, as many at once as the queue runs (one on a CPU).

    Why one long-lived thread: OpenMP keeps a team of worker threads per thread that ran a parallel op, and while
    a process's teams hold more threads than there are cores, libgomp makes every waiting worker sleep at once
    instead of spinning for a moment (`GOMP_SPINCOUNT`, kvdirect_app/__init__.py).  A decode step is hundreds of
    short ops, each then waking the worker: SmolLM2's plain full cache takes 61 ms a step so, 36-40 ms with one
    team (2-core CPU).  Engines built on Gradio's pooled handler threads left a team on each of them.  (This holds
    for the native kernels; the fixed-order kernels run on a team of their own and torch's ops at one thread
    beside them, `Kernels.torch_threads`.)"""
    with _COMPUTE_LOCK:
        if not _COMPUTE:
            _COMPUTE.append(
                concurrent.futures.ThreadPoolExecutor(
                    max_workers=queue_options()["default_concurrency_limit"], thread_name_prefix=COMPUTE_THREAD
                )
            )
        return _COMPUTE[0]


def on_compute(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` on the compute thread (here, when already on it), its result or its error."""
    if threading.current_thread().name.startswith(COMPUTE_THREAD):
        return fn(*args, **kwargs)
    return compute().submit(fn, *args, **kwargs).result()


def is_loaded(config: RunConfig) -> bool:
    return service.is_loaded(config.model, config.dtype, config.device)


def prepare(config: RunConfig, turns: list[str]) -> dict:
    """Every check before a run (the same `validate` stages as the CLI), then the memory guard; returns
    {"prompt_tokens": each turn's prompt with its template, "bytes": the guard's estimate of the run's peak}."""
    return service.prepare(
        config.model,
        config.device,
        config.dtype,
        list(config.specs),
        config.max_new_tokens,
        turns,
        config.raw,
        config.twins,
        config.kernels,
    )


# This process's measured speed per run settings (their max_new_tokens set to 0): what a long message's estimate
# is drawn from.
PACES: dict[RunConfig, dict] = {}


def pace_key(config: RunConfig) -> RunConfig:
    return dataclasses.replace(config, max_new_tokens=0)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds // 60:.0f} min {seconds % 60:.0f} s"


def estimate_s(config: RunConfig, prompt_tokens: int, steps: int) -> tuple[float, str] | None:
    """Seconds to read `prompt_tokens` and make up to `steps` steps at the speed last measured here with these
    settings, and that speed in words; None when none was measured yet."""
    pace = PACES.get(pace_key(config))
    if pace is None:
        return None
    return (
        prompt_tokens * pace["read_s"] + steps * pace["step_s"],
        f"{1e3 * pace['read_s']:.1f} ms a prompt token and {pace['step_s']:.2f} s a step, measured here with "
        "these settings; a longer context reads slower",
    )


RECENT_STEPS = 8  # the steps whose mean is the step-time model's level (`Progress.steps_left_s`)


class Progress:
    """A turn's progress as the status says it: tokens of the message read, steps of the reply made, the time so
    far and the time left at the speed measured in this turn (or, before any, the last one's with these
    settings).  What it measures is kept in `PACES` for the next estimate."""

    def __init__(self, config: RunConfig):
        self.config, self.pace = config, PACES.get(pace_key(config))
        self.turn = self.total = self.read = self.steps = 0
        self.t0 = self.read_s = None
        self.step_ms: list[float] = []

    def add(self, event: dict, now: float):
        kind = event["type"]
        if kind == "turn":
            self.turn, self.t0, self.total = event["turn"] + 1, now, len(event["chunk_ids"])
            self.read, self.steps, self.step_ms, self.read_s = 0, 0, [], None
        elif kind == "prefill":  # (every lane's prompt is read together: the longest one's tokens)
            self.read, self.total = event["done"], event["total"]
            self.read_s = (now - self.t0) / self.read
        elif kind == "step":
            if not self.steps:  # the message is read: its time is the turn's so far, less this first step
                self.read = self.total
                self.read_s = max(0.0, now - self.t0 - event["step_ms"] / 1e3) / max(1, self.total)
            self.steps += 1
            self.step_ms.append(event["step_ms"])
            PACES[pace_key(self.config)] = {
                "read_s": self.read_s,
                "step_s": sum(self.step_ms) / len(self.step_ms) / 1e3,
            }

    def steps_left_s(self, most: int) -> float:
        """The time the steps after this one take, by a model of the step time: each step reads one token more
        than the last, so the time grows with the context.  The slope is a least-squares line through this turn's
        steps (never below 0); the level, the mean of the last few steps at their mean index.  With the mean of
        all steps instead, a turn whose steps slowed said "about 2 s left" for 13 s."""
        ms, left = self.step_ms, most - self.steps
        if left <= 0:
            return 0.0
        n = len(ms)
        mean_i, mean_ms = (n - 1) / 2, sum(ms) / n
        spread = sum((i - mean_i) ** 2 for i in range(n))
        slope = max(0.0, sum((i - mean_i) * (m - mean_ms) for i, m in enumerate(ms)) / spread) if spread else 0.0
        recent = ms[-RECENT_STEPS:]
        level_i, level = n - (len(recent) + 1) / 2, sum(recent) / len(recent)
        # Steps n .. most-1 (0-based): their predicted times add up to left x the prediction at their mean index.
        return left * (level + slope * ((n + most - 1) / 2 - level_i)) / 1e3

    def line(self, now: float) -> str:
        """ "reading the message, 1,024 of 4,476 tokens, 2 min 10 s so far, about 6 min 30 s left" (or "step 12 of at
        most 64, ...")."""
        most = self.config.max_new_tokens
        if self.t0 is None:
            return "starting"
        step_s = (
            sum(self.step_ms) / len(self.step_ms) / 1e3 if self.step_ms else self.pace["step_s"] if self.pace else None
        )
        if self.steps:
            done, when = f"step {self.steps} of at most {most}", f"about {duration(self.steps_left_s(most))} left"
        else:
            done = f"reading the message, {self.read:,} of {self.total:,} tokens"
            read_s = self.read_s if self.read_s is not None else self.pace["read_s"] if self.pace else None
            left = None if read_s is None else (self.total - self.read) * read_s
            when = (
                "the time left is known once a first piece is read"
                if left is None
                else f"about {duration(left)} left to read it"
                if step_s is None
                else f"about {duration(left + most * step_s)} left"
            )
        return f"{done}, {duration(now - self.t0)} so far, {when}"


def conversation(config: RunConfig) -> service.Conversation:
    """A new conversation (its engine, probed and checked), built on the compute thread."""
    return on_compute(
        service.Conversation,
        config.model,
        config.device,
        config.dtype,
        list(config.specs),
        config.max_new_tokens,
        config.raw,
        config.twins,
        config.kernels,
    )


def head(spec: str) -> str:
    """A spec without its settings: a registered name, or a file's or module's class (`PATH.py:Class`)."""
    found = external(spec)
    return ":".join(found) if found else spec.split(":")[0]


def frontier_plan(config: RunConfig, settings: Settings, budgets: tuple[int, ...]) -> list[list[tuple]]:
    """One lockstep run per budget: every ticked strategy at that budget (AnchorKV: its deepest spacing in both
    rebuild modes, and the break-even spacing with ``rebuild=step``); entries (name, spec, budget)."""
    facts = service.geometry(config.model, config.dtype, config.device)
    deepest = facts["layers"]
    s_star = facts["break_even"]["token_id"] or deepest
    names = [head(spec) for spec in config.specs if head(spec) != REFERENCE]
    plan = []
    for budget in budgets:
        entries, seen = [], set()
        for name in dict.fromkeys(names):
            variants = [expand(name, budget, settings.spacing, settings.mode, settings.rebuild)]
            if name == "anchorkv":
                variants = [
                    f"anchorkv:spacing={deepest}:budget={budget}:rebuild=step",
                    f"anchorkv:spacing={deepest}:budget={budget}:rebuild=turn",
                    f"anchorkv:spacing={s_star}:budget={budget}:rebuild=step",
                ]
            for spec in variants:
                canonical = service.canonical_spec(spec)
                if canonical not in seen:
                    seen.add(canonical)
                    entries.append((name, spec, budget))
        plan.append(entries)
    return plan


def frontier_run(config: RunConfig, turns: list[str]) -> service.FrontierRun:
    return service.FrontierRun(config.model, config.device, config.dtype, turns, config.raw, config.max_new_tokens)


def frontier_plot(rows: list[dict], run: service.FrontierRun, source: str):
    reference = run.reference["state_bytes"]
    return frontier_figure(
        points_from_rows(rows),
        title=f"{run.head['model']}, {source}: memory against agreement",
        subtitle=f"{run.head['device']}, {run.head['dtype']}; full cache: peak "
        f"{fmt_bytes(reference['peak'])}, between turns {fmt_bytes(reference['between_turns_peak'])}",
    )


@gpu
def play(
    config: RunConfig, turns: list[str], talk: service.Conversation | None = None, rearrange: bool = False
) -> Iterator[dict]:
    """The engine's events for `turns`, then "done" with the results; `rearrange`: first the conversation's panes
    become `config`'s, the new ones replaying the earlier turns alone (`Conversation.rearrange`, `catch_up`).

    With no conversation (ZeroGPU), a fresh one is built here and the token
    maps are sent along, because the engine ends with the call.
    """
    own = talk is None
    talk = talk or conversation(config)
    if rearrange:
        yield from talk.rearrange(list(config.specs))
        yield from talk.catch_up()
    for text in turns:
        yield from talk.turn(text)
    yield {"type": "done", "result": talk.results()}
    if own:
        yield {"type": "token_maps", "maps": talk.token_maps()}
        yield {"type": "attention_maps", "maps": talk.attention_maps()}


class Pump:
    """Drives an engine's event generator on the compute thread (`compute`) and hands the events over a queue.

    Gradio runs each step of a streaming handler on whichever worker thread is
    free, and may drop a handler (a closed tab) without closing it.  The
    engine copes with being advanced from any thread, but a turn holds the
    model's lock until its generator is closed: one driver thread that asks
    `should_stop` (the Stop button) and `abandoned` (the reader went away)
    after every event, and always closes the generator, guarantees that the
    lock is released and the turn ends cleanly.  Iterating the pump yields
    every event the engine produced, then re-raises its error, if any.
    """

    def __init__(self, events: Iterator[dict], should_stop: Callable[[], bool], tick: float | None = None):
        self.events, self.should_stop, self.tick = events, should_stop, tick
        self.queue: queue.Queue = queue.Queue()
        self.abandoned = threading.Event()
        self.lock = threading.Lock()
        self.turn = self.step = 0  # the turn (1-based) and its last step the engine made
        self.stepping = False  # what the engine computes now ends in a step
        self.target: tuple[int, int] | None = None  # (turn, step) a stop ends the run after (None: the next event)
        self.future = compute().submit(self._run)

    def _run(self):
        try:
            for event in self.events:
                kind = event["type"]
                with self.lock:
                    if kind == "turn":
                        self.turn, self.step = event["turn"] + 1, 0
                    elif kind == "step":
                        self.step = event["index"] + 1
                    self.stepping = (
                        kind == "turn"
                        or (kind == "prefill" and event["done"] >= event["total"])
                        or (kind == "step" and any(lane["active"] for lane in event["lanes"].values()))
                    )
                self.queue.put(("event", event))
                if self.abandoned.is_set() or (
                    self.should_stop()
                    and (self.target is None or not self.stepping or (self.turn, self.step) >= self.target)
                ):
                    break
        except BaseException as e:  # handed to the reader, who reports it
            self.queue.put(("error", e))
        finally:
            self.stepping = False
            self.events.close()
            self.queue.put(("end", None))

    def stop_after(self) -> tuple[int, int]:
        """Make a stop (`should_stop`, set after this) end the run after the step being computed now, else after
        the last one made; returns that (turn, step).  A turn that ends first, or a message still being read,
        stops sooner, never later."""
        with self.lock:
            self.target = (self.turn, self.step + self.stepping)
            return self.target

    def __iter__(self) -> Iterator[dict | None]:
        """The events; None after `tick` seconds without one, or when woken (the reader redraws its status)."""
        while True:
            try:
                kind, item = self.queue.get(timeout=self.tick)
            except queue.Empty:
                yield None
                continue
            if kind == "event":
                yield item
            elif kind == "wake":
                yield None
            elif kind == "error":
                raise item
            else:
                return

    def wake(self):
        """The reader gets a None at once, as after `tick` seconds without an event (it redraws its status: Stop's
        word is said by the turn itself)."""
        self.queue.put(("wake", None))

    def close(self):
        """Stop after the current step, when the reader goes away early (the engine's thread ends the turn)."""
        self.abandoned.set()


def recorder(config: RunConfig, scenario: str | None, expect: tuple[int, str] | None) -> Recorder:
    """A live run's recording (the Export tab writes it): what the run is; the events say the rest."""
    return Recorder(
        {
            "source": "app",
            "command": None,
            "model": config.model,
            "dtype": config.dtype,
            "specs": list(config.specs),
            "max_new_tokens": config.max_new_tokens,
            "raw": config.raw,
            "twins": config.twins,
            "kernels_mode": config.kernels,
            "memory": "trace",
            "turns": [],
            "scenario": scenario,
            "expect": list(expect) if expect else None,
        }
    )
