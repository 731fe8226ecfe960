"""Single-turn retrieval samples in the manner of RULER (Hsieh et al. 2024, arXiv 2404.06654), generated offline,
and their scores.

Our own generators after NVIDIA/RULER's scripts/data/synthetic (niah.py, variable_tracking.py, constants.py): the
same needles, templates, answer prefixes and metric; no code of theirs.  A sample is one prompt of a given length
in tokens of the model's own tokenizer, with the needle(s) at a given depth, and the strings a right answer holds.
The haystacks, the needles' depth and the prompt's length are `haystack`'s (its docstring says how); the
conversations on the same needles are `multi_turn`'s.

The tasks (RULER's configuration in brackets):

* ``niah_single_number`` / ``niah_single_word`` / ``niah_single_uuid``: one needle "One of the special magic
  numbers for {key} is: {value}." (words, uuids likewise) in the haystack; the question asks the key's value
  [niah_single_1/2/3: key a word, value a 7-digit number, a word or a UUID].
* ``niah_multikey``: four needles with four different keys; one key is asked, the other three needles are
  distractors [niah_multikey_1].
* ``niah_multivalue``: one key, four needles with four values; all four must be reported [niah_multivalue].
* ``niah_multiquery``: four keys, one value each, all four asked; all four values must be reported
  [niah_multiquery].
* ``variable_tracking``: one chain of 4 hops, "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE", ..., one assignment
  per line with noise between; the question asks which variables hold the value, all five must be named [vt,
  without RULER's one-shot example, which would not fit a 512-token context].
* ``qa``: a question about presets/long_document.md (kvdirect_app/benchmarks/task_suite/qa.py); the fact's paragraph
  is the needle [RULER's qa template and answer prefix; RULER draws SQuAD/HotpotQA, we have one document and our
  own questions].

Keys are "adjective-noun" words from the fixed lists in `haystack` (RULER draws them from wonderwords' lists), values
7-digit numbers, "adjective-noun" words or UUIDs; variable names are five capital letters, the chain's value a
5-digit number, as in RULER.  Everything is drawn from two ``random.Random`` of the sample's own, never the global
one: the needles' keys and values from one seeded with (task, seed), so that a seed asks the same question at every
context and depth; their places (and a depth left to chance) from one seeded with (task, context, depth, seed,
haystack).  The same settings give the same sample, in any process, whatever else ran before.

QA: the needle is the fact's paragraph, whole.  With the ``document`` haystack the context is a window of the
report in which the fact's paragraph appears once, at the asked depth: before it, the paragraphs that precede it in
the report (then the report's end, its start..., as if the other paragraphs were repeated), starting at a sentence
boundary; after it, the paragraphs that follow it, cut after a whole word to fill the context.  A context shorter
than the report shows the part of the report around the fact; a longer one repeats the other paragraphs but never
the fact's, so the answer is stated once.  Depth precision is a sentence of the report (~20-40 tokens), coarser than
the noise's.  With the ``noise`` haystack the paragraph is placed in the noise like any needle.  ``seed`` picks the
question: seeds 0, 1, 2... walk the set in order.

Scores (`score`): RULER's string_match_all, the fraction of the references that the reply contains (case-
insensitive): 1 or 0 for one needle, quarters for multi-value and multi-query, fifths for the chain.  QA: RULER's
string_match_part, 1 when the reply contains any accepted form of the answer (as a whole word, qa.contains).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from . import qa
from .haystack import (
    MAX_NEW_TOKENS,
    NIAH_NEEDLE,
    QA_PREFIX,
    QA_TEMPLATE,
    Task,
    Weights,
    adjective_noun,
    check_settings,
    distinct,
    fit,
    joined_ids,
    layout,
    match_score,
    measure_depth,
    needle_value,
    render_chat,
    render_context,
    split_ids,
)

NEEDLES = 4  # keys of multi-key and multi-query, values of multi-value (RULER's 4)
HOPS = 4  # the variable chain's hops (RULER's 4: five variables)

_NIAH_TEMPLATE = (
    "Some special magic {kind}s are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind}s afterwards.\n{context}\nWhat are all the special magic {kind}s "
    "for {query} mentioned in the provided text?"
)
_NIAH_PREFIX = "The special magic {kind}s for {query} mentioned in the provided text are"
_VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# RULER's ends "they are: " with a space; a prompt ending in a space makes a BPE model start its answer oddly.
_VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
    "assigned the value {query}, they are:"
)


@dataclass(frozen=True)
class Sample:
    task: str
    context: int  # the prompt length asked for, in tokens (the prompt has at most this many)
    depth: float | None  # as asked
    seed: int
    haystack: str
    user: str  # the user message (instruction + context + question), fed through the chat template
    tail: str  # the end of `user` after the context (the question, and the instruction around it)
    answer_prefix: str  # fed as the start of the assistant's reply (chat off: after the user message, from a space)
    answers: tuple[str, ...]  # references: all must be in the reply (niah, vt); any one of them (qa)
    needle_depth: float | None  # measured: percent of the haystack's tokens before the (asked or first) needle
    max_new_tokens: int
    chat: bool = True  # the user message goes through the chat template (`prompt_ids`)


def prompt_parts(sample: Sample, tokenizer) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the context (the chat template's start, the instruction, the haystack with its
    needles) and what follows it (the question, the chat template's end, the answer prefix).  `bench tasks
    --question after` compresses the first and feeds the second after it, as kvpress's pipeline does."""
    return split_ids(tokenizer, sample.user, sample.tail, sample.answer_prefix, sample.chat)


def prompt_ids(sample: Sample, tokenizer) -> list[int]:
    """The token ids the model is fed before it answers: `prompt_parts` one after the other.
    len() <= sample.context."""
    return joined_ids(tokenizer, sample.user, sample.tail, sample.answer_prefix, sample.chat)


def prompt_text(sample: Sample, tokenizer) -> str:
    """The prompt as text (for display; `prompt_ids` is what the model is fed)."""
    head = render_chat(tokenizer, sample.user) if sample.chat else sample.user
    return head + sample.answer_prefix


# --- the tasks ----------------------------------------------------------------------------------------------------
def _niah(task: str, rng: random.Random, goes: random.Random) -> Task:
    kind = {"niah_single_word": "word", "niah_single_uuid": "uuid"}.get(task, "number")
    n_keys = NEEDLES if task in ("niah_multikey", "niah_multiquery") else 1
    n_values = NEEDLES if task == "niah_multivalue" else 1
    keys = distinct(lambda: adjective_noun(rng), n_keys)
    values = [distinct(lambda: needle_value(kind, rng), n_values, avoid=keys) for _ in keys]
    # Values are distinct across keys too (a distractor's value must not be the asked one's).
    flat = [v for vs in values for v in vs]
    while len(set(flat)) < len(flat):
        values = [distinct(lambda: needle_value(kind, rng), n_values, avoid=keys) for _ in keys]
        flat = [v for vs in values for v in vs]
    needles = [(k, NIAH_NEEDLE.format(kind=kind, key=k, value=v)) for k, vs in zip(keys, values) for v in vs]
    if task == "niah_multiquery":
        asked = rng.sample(range(n_keys), n_keys)
    else:
        asked = [0]
    queries = [keys[i] for i in asked]
    answers = tuple(v for i in asked for v in values[i])
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    if task == "niah_multikey":
        ordered, others = [n for _, n in needles], "anywhere"  # the asked needle first, the distractors anywhere
    else:
        ordered, others = [n for _, n in needles], "after"
        goes.shuffle(ordered)  # RULER shuffles the needles
    template, prefix = _NIAH_TEMPLATE, _NIAH_PREFIX
    if len(answers) == 1:  # RULER's singular wording for one answer
        template = (
            template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("{kind}s", "{kind}")
        )
        prefix = prefix.replace("are", "is").replace("{kind}s", "{kind}")
    return Task(
        template.format(kind=kind, query=query, context="{context}"),
        prefix.format(kind=kind, query=query),
        answers,
        ordered,
        others,
        [goes.random() for _ in ordered[1:]],
        "\n",
    )


def _variable_tracking(rng: random.Random, goes: random.Random) -> Task:
    names = distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), HOPS + 1, avoid=("VAR",))
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(HOPS)]
    return Task(
        _VT_TEMPLATE.format(query=value, context="{context}"),
        _VT_PREFIX.format(n=HOPS + 1, query=value),
        tuple(names),
        chain,
        "after",
        [goes.random() for _ in chain[1:]],
        "\n",
    )


def _qa(seed: int, haystack: str) -> Task:
    q = qa.question_for(seed)
    k = qa.fact_paragraph(q)
    return Task(
        QA_TEMPLATE.format(query=q.question, context="{context}"),
        QA_PREFIX,
        q.answers,
        [qa.paragraphs()[k]],
        "after",
        [],
        "\n\n",
        k if haystack == "document" else None,
    )


# --- the sample ---------------------------------------------------------------------------------------------------
def sample(
    task: str, tokenizer, context: int, depth: float | None, seed: int, haystack: str = "noise", chat: bool = True
) -> Sample:
    """One prompt of at most `context` tokens (and within a few of it) with its needle(s) at `depth`; see the
    module's docstring and `haystack`'s.  Bad settings raise SampleError (a ValueError) with one line."""
    check_settings(task, tokenizer, context, depth, seed, haystack, chat)
    # Two generators, seeded from the settings (never the global one): what the needles say depends on the task
    # and the seed only, so that one seed asks the same question at every context and depth (a depth x context grid
    # differs only in where the needle is); where they go depends on every setting.
    says = random.Random(f"{task}|{seed}|needles")
    goes = random.Random(f"{task}|{context}|{None if depth is None else float(depth)}|{seed}|{haystack}|places")
    if task == "qa":
        t = _qa(seed, haystack)
    elif task == "variable_tracking":
        t = _variable_tracking(says, goes)
    else:
        t = _niah(task, says, goes)
    d = float(goes.randint(0, 100)) if depth is None else float(depth)
    # In a chat the prefix opens the assistant's turn; in plain text it follows the question after a space (RULER's
    # base template: the task's template, then its answer prefix, which starts with a space).
    prefix = t.answer_prefix if chat else " " + t.answer_prefix
    weigh = Weights(tokenizer)

    tail = t.template.partition("{context}")[2]

    def build(words: int):
        sents, inserts = layout(t, haystack, words, d, weigh)
        text, needle_spans, hay_spans = render_context(sents, inserts, t.needle_sep)
        user = t.template.format(context=text)
        return user, len(joined_ids(tokenizer, user, tail, prefix, chat)), (text, inserts, needle_spans, hay_spans)

    user, text, inserts, needle_spans, hay_spans = fit(build, context, task)
    primary = [x for _, x in inserts].index(t.needles[0])
    measured = measure_depth(tokenizer, user, text, needle_spans, hay_spans, primary, chat)
    return Sample(
        task,
        context,
        None if depth is None else float(depth),
        seed,
        haystack,
        user,
        tail,
        prefix,
        t.answers,
        measured,
        MAX_NEW_TOKENS[task],
        chat,
    )


def score(sample: Sample, reply: str) -> float:
    """RULER's string_match_all (niah, variable tracking): the share of the references the reply contains,
    case-insensitive.  QA: 1.0 when the reply contains any accepted form of the answer (as a whole word), else 0."""
    return match_score(sample.task, sample.answers, reply)
