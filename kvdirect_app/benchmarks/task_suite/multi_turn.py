"""Conversations on the single-turn samples' needles: one context in turn 1, a question about another part of it in
every turn.

Conversations (`conversation`, `bench tasks --multiturn`): after SCBench's multi-turn mode (Li et al., ICLR 2025), a
shared context in turn 1 and a query per turn.  Turn 1 holds one needle per turn (single-key needles, or paragraphs
of the report; or, for qa on the document haystack, the report itself) and asks about one of them; every later turn
asks about another with its own answer prefix, answerable from turn 1 alone.  `score_turns` scores each turn's reply
against that turn's references.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from ...plain.scenarios import scenarios
from . import qa
from .haystack import (
    MAX_NEW_TOKENS,
    NIAH_NEEDLE,
    QA_PREFIX,
    QA_TEMPLATE,
    SampleError,
    Task,
    Weights,
    adjective_noun,
    check_settings,
    distinct,
    encode,
    first_words,
    fit,
    joined_ids,
    layout,
    match_score,
    measure_depth,
    needle_value,
    render_context,
    split_ids,
    stream,
)

MULTITURN_TASKS = ("niah_single_number", "niah_single_word", "niah_single_uuid", "qa")
MAX_TURNS = 20

_MT_TEMPLATE = (
    "Some special magic {kind}s are hidden within the following text. Make sure to memorize it. I will "
    "quiz you about the {kind}s afterwards.\n{context}\n{question}"
)
_MT_QUESTION = "What is the special magic {kind} for {key} mentioned in the provided text?"
_MT_PREFIX = "The special magic {kind} for {key} mentioned in the provided text is"
_QA_LATER = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {query}"
)
# Turn 1 where it asks nothing (`asked` without 1): the instruction and the context alone.
_MT_LATER = "Remember the special magic {kind}s: I will ask you about them later."
_QA_QUIET = (
    "Read the following documents: I will ask you questions about them later.\n\nThe following are given "
    "documents.\n\n{context}"
)


@dataclass(frozen=True)
class Turn:
    user: str  # turn 1: the instruction, the context and the first question; later turns: the question alone
    question: str  # what this turn asks (turn 1's is the end of its user message; "" where turn 1 asks nothing)
    answer_prefix: str
    answers: tuple[str, ...]  # as a Sample's: all of them (niah), any one of them (qa); none: a turn between
    needle_depth: float | None  # measured: percent of the context's haystack tokens before the asked needle
    # The end of turn 1's user message after the context, had turn 1 asked this turn's question (turn 1's own: the
    # end of its message): what follows the context when the earlier turns are cut (`question_ids`).
    tail: str = ""


@dataclass(frozen=True)
class Conversation:
    task: str
    context: int  # turn 1's prompt length asked for, in tokens (it has at most this many)
    seed: int
    haystack: str
    turns: tuple[Turn, ...]
    max_new_tokens: int  # per turn
    chat: bool = True


def conversation_parts(conv: Conversation, tokenizer) -> tuple[list[int], list[int]]:
    """Turn 1's (context ids, question ids), as `single_turn.prompt_parts`; later turns go through the engine's
    `Prompter.next` with their answer prefix."""
    first = conv.turns[0]
    return split_ids(tokenizer, first.user, first.tail, first.answer_prefix, conv.chat)


def conversation_ids(conv: Conversation, tokenizer) -> list[int]:
    """Turn 1's token ids: `conversation_parts` one after the other."""
    return sum(conversation_parts(conv, tokenizer), [])


def question_ids(conv: Conversation, tokenizer, n: int) -> list[int]:
    """What follows turn 1's context when turn `n` (0-based) asks its question right after it, every earlier
    question and answer cut (kvpress's multi-question mode; `bench tasks --multiturn --history drop`): the question
    ids turn 1 would have had, asking it."""
    first, turn = conv.turns[0], conv.turns[n]
    context = first.user[: len(first.user) - len(first.tail)]
    return split_ids(tokenizer, context + turn.tail, turn.tail, turn.answer_prefix, conv.chat)[1]


def score_turns(conv: Conversation, replies: list[str]) -> list[float]:
    """Each turn's reply scored against that turn's references (`score`'s rules); None for a turn that asks about no
    needle (`asked`)."""
    if len(replies) != len(conv.turns):
        raise ValueError(f"{len(replies)} replies for {len(conv.turns)} turns")
    return [match_score(conv.task, t.answers, r) if t.answers else None for t, r in zip(conv.turns, replies)]


def score_from_context(task: str, answers: tuple[str, ...], reply: str, earlier: list[str]) -> tuple[float, bool]:
    """(score, copied): a reply's score counting only what it found in the context, not in front of it already.

    A reference that stands in one of the lane's own `earlier` replies is not found from the context (a small model
    often answers turn 1 with another needle's value; a lossy cache keeps its own recent reply, and "finds" that
    needle later by copying it).  niah: the share of the references the reply holds that no earlier reply held;
    qa: 1 when the reply holds an accepted form of the answer and no earlier reply held one.  `copied`: the reply
    holds a reference that stood earlier."""
    if task == "qa":
        found = qa.contains(reply, answers)
        stood = any(qa.contains(e, answers) for e in earlier)
        return (1.0 if found and not stood else 0.0), found and stood
    low, before = reply.lower(), [e.lower() for e in earlier]
    held = [a.lower() in low for a in answers]
    stood = [any(a.lower() in e for e in before) for a in answers]
    return sum(h and not s for h, s in zip(held, stood)) / len(answers), any(h and s for h, s in zip(held, stood))


def score_turns_from_context(conv: Conversation, replies: list[str]) -> tuple[list[float | None], list[bool]]:
    """Each turn's `score_from_context` against the lane's own replies before it: (scores, copied); None and False
    for a turn that asks about no needle."""
    if len(replies) != len(conv.turns):
        raise ValueError(f"{len(replies)} replies for {len(conv.turns)} turns")
    scored = [
        score_from_context(conv.task, t.answers, r, replies[:n]) if t.answers else (None, False)
        for n, (t, r) in enumerate(zip(conv.turns, replies))
    ]
    return [s for s, _ in scored], [c for _, c in scored]


def _report_stream(words: int) -> tuple[tuple[str, str], ...]:
    """The report from its start, then RULER's noise: long enough for `words` words (no fact is stated twice)."""
    doc = stream("document")
    noise = stream("noise")
    return doc + noise * (words // 20 + 2)


def conversation(
    task: str,
    tokenizer,
    context: int,
    turns: int,
    seed: int,
    haystack: str = "noise",
    chat: bool = True,
    asked: tuple[int, ...] | None = None,
) -> Conversation:
    """A conversation after SCBench's multi-turn mode (Li et al., ICLR 2025: a shared context, then a query per
    turn) on RULER's needles: turn 1 carries a context of at most `context` tokens holding one needle per turn and
    asks about one of them; each later turn asks about another, answerable from turn 1 alone.

    niah_single_*: `turns` keys, each with its own value; the needles sit at evenly spread depths (the first at the
    haystack's start, the last at its end), asked in an order drawn from the seed.  qa with the noise haystack:
    `turns` questions about different paragraphs of the report, the paragraphs placed as niah's needles; qa with the
    document haystack: the report itself from its start (then RULER's noise if the context is longer), and
    `turns` questions whose paragraphs the context holds whole, drawn from the seed.  Everything comes from
    generators seeded with the settings, as `single_turn.sample`'s.

    `asked` (turn numbers, 1-based): only these turns ask, one needle each (turn 1 then holds that many); the others
    are the twenty-turn scenario's chat, in order, scored by nothing (the papers' setting: questions about turn 1
    at turns 5, 10 and 20 of a conversation)."""
    check_settings(task, tokenizer, context, 0, seed, haystack, chat)
    if task not in MULTITURN_TASKS:
        raise SampleError(f"task: {task!r} has no multi-turn form; allowed: {', '.join(MULTITURN_TASKS)}")
    if isinstance(turns, bool) or not isinstance(turns, int) or not 2 <= turns <= MAX_TURNS:
        raise SampleError(f"turns: {turns!r} is not allowed; allowed: whole numbers 2..{MAX_TURNS}")
    if asked is not None and (
        not asked
        or any(isinstance(t, bool) or not isinstance(t, int) for t in asked)
        or list(asked) != sorted(set(asked))
        or not 1 <= asked[0] <= asked[-1] <= turns
    ):
        raise SampleError(
            f"asked: {asked!r} is not allowed; allowed: turn numbers 1..{turns}, increasing, at least one"
        )
    asking = list(asked) if asked else list(range(1, turns + 1))
    n_asked = len(asking)
    says = random.Random(
        f"{task}|{seed}|{turns}|conversation" if asked is None else f"{task}|{seed}|{turns}|{tuple(asked)}|conversation"
    )
    gap = "" if chat else " "  # as a sample's: in plain text the answer prefix follows the question after a space
    order = says.sample(range(n_asked), n_asked)  # asked turn n asks about needle order[n] (needle i at place i)
    if task == "qa":
        if haystack == "document":
            conv = _report_conversation(tokenizer, context, n_asked, seed, chat, says, 1 in asking)
            return _between(conv, turns, asking) if asked else conv
        picked = _distinct_paragraphs(says, n_asked, range(len(qa.QUESTIONS)))
        if len(picked) < n_asked:
            raise SampleError(
                f"turns: {n_asked} asking turns are not allowed for qa; allowed: up to {len(picked)} "
                "(the report's questions are about that many different paragraphs)"
            )
        needles = [qa.paragraphs()[qa.fact_paragraph(q)] for q in picked]
        asks = [(_QA_LATER.format(query=q.question), QA_PREFIX, q.answers, q.question) for q in picked]
        tails = [_qa_tail(q.question) for q in picked]
        template = QA_TEMPLATE.replace("{query}", picked[order[0]].question) if 1 in asking else _QA_QUIET
        sep = "\n\n"
    else:
        kind = {"niah_single_word": "word", "niah_single_uuid": "uuid"}.get(task, "number")
        keys = distinct(lambda: adjective_noun(says), n_asked)
        values = distinct(lambda: needle_value(kind, says), n_asked, avoid=keys)
        needles = [NIAH_NEEDLE.format(kind=kind, key=k, value=v) for k, v in zip(keys, values)]
        asks = [
            (
                _MT_QUESTION.format(kind=kind, key=k),
                _MT_PREFIX.format(kind=kind, key=k),
                (v,),
                _MT_QUESTION.format(kind=kind, key=k),
            )
            for k, v in zip(keys, values)
        ]
        question = asks[order[0]][0] if 1 in asking else _MT_LATER.format(kind=kind)
        template, sep = _MT_TEMPLATE.format(kind=kind, context="{context}", question=question), "\n"
        tails = [
            _MT_TEMPLATE.format(kind=kind, context="{context}", question=a[0]).partition("{context}")[2] for a in asks
        ]
    # The first needle at the haystack's start (depth 0), the others at evenly spread shares of its boundaries (one
    # needle alone: in the middle).
    first_prefix = asks[order[0]][1] if 1 in asking else ""
    t = Task(template, first_prefix, (), needles, "anywhere", [i / (n_asked - 1) for i in range(1, n_asked)], sep)
    weigh = Weights(tokenizer)

    tail = template.partition("{context}")[2]

    def build(words: int):
        sents, inserts = layout(t, haystack, words, 0.0 if n_asked > 1 else 50.0, weigh)
        text, needle_spans, hay_spans = render_context(sents, inserts, sep)
        user = template.format(context=text)
        prefix = gap + t.answer_prefix if t.answer_prefix else ""
        return user, len(joined_ids(tokenizer, user, tail, prefix, chat)), (text, inserts, needle_spans, hay_spans)

    user, text, inserts, needle_spans, hay_spans = fit(build, context, task)
    placed = [x for _, x in inserts]
    depth = [measure_depth(tokenizer, user, text, needle_spans, hay_spans, placed.index(x), chat) for x in needles]
    out = [Turn(asks[i][0], asks[i][3], gap + asks[i][1], asks[i][2], depth[i], tails[i]) for i in order]
    if 1 in asking:
        out[0] = replace(out[0], user=user)
    else:
        out.insert(0, Turn(user, "", "", (), None, tail))
    conv = Conversation(task, context, seed, haystack, tuple(out), MAX_NEW_TOKENS[task], chat)
    return _between(conv, turns, asking) if asked else conv


def _between(conv: Conversation, turns: int, asking: list[int]) -> Conversation:
    """The asking turns at their numbers, the twenty-turn scenario's chat (its turns in order) in the others."""
    chat = iter(scenarios()["twenty-turns"]["turns"])
    asks = iter(conv.turns[1:])  # turn 1 (asking or not) is conv.turns[0]; the other asking turns follow in order
    out = [conv.turns[0]]
    for n in range(2, turns + 1):
        if n in asking:
            out.append(next(asks))
        else:
            text = next(chat)
            out.append(Turn(text, text, "", (), None))
    return replace(conv, turns=tuple(out))


def _report_conversation(
    tokenizer, context: int, n: int, seed: int, chat: bool, says: random.Random, first_asks: bool = True
) -> Conversation:
    """qa on the document: the report from its start, and `n` questions about paragraphs it holds whole (the first
    in turn 1, or with `first_asks` False all after a turn 1 that asks nothing)."""
    gap = "" if chat else " "
    shuffled = list(range(len(qa.QUESTIONS)))
    says.shuffle(shuffled)

    def window(question: str | None):
        template = QA_TEMPLATE.replace("{query}", question) if question is not None else _QA_QUIET
        prefix = gap + QA_PREFIX if question is not None else ""
        tail = template.partition("{context}")[2]

        def build(words: int):
            sents = first_words(_report_stream(words), words)
            text, _, hay_spans = render_context(sents, [], "\n\n")
            user = template.format(context=text)
            return user, len(joined_ids(tokenizer, user, tail, prefix, chat)), (text, [], [], hay_spans)

        return fit(build, context, "qa")

    # The window with the longest question asked first holds at most the paragraphs of any other first question's.
    longest = max(qa.QUESTIONS, key=lambda q: len(encode(tokenizer, q.question, False))).question
    text = window(longest if first_asks else None)[1]
    held = [i for i in shuffled if qa.paragraphs()[qa.fact_paragraph(qa.QUESTIONS[i])] in text]
    picked = _distinct_paragraphs(says, n, held)
    if len(picked) < n:
        raise SampleError(
            f"context: {context} tokens of the report hold whole paragraphs for {len(picked)} "
            f"different questions; allowed: turns up to {len(picked)} at this context, or a longer "
            "context"
        )
    user, text, _, _, hay_spans = window(picked[0].question if first_asks else None)
    out = [] if first_asks else [Turn(user, "", "", (), None, _QA_QUIET.partition("{context}")[2])]
    for q in picked:
        para = text.index(qa.paragraphs()[qa.fact_paragraph(q)])
        depth = measure_depth(tokenizer, user, text, [(para, para)], hay_spans, 0, chat)
        out.append(
            Turn(
                _QA_LATER.format(query=q.question) if out else user,
                q.question,
                gap + QA_PREFIX,
                q.answers,
                depth,
                _qa_tail(q.question),
            )
        )
    return Conversation("qa", context, seed, "document", tuple(out), MAX_NEW_TOKENS["qa"], chat)


def _qa_tail(question: str) -> str:
    """The end of the QA template after the documents, asking `question`."""
    return QA_TEMPLATE.replace("{query}", question).partition("{context}")[2]


def _distinct_paragraphs(rng: random.Random, n: int, among) -> list[qa.Question]:
    """`n` questions drawn from `among` (indices), no two about the same paragraph."""
    pool = list(among)
    rng.shuffle(pool)
    out, seen = [], set()
    for i in pool:
        k = qa.fact_paragraph(qa.QUESTIONS[i])
        if k not in seen:
            seen.add(k)
            out.append(qa.QUESTIONS[i])
        if len(out) == n:
            return out
    return out
