"""Run several KV-cache strategies in lockstep on one conversation.

The full cache is always the reference.  In every step the reference, each
strategy and each teacher-forced twin (`teacher_forcing.py`) are fed their tokens;
by default they go through the model together, one layer at a time, each
with its own cache, bit for bit as if run one after another (`forwards.py`,
`lockstep.py`), and the reference's cache is updated first at every layer,
so a strategy can compare what it hands to attention with what the
reference holds for the same step.  Every piece of a step runs in a region
of the engine's observer (`observe.py`): a lane's own work, the shared pass,
an instrument's work (`instruments.py`), the engine's own (choosing tokens,
detokenising, events); each step reports its wall time and every part as
its clock read it, and what no clock covered as unattributed.  Each lane's
bytes are measured by the allocator the tensors live in (`meters.py`: the
allocator's ledger on the CPU) and kept beside what the strategy lists and
the formula (`lanes.ByteBook`); a prompt longer than `prefill_chunk` tokens
is fed in pieces, with a progress event per piece.  Sessions can be parked
between turns and resumed.

The engine yields plain dict events and never imports gradio.  It is built of parts, one reason each: its settings,
its public methods and the run's record (here), its lanes built before the first step (`lane_building.py`), a turn
and its steps (`turn_steps.py`'s `TurnSteps`), the state between turns (`between_turns.py`: park, resume, a saved
context, the thread count's kernels), the lanes' token maps and attention snapshots (`token_maps.py`), a step's
figures and the run's summary (`summary.py`'s `Report`).  The parts are plain functions and small held objects,
each given what it reads; the engine keeps the state they change and its public methods hand them over.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Iterator

import torch

from ..kernels.invariant import Kernels
from ..kernels.invariant import brief as kernels_brief
from ..measure.instruments import MEMORY_MODES, Instruments
from ..measure.memory import AllocationTracer
from ..measure.observe import Observer
from ..models.geometry import ModelGeometry
from ..models.loading import LoadedModel
from ..models.prompts import InputError, Prompter
from ..models.threads import pin, probe_determinism
from ..strategies import Strategy
from . import between_turns, joining, token_maps, turn_steps
from .between_turns import CONTEXT
from .forwards import Forwards
from .hooks import InputTap, model_lock
from .lane_building import build_lane, build_lanes, work_region
from .lanes import Lane
from .lockstep import batch_linears
from .summary import Report, memory_instrument, step_summary
from .turn_steps import TurnSteps

__all__ = [
    "Engine",
    "InputError",
    "InputTap",
    "Prompter",
    "model_lock",
    "run_to_end",
    "MEMORY_MODES",
    "memory_instrument",
    "step_summary",
]

PREFILL_CHUNK = 1024


class Engine:
    """Lockstep runner.  `run(turns)` yields events; `results()` gives the summary afterwards.

    Parameters
    ----------
    threads : pinned for every forward, on whichever thread runs it (default: torch's count now).
    memory : "allocator" (the allocator the tensors live in: held bytes and peaks measured per lane), "trace" (the
        allocator's every allocation, auditing the meter), "storage" (the tensors each strategy lists: declared,
        not measured), "none" (formula only), or "auto" (the default: "allocator" where it can be read, else
        "storage", and the instrument's name says why).
    instruments : False turns every instrument off (no memory, comparison, twins, agreement, snapshot, digest or
        RSS work at all): the engine then only runs the lanes.
    compare : False runs one strategy alone, as deployed, with no reference (`bench run --solo`).
    batch : every lane of a step in one pass through the model (bit-identical to one by one, which False does).
    twins : keep measuring agreement after a divergence on a teacher-forced twin (one more forward per lane).
    prefill_chunk : a prompt longer than this is fed in pieces of this many tokens (every lane the same).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        strategies: list[Strategy],
        max_new_tokens: int = 64,
        raw: bool = False,
        threads: int | None = None,
        memory: str = "auto",
        compare: bool = True,
        batch: bool = True,
        twins: bool = True,
        prefill_chunk: int = PREFILL_CHUNK,
        kernels: str = "invariant",
        instruments: bool = True,
    ):
        if max_new_tokens < 1:
            raise InputError(f"--max-new-tokens: {max_new_tokens} must be >= 1")
        if threads is not None and threads < 1:
            raise InputError(f"--threads: {threads} must be >= 1")
        if prefill_chunk < 1:
            raise InputError(f"--prefill-chunk: {prefill_chunk} must be >= 1")
        self.loaded = loaded
        self.model = loaded.model
        self.max_new_tokens = max_new_tokens
        self.threads = threads or torch.get_num_threads()
        self.prompter = Prompter(loaded, raw)
        self.geometry = ModelGeometry.from_config(loaded.config, loaded.dtype)
        if memory not in MEMORY_MODES:
            raise InputError(f"--memory: {memory!r} is not allowed; allowed: {', '.join(MEMORY_MODES)}")
        self.instruments = Instruments(memory=memory, twins=twins) if instruments else Instruments.off()
        self.memory, self.instrument, meter = memory_instrument(self.instruments.memory, loaded.device)
        self.instruments.memory = self.memory  # what ran ("auto" resolved), as the results say
        self.tracer = AllocationTracer(loaded.device, enabled=self.memory == "trace")
        self.observer = Observer(loaded.device, meter, self.tracer)
        weakref.finalize(self, self.observer.close)
        self._work = functools.partial(work_region, self.observer, self.tracer)  # an owner's work outside a pass
        self.peak_source = {
            "allocator": "measured" if meter is not None and meter.has_peak else "formula",
            "trace": "trace",
            "storage": "formula",
            "none": None,
        }[self.memory]
        self.twins, self.prefill_chunk = self.instruments.twins, prefill_chunk
        # Probed now, outside every timed step (the verdicts stay with the loaded model).
        self.kernels = Kernels.for_model(loaded, kernels, self.threads)
        self.forwards = Forwards(
            self.model,
            loaded.device,
            self.geometry,
            self.observer,
            self.tracer,
            self.threads,
            batch,
            self.kernels,
            self.instruments,
        )
        self.determinism = probe_determinism(loaded.device, loaded.dtype, self.threads)
        # The model's, the probes' and the strategies' first instances' blocks are no run's; the lanes' strategies
        # are built again inside their regions (`lane_building.build_lane`), after this.
        self.observer.count_unattributed_from_now()
        self.solo = not compare
        make = lambda strategy: build_lane(
            strategy, self.model, loaded.device, self.observer, self._work, self.kernels, self.memory, self.peak_source
        )
        self.reference, self.lanes, self.show = build_lanes(strategies, self.solo, make)
        self._make = make
        self.joining: list[Lane] = []  # lanes joined after the first turn, until `catch_up` has replayed it for them
        self.prompt_ids: list[int] = []
        self.user_texts: list[str] = []  # each turn's message, as given
        self.turn_runs: list[tuple[int, bool]] = []  # each turn's steps, and whether it was stopped before its end
        self.plain = True  # every turn so far a message alone (no question after it, no answer prefix, no context)
        self.turn_chunks: list[list[int]] = []
        self.turn_seconds: list[float] = []  # wall time of each turn, from its first forward to its last
        self.parked = False
        self.saved_context: dict | None = None  # label -> (cache, history length, forwards): `turn(save_context=)`
        # The step figures and the summary: the run's fixed facts now, what changes passed by each call.
        self.report = Report(
            loaded,
            self.observer,
            self.forwards,
            self.instruments,
            self.memory,
            self.instrument,
            self.determinism,
            self.solo,
            self.twins,
            max_new_tokens,
        )
        self.observer.register(CONTEXT)
        self.steps = TurnSteps(
            loaded,
            self.prompter,
            self.geometry,
            self.observer,
            self.forwards,
            self.report,
            self.instruments,
            self._work,
            self.reference,
            self.lanes,
            self.memory,
            self.solo,
            self.twins,
            max_new_tokens,
            prefill_chunk,
        )

    def about(self) -> dict:
        """Per shown strategy: the first line of its docstring and the settings it adapted (plain data, for a page
        that draws from events alone)."""
        out = {}
        for lane in self.all_lanes:
            doc = (type(lane.strategy).__doc__ or "").strip()
            out[lane.label] = {"doc": doc.splitlines()[0] if doc else "", "notes": list(lane.strategy.notes)}
        return out

    @property
    def all_lanes(self) -> list[Lane]:
        return [self.reference, *self.lanes]

    def _held(self, lane: Lane) -> int | None:
        return self.forwards.held(lane)

    def _keep_context(self, saved: dict):
        """The context a turn saved (`turn(save_context=True)`), for later turns `from_context`."""
        self.saved_context = saved

    # --- the run -------------------------------------------------------------
    def turn(
        self,
        text: str,
        ids: list[int] | None = None,
        answer_prefix: str = "",
        question: list[int] | None = None,
        save_context: bool = False,
        from_context: bool = False,
    ) -> Iterator[dict]:
        """One user turn for every strategy, continuing the conversation; yields "turn", "prefill"..., "step"...,
        "turn_end".

        Hooks go on the (shared, read-only) model for the turn only, under a
        per-model lock, so sessions sharing a model never see each other's
        hooks.  Closing the generator early (a stop button) ends the turn
        cleanly: every token chosen so far has been fed.  `ids` gives the first
        turn's token ids directly (benchmarks at an exact context length);
        `answer_prefix` opens a later turn's reply (fed after the user turn, as
        a task's answer prefix: `bench tasks --multiturn`).

        `question` (token ids) is read after the prompt, which the strategies compress at its end as usual, and
        nothing is evicted from then until the turn ends: kvpress's setting (`bench tasks --question after`), where
        the context is compressed alone and the question and the answer are read with the press off.
        `save_context` keeps every lane's cache as it stands after the prompt, before the question (the engine's
        own copy, whose bytes are no lane's); a later turn `from_context` starts every lane from that copy, its
        earlier questions and answers cut, and reads `question` alone as its prompt, nothing evicted (kvpress's
        multi-question mode: `bench tasks --multiturn --history drop`).
        """
        k = len(self.turn_chunks)
        turn_steps.check_turn(k, text, ids, answer_prefix, question, save_context, from_context, self.saved_context)
        if self.joining:
            raise InputError("turn: panes joined this conversation; replay its turns for them first (`catch_up`)")
        if k == 0:
            first = list(ids) if ids is not None else self.prompter.first(text)
            if len(first) >= self.loaded.max_context:
                raise InputError(
                    f"--prompt: {len(first)} tokens, longer than the model's context of {self.loaded.max_context}"
                )
            self.prompt_ids = first
        with model_lock(self.model):
            previous_threads = torch.get_num_threads()
            tap = InputTap(self.model, self.loaded.device)
            ran = 0  # the turn's steps
            try:
                if k == 0 and self.instruments.compare:
                    turn_steps.compare(self.reference, self.lanes, self.observer)
                    yield {
                        "type": "start",
                        "strategies": self.show,
                        "reference": self.reference.label,
                        "prompt_ids": self.prompt_ids,
                        "threads": self.threads,
                        "memory": self.instrument,
                        "determinism": self.determinism,
                        "about": self.about(),
                        "kernels": self.kernels.report(),
                        "kernels_line": kernels_brief(self.kernels.report()),
                    }
                if self.parked:
                    self._resume(tap)
                    yield {"type": "resume", "lanes": {lane.label: lane.parks[-1] for lane in self.all_lanes}}
                for event in self.steps.turn(
                    k,
                    text,
                    tap,
                    self.prompt_ids,
                    self.turn_chunks,
                    self.turn_seconds,
                    self._keep_context,
                    self.saved_context,
                    answer_prefix,
                    question,
                    save_context,
                    from_context,
                ):
                    ran += event["type"] == "step"
                    yield event
            finally:
                tap.close()
                if len(self.turn_chunks) > k:  # the turn began: what a pane joining later replays
                    self.user_texts.append(text)
                    self.turn_runs.append((ran, any(lane.active for lane in self.all_lanes)))
                    self.plain &= not (answer_prefix or question is not None or save_context or from_context)
                for lane in self.all_lanes:
                    if lane.active:  # interrupted: all chosen tokens were fed, nothing is pending
                        lane.active = False
                        self.steps.end_turn(lane)
                pin(previous_threads)

    # --- panes that join or leave (`joining.py`) ------------------------------------------------------------------
    def join(self, strategies: list[Strategy]) -> dict:
        """Between turns: lanes for `strategies` join the conversation (the full cache's spec only shows the
        reference).  Before the next turn, `catch_up` replays the earlier turns for them alone.  Returns a "join"
        event: the labels shown now, the new ones, what each is."""
        new = [s for s in strategies if s.spec() != self.reference.strategy.spec()]
        joining.check_join(
            [s.label for s in strategies], self.lanes, self.reference, self.solo, self.parked, self.plain
        )
        lanes = [self._make(s) for s in new]
        for lane in lanes:
            lane.joined = len(self.turn_chunks)
        self.lanes.extend(lanes)  # (the list `TurnSteps` holds: extended in place)
        self.joining.extend(lane for lane in lanes if self.turn_chunks)
        ref_spec = self.reference.strategy.spec()
        added = [s.label if s.spec() != ref_spec else self.reference.label for s in strategies]
        self.show.extend(label for label in added if label not in self.show)
        about = self.about()
        return {
            "type": "join",
            "strategies": list(self.show),
            "added": added,
            "turns": len(self.turn_chunks),
            "about": {label: about[label] for label in added},
        }

    def drop(self, labels: list[str]) -> dict:
        """Between turns: the panes shown as `labels` leave (their lanes and caches are dropped; the reference stays,
        unshown).  Returns a "drop" event with the labels shown now."""
        unknown = [label for label in labels if label not in self.show]
        if unknown:
            raise InputError(f"drop: {unknown[0]!r} is not shown; shown: {', '.join(self.show)}")
        for label in labels:
            self.show.remove(label)
            lane = next((lane for lane in self.lanes if lane.label == label), None)
            if lane is not None:
                self.lanes.remove(lane)
                for owner in (lane.owner, lane.twin):
                    self.observer.compare_with(owner, None)
                if lane in self.joining:
                    self.joining.remove(lane)
                lane.cache = lane.tf_cache = None
        return {"type": "drop", "dropped": list(labels), "strategies": list(self.show)}

    def catch_up(self) -> Iterator[dict]:
        """The earlier turns replayed for the lanes that joined (`joining.catch_up`), the others untouched; then
        their K/V are compared from the next turn on where they are on the reference's history.  Closed early (a
        stop), the joining lanes leave again, and a "drop" event says so."""
        lanes = list(self.joining)
        if not lanes:
            return
        done = False
        with model_lock(self.model):
            previous_threads = torch.get_num_threads()
            tap = InputTap(self.model, self.loaded.device)
            try:
                pin(self.threads, self.kernels.torch_threads)
                yield from joining.catch_up(
                    lanes,
                    self.reference,
                    self.steps,
                    self.forwards,
                    self.observer,
                    self.prompter,
                    tap,
                    self.prompt_ids,
                    self.user_texts,
                    self.turn_chunks,
                    self.turn_runs,
                    self.twins,
                    self.instruments.agreement,
                )
                done = True
            finally:
                tap.close()
                pin(previous_threads)
                self.joining = []
                if not done:
                    for lane in lanes:
                        lane.active = False
                    self.drop([lane.label for lane in lanes])
        yield joining.caught_up(lanes, self.reference, self.observer, self.instruments.compare)

    @contextlib.contextmanager
    def kernel_scope(self):
        """The run's kernels around work outside a step's pass (a resume, a benchmark's rebuild): every linear of
        the model and the replays' attention as the forwards computed them."""
        with batch_linears(self.model, 1, self.kernels), self.kernels.applied():
            yield

    def run(self, turns: list[str], park: bool = False) -> Iterator[dict]:
        """Every turn in order (parking every session between turns when `park`), then "done" with `results()`."""
        if not turns or any(not t or not t.strip() for t in turns):
            raise InputError("--prompt: empty prompt; give a non-empty user message")
        for i, text in enumerate(turns):
            if park and i:
                yield self.park()
            yield from self.turn(text)
        yield {"type": "done", "result": self.results()}

    # --- between turns (`between_turns.py`) ------------------------------------
    def park(self) -> dict:
        """Between turns: every cache keeps only its persistent state (full KV, inputs, anchors or token ids).

        The next `turn()` resumes each cache first (timed), rebuilding K/V exactly where the strategy
        rebuilds on resume.  Returns a "park" event with the parked bytes per strategy, measured and by formula.
        """
        event = between_turns.park(self.all_lanes, self._work, self.geometry, self._held)
        self.parked = True
        return event

    def resume(self) -> dict:
        """Rebuild every parked cache now (`turn()` does this itself when needed); returns a "resume" event."""
        with model_lock(self.model):
            tap = InputTap(self.model, self.loaded.device)
            try:
                self._resume(tap)
            finally:
                tap.close()
        return {"type": "resume", "lanes": {lane.label: lane.parks[-1] for lane in self.all_lanes}}

    def set_threads(self, threads: int) -> None:
        """Between turns: the forwards, rebuilds and replays that follow run at `threads`.  With invariant kernels
        the probe must pass at that count too (it runs now if it has not); a count where it fails is refused,
        not switched to other kernels."""
        probed = between_turns.kernels_at(self.loaded, self.kernels, threads, self.all_lanes)
        # The verdicts proven at `threads` from now on, everywhere the old ones were: the forwards, every cache
        # (its rebuilds and replays), the saved context's copies.
        self.kernels = self.forwards.kernels = probed
        between_turns.use_kernels(probed, self.all_lanes, self.saved_context)
        self.threads = self.forwards.threads = threads
        if not probed.invariant:
            self.forwards.check_native()

    @torch.inference_mode()
    def _resume(self, tap: InputTap):
        pin(self.threads, self.kernels.torch_threads)
        with self.kernel_scope():
            between_turns.resume_lanes(self.all_lanes, tap, self.observer, self._work, self.tracer, self.peak_source)
        self.parked = False

    # --- what the page draws (`token_maps.py`) and the summary (`summary.py`) --
    def _shown(self, label: str) -> Lane:
        return self.reference if label == self.reference.label else next(l for l in self.lanes if l.label == label)

    def token_map(self, label: str, layer: int) -> dict:
        """`token_maps.token_map` of the lane shown as `label`."""
        return token_maps.token_map(self._shown(label), self.loaded.tokenizer, layer)

    def token_maps(self) -> dict:
        """`token_maps.token_maps` of every shown lane: {label: {"tokens": [...], "states": [[...] per layer]}}."""
        return token_maps.token_maps(
            {label: self._shown(label) for label in self.show}, self.loaded.tokenizer, len(self.reference.cache.layers)
        )

    def attention_map(self, label: str, layer: int) -> dict | None:
        """`token_maps.attention_map` of the lane shown as `label` (None before the first turn)."""
        return token_maps.attention_map(self._shown(label), self.loaded.tokenizer, layer)

    def attention_maps(self) -> dict:
        """`token_maps.attention_maps` of every shown lane: {label: {"position", "turn", "tokens", "layers"}}."""
        return token_maps.attention_maps(
            {label: self._shown(label) for label in self.show}, self.loaded.tokenizer, len(self.reference.cache.layers)
        )

    def results(self) -> dict:
        """The run's summary (`Report.results`), with what the engine has now."""
        return self.report.results(
            self.reference,
            self.lanes,
            self.show,
            self.threads,
            self.kernels,
            self.prompt_ids,
            self.turn_chunks,
            self.turn_seconds,
        )


def run_to_end(
    engine: Engine, turns: list[str], park: bool = False, progress: Callable[[str], None] | None = None
) -> dict:
    """Consume every event; return the summary.  `progress` gets a line per prompt piece read (long prompts)."""
    result = None
    for event in engine.run(turns, park=park):
        if event["type"] == "done":
            result = event["result"]
        elif event["type"] == "prefill" and progress is not None:
            progress(f"turn {event['turn'] + 1}: read {event['done']:,} of {event['total']:,} prompt tokens")
    return result
