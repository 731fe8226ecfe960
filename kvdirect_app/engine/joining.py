"""Panes that join a conversation already under way, and panes that leave it.

A lane that joins after `k` turns has to stand where it would stand had it been there from the start: its cache
after the visitor's `k` messages and its own replies to them.  `catch_up` replays exactly that for the joining
lanes alone: each earlier message is read into their caches, and each reply is regenerated greedily step by step
(the lane's own tokens, fed as the lockstep would have fed them), in one pass of the model per step over the
joining lanes' rows and nothing else: the reference and the lanes already there are not recomputed.  A turn that
was stopped ends for the joining lane after the same step.  With greedy decoding and the fixed-order kernels a
row's result does not depend on the rows beside it, so the joined lane holds the same bits and says the same words
as in a run that had it from the start (tests/engine/test_joining.py checks this for every built-in).

What the replay cannot measure, it does not claim: agreement, KL and |dlogit| need the reference's logits at each
earlier step, which no one keeps, so they cover the steps from the joining turn on (`teacher_forced_steps` counts
them; the summary's `joined_at_turn` says where they start); the first divergence is still found (against the
reference's recorded tokens), so a twin is forked where the free run left the reference's history and is fed that
history, and from the joining turn on the K/V are compared on it like any lane's.  The replay's step times are
one lane's, not the lockstep's: they are dropped (a joined lane's ms per token are its turns after joining).
"""

from __future__ import annotations

from typing import Callable, Iterator

from ..measure.observe import Observer
from ..models.prompts import InputError, Prompter
from ..plain.text import ReplyText
from .forwards import Forwards, Item
from .hooks import InputTap
from .lanes import Lane, TurnBytes
from .teacher_forcing import observe
from .turn_steps import TurnSteps


def fed_by_turn(lane: Lane) -> list[list[int]]:
    """The ids fed to `lane` in each turn's decode steps (after its prompt), from its history and its forwards."""
    turns: list[list[int]] = []
    pos, opened = 0, False
    for forward in lane.forwards:
        ids = lane.history[pos : pos + forward.q]
        pos += forward.q
        if forward.prompt:
            if not opened:  # a new turn's prompt (a prompt fed in pieces is one turn's)
                turns.append([])
            opened = forward.open
        else:
            turns[-1].extend(ids)
    return turns


def check_join(labels: list[str], lanes: list[Lane], reference: Lane, solo: bool, parked: bool, plain: bool):
    """A join refused before anything is built: one message naming what stands in the way."""
    if solo:
        raise InputError("join: a solo run drives the conversation with its one strategy; panes cannot join it")
    if parked:
        raise InputError("join: the conversation is parked; resume it first")
    if not plain:
        raise InputError(
            "join: this conversation had a turn with token ids, a question read after its context or an answer "
            "prefix; only plain messages can be replayed for a new pane"
        )
    have = {reference.label, *(lane.label for lane in lanes)}
    twice = [label for label in labels if label in have and label != reference.label]
    if twice or len(set(labels)) != len(labels):
        name = twice[0] if twice else next(x for x in labels if labels.count(x) > 1)
        raise InputError(f"strategies: {name!r} is listed twice")


def catch_up(
    lanes: list[Lane],
    reference: Lane,
    steps: TurnSteps,
    forwards: Forwards,
    observer: Observer,
    prompter: Prompter,
    tap: InputTap,
    prompt_ids: list[int],
    user_texts: list[str],
    turn_chunks: list[list[int]],
    turn_runs: list[tuple[int, bool]],
    twins: bool,
    agreement: bool,
) -> Iterator[dict]:
    """Replay every earlier turn for the joining `lanes` (module docstring); yields "catch_up_turn",
        "catch_up_step"... and "catch_up_turn_end" per turn.  `turn_runs`: each earlier turn's (steps, stopped):
    a stopped turn ends after its last step for the joining lanes too; another goes on while they choose tokens."""
    fed = fed_by_turn(reference)
    fork: Callable[[Lane], None] | None = steps.fork if twins and agreement else None
    labels = [lane.label for lane in lanes]
    for k, text in enumerate(user_texts):
        ran, stopped = turn_runs[k]
        yield {"type": "catch_up_turn", "turn": k, "strategies": labels, "turns": len(user_texts)}
        for lane in lanes:
            lane.book.turns.append(TurnBytes(k))
            lane.keeping = False
        chunk = lambda lane: prompt_ids if k == 0 else prompter.next(text, lane.pending)
        items = [Item(lane, chunk(lane)) for lane in lanes]
        items += [Item(lane, turn_chunks[k], twin=True) for lane in lanes if lane.tf_cache is not None]
        for _ in steps.prefill(k, items, tap):
            pass  # (the page hears the replay's progress by its steps)
        for lane in lanes:
            lane.tokens.append([])
            lane.texts.append("")
            lane.replies.append(ReplyText(steps.loaded.tokenizer))
            lane.active, lane.pending = True, None
        ref_tokens = reference.tokens[k]
        for index in range(ran if stopped else steps.max_new_tokens):
            ref_token = ref_tokens[index] if index < len(ref_tokens) else None
            for lane in lanes:  # the first divergence, against the reference's recorded token; a twin forks there
                observe(lane, ref_token, None, observer, fork, agreement)
            for lane in lanes:
                if lane.active:
                    steps.choose(lane, index)
            # (a turn stopped after this step fed the tokens chosen in it too: the lanes end after the loop)
            items = [Item(lane, [lane.tokens[k][-1]]) for lane in lanes if lane.active]
            items += [
                Item(lane, [fed[k][index]], twin=True)
                for lane in lanes
                if lane.tf_cache is not None and index < len(fed[k])
            ]
            chose = [lane for lane in lanes if len(lane.tokens[k]) == index + 1]
            if items:
                forwards.run(items, tap, turn_start=False)
            yield {
                "type": "catch_up_step",
                "turn": k,
                "index": index,
                "lanes": {lane.label: steps.report.lane_event(lane, k) for lane in chose},
            }
            if not any(lane.active for lane in lanes) and index + 1 >= len(ref_tokens):
                break  # the lockstep went on while the reference chose tokens (a twin is fed them)
        for lane in lanes:
            lane.active = False
            lane.book.turns[-1].decode_ms.clear()  # one lane's steps, not the lockstep's (module docstring)
            steps.end_turn(lane)
        yield {
            "type": "catch_up_turn_end",
            "turn": k,
            "texts": {lane.label: lane.texts[k] for lane in lanes},
            "bytes": {lane.label: lane.book.turns[-1].summary() for lane in lanes},
        }


def caught_up(lanes: list[Lane], reference: Lane, observer: Observer, compare: bool) -> dict:
    """After the replay: the lanes' step times start afresh (the replay's were one lane's, not the lockstep's), and
    their K/V are compared with the reference's from the next turn on, on the reference's history (the free run
    or its twin).  The "caught_up" event."""
    for lane in lanes:
        lane.times = type(lane.times)()
        if compare and lane.strategy.kv_comparable:
            owner = lane.owner if not lane.diverged else lane.twin if lane.tf_cache is not None else None
            if owner is not None:
                observer.compare_with(owner, reference.cache)
    return {"type": "caught_up", "strategies": [lane.label for lane in lanes]}
