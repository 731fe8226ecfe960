"""One turn of the engine, step by step: its arguments checked (`check_turn`), its prompt fed to every lane in
pieces, then each step (the reference's and every lane's token chosen, agreement measured, every lane fed in one
pass, the step's event), and each lane's turn ended.

`TurnSteps` holds what a turn reads and never replaces (the model, the lanes, the forwards, the observer, the
report, the settings); the run's record a turn adds to (the prompt's ids, each turn's chunk and wall time, the saved
context) stays on the `Engine` (`runner.py`), which hands it over with each turn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..measure.instruments import Instruments
from ..measure.observe import ENGINE, Observer, instrument
from ..models.geometry import ModelGeometry
from ..models.loading import LoadedModel
from ..models.prompts import InputError, Prompter
from ..models.threads import one_thread
from ..plain.text import ReplyText
from . import between_turns
from .between_turns import Work
from .forwards import Forwards, Item
from .hooks import InputTap
from .lanes import Lane, TurnBytes
from .summary import Report
from .teacher_forcing import agree, observe


def check_turn(
    k: int,
    text: str,
    ids: list[int] | None,
    answer_prefix: str,
    question: list[int] | None,
    save_context: bool,
    from_context: bool,
    saved_context: dict | None,
):
    """Turn `k`'s arguments refused before the turn takes the model (`Engine.turn` says what each one means)."""
    if not text or not text.strip():
        raise InputError("--prompt: empty prompt; give a non-empty user message")
    if ids is not None and k != 0:
        raise InputError("token ids can only be given for the first turn")
    if answer_prefix and k == 0:
        raise InputError("an answer prefix opens a later turn; the first turn's ids hold its own")
    if question is not None and not question:
        raise InputError("question: empty; give the token ids read after the prompt, or None")
    if save_context and question is None:
        raise InputError("save_context: the context is what precedes a question; give question= too")
    if from_context and (saved_context is None or question is None or answer_prefix):
        raise InputError(
            "from_context: needs a context saved by an earlier turn (save_context=True) and the "
            "question's ids (question=), which hold their own answer prefix"
        )


def compare(reference: Lane, lanes: list[Lane], observer: Observer):
    """Every comparable lane's K/V compared with the reference's from now on."""
    for lane in lanes:
        if lane.strategy.kv_comparable:
            observer.compare_with(lane.owner, reference.cache)


@dataclass
class TurnSteps:
    """What a turn reads: the model, the lanes and the parts that run them, and the run's settings."""

    loaded: LoadedModel
    prompter: Prompter
    geometry: ModelGeometry
    observer: Observer
    forwards: Forwards
    report: Report
    instruments: Instruments
    work: Work
    reference: Lane
    lanes: list[Lane]
    memory: str
    solo: bool
    twins: bool
    max_new_tokens: int
    prefill_chunk: int

    @property
    def all_lanes(self) -> list[Lane]:
        return [self.reference, *self.lanes]

    def prefill(self, k: int, items: list[Item], tap: InputTap, first_piece: int = 0) -> Iterator[dict]:
        """Every lane's prompt, in pieces of at most `prefill_chunk` tokens; an event after each piece.
        `first_piece`: the pieces already fed in this turn (a question read after the prompt continues them)."""
        total = max(len(item.ids) for item in items)
        size = self.prefill_chunk
        for piece, start in enumerate(range(0, total, size)):
            pieces = [
                Item(item.lane, item.ids[start : start + size], item.twin, start + size < len(item.ids))
                for item in items
                if item.ids[start : start + size]
            ]
            self.forwards.run(pieces, tap, turn_start=True, piece=first_piece + piece)
            if total > size:
                yield {"type": "prefill", "turn": k, "done": min(start + size, total), "total": total}

    def turn(
        self,
        k: int,
        text: str,
        tap: InputTap,
        prompt_ids: list[int],
        turn_chunks: list[list[int]],
        turn_seconds: list[float],
        keep_context: Callable[[dict], None],
        saved_context: dict | None,
        answer_prefix: str = "",
        question: list[int] | None = None,
        save_context: bool = False,
        from_context: bool = False,
    ) -> Iterator[dict]:
        """Turn `k`: "turn", "prefill"..., "step"..., "turn_end".  It appends its chunk to `turn_chunks` and its wall
        time to `turn_seconds`, hands the context it saves to `keep_context`, and starts from `saved_context` when
        `from_context`."""
        ref, lanes = self.reference, self.lanes
        if from_context:
            between_turns.from_context(self.all_lanes, saved_context, self.work)
            if self.instruments.compare and not self.solo:
                compare(ref, lanes, self.observer)
        tail = self.prompter.encode(answer_prefix, False) if answer_prefix else []
        after = [] if from_context or question is None else list(question)  # read after the prompt, nothing evicted
        chunk = lambda lane: (
            list(question) if from_context else prompt_ids if k == 0 else self.prompter.next(text, lane.pending) + tail
        )
        ref_chunk = chunk(ref)
        if ref.cache.get_seq_length() + len(ref_chunk) + len(after) >= self.loaded.max_context:
            raise InputError(f"turn {k + 1}: the conversation passes the model's context of {self.loaded.max_context}")
        turn_chunks.append(ref_chunk + after)
        yield {"type": "turn", "turn": k, "user": text, "chunk_ids": ref_chunk + after}
        for lane in self.all_lanes:
            lane.book.turns.append(TurnBytes(k))
            lane.keeping = from_context
        obs = self.observer
        started = obs.now()
        items = [Item(ref, ref_chunk)]
        for lane in lanes:
            items.append(Item(lane, chunk(lane)))
            if lane.tf_cache is not None:
                items.append(Item(lane, ref_chunk, twin=True))
        yield from self.prefill(k, items, tap)
        if save_context:
            keep_context(between_turns.save_context(self.all_lanes, self.observer))
        if after:
            for lane in self.all_lanes:
                lane.keeping = True
            pieces = -(-len(ref_chunk) // self.prefill_chunk)
            yield from self.prefill(k, [Item(item.lane, after, item.twin) for item in items], tap, pieces)
        for lane in self.all_lanes:
            lane.tokens.append([])
            lane.texts.append("")
            lane.replies.append(ReplyText(self.loaded.tokenizer))
            lane.active, lane.pending = True, None
        index = 0
        inst = self.instruments
        fork = self.fork if self.twins and inst.agreement else None
        while ref.active or any(lane.active for lane in lanes):
            step_started, mark = obs.now(), obs.mark()
            ref_token = self.choose(ref, index) if ref.active else None
            ref_logits = ref.logits if ref_token is not None else None
            event = {"type": "step", "turn": k, "index": index, "lanes": {}}
            # Agreement for every lane in one pass over the stacked logits, on one thread: per lane, a few small
            # ops on a vocabulary's logits each woke the second thread and waited for the GIL behind the page's
            # handler (113 ms a step in the app, 3 ms in the CLI).
            with (
                obs.region(instrument("agreement"), "agree") if inst.agreement else contextlib.nullcontext(),
                one_thread(),
            ):
                compared = [(lane, observe(lane, ref_token, ref_logits, obs, fork, inst.agreement)) for lane in lanes]
                compared = [(lane, logits) for lane, logits in compared if logits is not None]
                if compared:
                    obs.counts["agreement"] += len(compared)
                    agree([lane for lane, _ in compared], [logits for _, logits in compared], ref_token, ref_logits)
            for lane in lanes:
                if lane.active:
                    self.choose(lane, index)
            items = []
            if ref_token is not None and ref.active:
                items.append(Item(ref, [ref_token]))
            for lane in lanes:
                token = lane.tokens[k][-1] if lane.tokens[k] and len(lane.tokens[k]) == index + 1 else None
                if token is not None and lane.active:
                    items.append(Item(lane, [token]))
                if lane.tf_cache is not None and ref_token is not None and ref.active:
                    items.append(Item(lane, [ref_token], twin=True))
            fed = {item.lane.label for item in items if not item.twin}
            self.forwards.run(items, tap, turn_start=False)
            with obs.region(ENGINE, "events"):
                for lane in self.all_lanes:
                    if len(lane.tokens[k]) == index + 1:
                        event["lanes"][lane.label] = self.report.lane_event(lane, k)
            event.update(self.report.step_figures(step_started, mark, fed, self.all_lanes, len(turn_chunks)))
            yield event
            index += 1
        turn_seconds.append(obs.now() - started)
        for lane in self.all_lanes:
            self.end_turn(lane)
        yield {
            "type": "turn_end",
            "turn": k,
            "texts": {lane.label: lane.texts[k] for lane in self.all_lanes},
            "seconds": turn_seconds[-1],
            "bytes": {lane.label: lane.book.turns[-1].summary() for lane in self.all_lanes},
        }

    def choose(self, lane: Lane, index: int) -> int:
        """Greedy token at `index` of the current turn; ends the lane's turn on EOS, the token limit or the context."""
        with self.observer.region(ENGINE, "choose"):
            token = int(torch.argmax(lane.logits))
            lane.tokens[-1].append(token)
        with self.observer.region(ENGINE, "detokenize"):
            lane.texts[-1] = lane.replies[-1].add(token)
        seen = lane.cache.get_seq_length()
        if token in self.loaded.eos_ids:
            lane.active = False
        elif index + 1 >= self.max_new_tokens or seen + 1 >= self.loaded.max_context:
            lane.active, lane.pending = False, token
        return token

    def fork(self, lane: Lane):
        """The lane's teacher-forced twin, forked from its cache at its first divergence (the twins' work)."""
        self.observer.register(lane.twin)
        with self.work(lane.twin, "fork"):
            lane.tf_cache = lane.cache.fork()
        if self.instruments.compare and lane.strategy.kv_comparable:
            self.observer.compare_with(lane.twin, self.reference.cache)

    def end_turn(self, lane: Lane):
        """The turn is over for this lane: drop what only the turn needed, then count what stays."""
        for owner, cache in lane.caches():
            with self.work(owner, "end_turn"):
                cache.end_turn()
        if lane.replies:
            lane.texts[-1] = lane.replies[-1].final()
        seen = lane.cache.get_seq_length()
        held = self.forwards.held(lane)
        formula = lane.strategy.formula_between_turns(self.geometry, seen, lane.forwards)
        obs = self.observer
        if self.memory != "none":
            lane.book.declared(formula, obs.declared(lane.cache))
        if self.memory == "trace" and obs.meter is not None:  # the meter beside the trace, between turns too
            lane.book.audit("between turns", seen, obs.held(lane.owner), None, held, None)
        lane.book.between_turns(seen, held, formula, obs.outside(lane.owner) if self.memory != "none" else None)
        lane.keeping = False
        if self.instruments.digests:
            lane.kv_digest = obs.digest(lane.cache)
