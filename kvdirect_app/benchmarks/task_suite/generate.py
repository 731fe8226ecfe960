"""Retrieval tasks in the manner of RULER (Hsieh et al. 2024, arXiv 2404.06654), generated offline, and their scores.

Our own generators after NVIDIA/RULER's scripts/data/synthetic (niah.py, variable_tracking.py, constants.py): the
same needles, templates, answer prefixes and metric; no code of theirs.  A sample is one prompt of a given length
in tokens of the model's own tokenizer, with the needle(s) at a given depth, and the strings a right answer holds.

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
* ``qa``: a question about presets/long_document.md (kvdirect_app/benchmarks/task_suite/qa.py); the fact's paragraph is the needle
  [RULER's qa template and answer prefix; RULER draws SQuAD/HotpotQA, we have one document and our own questions].

Keys are "adjective-noun" words from the fixed lists below (RULER draws them from wonderwords' lists), values
7-digit numbers, "adjective-noun" words or UUIDs; variable names are five capital letters, the chain's value a
5-digit number, as in RULER.  Everything is drawn from two ``random.Random`` of the sample's own, never the global
one: the needles' keys and values from one seeded with (task, seed), so that a seed asks the same question at every
context and depth; their places (and a depth left to chance) from one seeded with (task, context, depth, seed,
haystack).  The same settings give the same sample, in any process, whatever else ran before.

The haystacks: ``noise`` is RULER's noise ("The grass is green. The sky is blue. The sun is yellow. Here we go.
There and back again.", one such line after another); ``document`` is the report in presets/long_document.md (its
opening instruction line left out), repeated as needed.  Either is cut after a whole number of words so that the
prompt is as long as asked: ``context`` counts every token the model is fed before it answers (the chat template,
the user message, the answer prefix; `prompt_ids`), and the prompt is the longest that does not pass it (a few
tokens short at most: a word is a token or two).

Depth: needles go in at sentence boundaries, each on a line of its own (RULER inserts needles between the haystack's
sentences).  ``depth`` d (0..100) puts the needle at the boundary nearest d percent of the haystack's tokens; the
haystack is the same at every depth (give or take its last word), only the needle moves.  With several needles, the
needle that d places is the asked one (multi-key; the three distractors go to boundaries drawn at random) or the
first one (multi-value, multi-query, the variable chain: the others go to random boundaries after it, in order).
``depth=None`` draws d from the seed, as RULER draws its depths.  ``Sample.needle_depth`` is measured on the
finished prompt: the percent of the haystack's tokens (the needles' own tokens not counted, so that 0 and 100 can be
reached with several needles) that come before that needle.  In a chat the answer prefix opens the assistant's turn;
with ``chat=False`` it follows the question after a space (RULER's base template).

QA: the needle is the fact's paragraph, whole.  With the ``document`` haystack the context is a window of the
report in which the fact's paragraph appears once, at the asked depth: before it, the paragraphs that precede it in
the report (then the report's end, its start..., as if the other paragraphs were repeated), starting at a sentence
boundary; after it, the paragraphs that follow it, cut after a whole word to fill the context.  A context shorter
than the report shows the part of the report around the fact; a longer one repeats the other paragraphs but never
the fact's, so the answer is stated once.  Depth precision is a sentence of the report (~20-40 tokens), coarser than
the noise's.  With the ``noise`` haystack the paragraph is placed in the noise like any needle.  ``seed`` picks the
question: seeds 0, 1, 2... walk the set in order.

Generation lengths (``Sample.max_new_tokens``): RULER generates 128 tokens for niah, 30 for variable tracking, 32
for qa, for long answers of big models.  Ours are bounds for exact short answers of small models: a 7-digit number
or a word is under 10 tokens with SmolLM2's tokenizer (digits are single tokens), so 16; a UUID ~37, so 48; four
numbers with separators ~40, so 48; five variable names ~20, so 32; a QA answer, 32 (RULER's).  The tests check
that the references fit.

Conversations (`conversation`, `bench tasks --multiturn`): after SCBench's multi-turn mode (Li et al., ICLR 2025), a
shared context in turn 1 and a query per turn.  Turn 1 holds one needle per turn (single-key needles, or paragraphs
of the report; or, for qa on the document haystack, the report itself) and asks about one of them; every later turn
asks about another with its own answer prefix, answerable from turn 1 alone.  `score_turns` scores each turn's reply
against that turn's references.

Scores (`score`): RULER's string_match_all, the fraction of the references that the reply contains (case-
insensitive): 1 or 0 for one needle, quarters for multi-value and multi-query, fifths for the chain.  QA: RULER's
string_match_part, 1 when the reply contains any accepted form of the answer (as a whole word, qa.contains).
"""

from __future__ import annotations

import bisect
import math
import random
import string
import uuid
from dataclasses import dataclass, replace
from functools import lru_cache

from ...plain.errors import UserError
from . import qa

TASKS = ("niah_single_number", "niah_single_word", "niah_single_uuid", "niah_multikey", "niah_multivalue",
         "niah_multiquery", "variable_tracking", "qa")
HAYSTACKS = ("noise", "document")
DEPTHLESS: tuple[str, ...] = ()  # tasks that take no depth: none, every task places its (first) needle at one
# A floor for settings checks: no task fits in fewer tokens (`sample` names each task's own minimum: with SmolLM2's
# tokenizer from 79 tokens, niah_single_word as plain text, to 237, qa through the chat template).
MIN_CONTEXT = 64

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
MAX_NEW_TOKENS = {"niah_single_number": 16, "niah_single_word": 16, "niah_single_uuid": 48, "niah_multikey": 16,
                  "niah_multivalue": 48, "niah_multiquery": 48, "variable_tracking": 32, "qa": 32}
NEEDLES = 4  # keys of multi-key and multi-query, values of multi-value (RULER's 4)
HOPS = 4  # the variable chain's hops (RULER's 4: five variables)

ADJECTIVES = ("amber", "brave", "calm", "clever", "crimson", "curly", "dusty", "eager", "early", "fancy", "fluffy",
              "gentle", "giant", "glossy", "golden", "grumpy", "happy", "hollow", "humble", "icy", "jolly", "lively",
              "lucky", "mellow", "misty", "noble", "odd", "olive", "plucky", "polite", "proud", "quick", "quiet",
              "rapid", "rusty", "sandy", "shiny", "silent", "silky", "sleepy", "smoky", "sunny", "swift", "tidy",
              "velvet", "wild", "windy", "witty")
NOUNS = ("acorn", "anchor", "apple", "badger", "basket", "beetle", "blanket", "bucket", "button", "candle", "carrot",
         "castle", "cobbler", "comet", "cricket", "dolphin", "falcon", "feather", "fiddle", "garden", "glacier",
         "hammer", "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern", "lemon", "meadow", "mitten",
         "needle", "orchard", "otter", "parrot", "pebble", "pepper", "pillow", "pocket", "rabbit", "saddle", "spider",
         "teapot", "thimble", "tulip", "walnut", "whistle")

_NIAH_TEMPLATE = ("Some special magic {kind}s are hidden within the following text. Make sure to memorize it. "
                  "I will quiz you about the {kind}s afterwards.\n{context}\nWhat are all the special magic {kind}s "
                  "for {query} mentioned in the provided text?")
_NIAH_PREFIX = "The special magic {kind}s for {query} mentioned in the provided text are"
_NIAH_NEEDLE = "One of the special magic {kind}s for {key} is: {value}."
_VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
                "Question: Find all variables that are assigned the value {query} in the text above.")
# RULER's ends "they are: " with a space; a prompt ending in a space makes a BPE model start its answer oddly.
_VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
              "assigned the value {query}, they are:")
_QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any "
                "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
                "the given documents. Only give me the answer and do not output any other words.\n\n"
                "Question: {query}")
_QA_PREFIX = "Answer:"


class SampleError(UserError):
    """A bad task setting; the one-line message names the setting and its allowed values."""


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


# --- prompts ------------------------------------------------------------------------------------------------------
def _render_chat(tokenizer, user: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _parts(tokenizer, user: str, tail: str, answer_prefix: str, chat: bool) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the prompt as the Studio feeds it (the user turn through the chat template, or
    plain text with the tokenizer's special tokens; then the answer prefix), cut where the context ends and `tail`,
    the rest of the user message, begins.  Each part is encoded on its own, as kvpress's pipeline encodes the
    context and the question, so the two settings of `bench tasks --question` feed the same ids."""
    head = _render_chat(tokenizer, user) if chat else user
    at = head.rfind(user)
    if at < 0 or not user.endswith(tail):
        raise SampleError("chat: this tokenizer's chat template changes the user message, so the context cannot be "
                          "cut from the question; allowed: chat=False")
    at += len(user) - len(tail)
    return (_encode(tokenizer, head[:at], not chat),
            _encode(tokenizer, head[at:], False) + _encode(tokenizer, answer_prefix, False))


def _ids(tokenizer, user: str, tail: str, answer_prefix: str, chat: bool) -> list[int]:
    context, question = _parts(tokenizer, user, tail, answer_prefix, chat)
    return context + question


def prompt_parts(sample: Sample, tokenizer) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the context (the chat template's start, the instruction, the haystack with its
    needles) and what follows it (the question, the chat template's end, the answer prefix).  `bench tasks
    --question after` compresses the first and feeds the second after it, as kvpress's pipeline does."""
    return _parts(tokenizer, sample.user, sample.tail, sample.answer_prefix, sample.chat)


def prompt_ids(sample: Sample, tokenizer) -> list[int]:
    """The token ids the model is fed before it answers: `prompt_parts` one after the other.
    len() <= sample.context."""
    return _ids(tokenizer, sample.user, sample.tail, sample.answer_prefix, sample.chat)


def prompt_text(sample: Sample, tokenizer) -> str:
    """The prompt as text (for display; `prompt_ids` is what the model is fed)."""
    head = _render_chat(tokenizer, sample.user) if sample.chat else sample.user
    return head + sample.answer_prefix


# --- haystacks ----------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _stream(name: str, skip: int | None = None) -> tuple[tuple[str, str], ...]:
    """One cycle of a haystack's sentences, each with the separator that follows it.  `skip`: the document
    without that paragraph, starting with the paragraph after it (the QA window's stream)."""
    if name == "noise":
        sents = qa.sentences(NOISE)
        return tuple((s, "\n" if i == len(sents) - 1 else " ") for i, s in enumerate(sents))
    paras = list(qa.paragraphs())
    if skip is not None:
        paras = paras[skip + 1:] + paras[:skip]
    out = []
    for p in paras:
        sents = qa.sentences(p)
        out += [(s, "\n\n" if i == len(sents) - 1 else " ") for i, s in enumerate(sents)]
    return tuple(out)


class _Weights:
    """Tokens per sentence (with its leading space), measured once per sentence: the haystack's token positions."""

    def __init__(self, tokenizer):
        self.tok, self.seen = tokenizer, {}

    def __call__(self, text: str) -> int:
        if text not in self.seen:
            self.seen[text] = len(_encode(self.tok, " " + text, False))
        return self.seen[text]


def _forward(cycle, words: int) -> list[tuple[str, str, float]]:
    """The first `words` words of the endless cycle: whole sentences, the last one cut after a word.
    Items are (text, separator, share of the sentence kept)."""
    out, i = [], 0
    while words > 0:
        text, sep = cycle[i % len(cycle)]
        w = text.split(" ")
        if len(w) <= words:
            out.append((text, sep, 1.0))
        else:
            out.append((" ".join(w[:words]), "", words / len(w)))
        words -= len(w)
        i += 1
    return out


# --- the layouts: where the haystack's sentences and the needles go, for a haystack of `words` words ---------------
@dataclass
class _Task:
    template: str  # the user message, with {context}
    answer_prefix: str
    answers: tuple[str, ...]
    needles: list[str]  # needles[0] is the one `depth` places
    others: str  # where needles[1:] go: "anywhere" (distractors) or "after" (in order, after needles[0])
    fractions: list[float]  # drawn once per sample: the others' places, as shares of the boundaries open to them
    needle_sep: str  # what follows a needle: a line break, or a blank line for a QA paragraph
    window: int | None = None  # QA with the document: the fact's paragraph (the window layout)


def _nearest(cum: list[float], target: float) -> int:
    return min(range(len(cum)), key=lambda j: (abs(cum[j] - target), j))


def _layout(t: _Task, haystack: str, words: int, d: float, weigh: _Weights):
    """(sentences, inserts): the haystack's sentences and (boundary, needle) pairs, boundary j = after j
    sentences."""
    if t.window is None:  # the haystack from its start; the needle moves within it
        sents = _forward(_stream(haystack), words)
        cum = [0.0]
        for text, _, _ in sents:
            cum.append(cum[-1] + weigh(text))
        b = _nearest(cum, d / 100.0 * cum[-1])
    else:  # a window of the report around the fact's paragraph
        cycle = _stream("document", t.window)
        back, cum, used = [], [0.0], [0]
        i = len(cycle) - 1
        while True:  # whole sentences before the fact, going back
            text, sep = cycle[i % len(cycle)]
            n = len(text.split(" "))
            if used[-1] + n > words:
                break
            back.append((text, sep, 1.0))
            cum.append(cum[-1] + weigh(text))
            used.append(used[-1] + n)
            i -= 1
        # nb sentences before, the rest of the words after: the nb whose share before is nearest d
        ahead = _forward(cycle, words)
        whole_words, whole_weight = [0], [0.0]
        for text, _, share in ahead:
            if share == 1.0:
                whole_words.append(whole_words[-1] + len(text.split(" ")))
                whole_weight.append(whole_weight[-1] + weigh(text))

        def after_weight(r: int) -> float:  # the tokens of the first r words after the fact (`_forward`'s cut)
            k = bisect.bisect_right(whole_words, r) - 1
            rest = r - whole_words[k]
            return whole_weight[k] + (weigh(" ".join(ahead[k][0].split(" ")[:rest])) if rest else 0.0)

        after = [after_weight(words - u) for u in used]
        nb = min(range(len(cum)), key=lambda j: (abs(cum[j] - d / 100.0 * (cum[j] + after[j])), j))
        sents = back[:nb][::-1] + _forward(cycle, words - used[nb])
        b = nb
    n = len(sents)
    inserts = [(b, 0, t.needles[0])]
    if t.others == "anywhere":
        inserts += [(min(int(f * (n + 1)), n), 1, x) for f, x in zip(t.fractions, t.needles[1:])]
    else:
        fr = sorted(t.fractions)
        inserts += [(b + min(int(f * (n - b + 1)), n - b), 1 + k, x) for k, (f, x) in enumerate(zip(fr, t.needles[1:]))]
    inserts.sort(key=lambda x: (x[0], x[1]))
    return sents, [(j, x) for j, _, x in inserts]


def _render(sents, inserts, needle_sep: str) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """The context text, the needles' character spans (in `inserts` order) and the haystack's spans."""
    parts: list[str] = []
    needle_spans, hay_spans = [], []
    pos = 0
    k = 0

    def add(text):
        nonlocal pos
        parts.append(text)
        pos += len(text)

    for i in range(len(sents) + 1):
        while k < len(inserts) and inserts[k][0] == i:
            if parts and parts[-1].isspace():  # the needle gets a line (a paragraph) of its own
                if parts[-1].count("\n") < needle_sep.count("\n"):
                    pos -= len(parts.pop())
                    add(needle_sep)
            elif parts:
                add(needle_sep)
            needle_spans.append((pos, pos + len(inserts[k][1])))
            add(inserts[k][1])
            add(needle_sep)
            k += 1
        if i < len(sents):
            text, sep, _ = sents[i]
            hay_spans.append((pos, pos + len(text)))
            add(text)
            if sep:
                add(sep)
    return "".join(parts).rstrip(), needle_spans, hay_spans


# --- the tasks ----------------------------------------------------------------------------------------------------
def _word(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "word":
        return _word(rng)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(make, n: int, avoid=()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        x = make()
        if x not in out and x not in avoid:
            out.append(x)
    return out


def _niah(task: str, rng: random.Random, goes: random.Random) -> _Task:
    kind = {"niah_single_word": "word", "niah_single_uuid": "uuid"}.get(task, "number")
    n_keys = NEEDLES if task in ("niah_multikey", "niah_multiquery") else 1
    n_values = NEEDLES if task == "niah_multivalue" else 1
    keys = _distinct(lambda: _word(rng), n_keys)
    values = [_distinct(lambda: _value(kind, rng), n_values, avoid=keys) for _ in keys]
    # Values are distinct across keys too (a distractor's value must not be the asked one's).
    flat = [v for vs in values for v in vs]
    while len(set(flat)) < len(flat):
        values = [_distinct(lambda: _value(kind, rng), n_values, avoid=keys) for _ in keys]
        flat = [v for vs in values for v in vs]
    needles = [(k, _NIAH_NEEDLE.format(kind=kind, key=k, value=v)) for k, vs in zip(keys, values) for v in vs]
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
        template = (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("{kind}s", "{kind}"))
        prefix = prefix.replace("are", "is").replace("{kind}s", "{kind}")
    return _Task(template.format(kind=kind, query=query, context="{context}"), prefix.format(kind=kind, query=query),
                 answers, ordered, others, [goes.random() for _ in ordered[1:]], "\n")


def _variable_tracking(rng: random.Random, goes: random.Random) -> _Task:
    names = _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), HOPS + 1, avoid=("VAR",))
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(HOPS)]
    return _Task(_VT_TEMPLATE.format(query=value, context="{context}"), _VT_PREFIX.format(n=HOPS + 1, query=value),
                 tuple(names), chain, "after", [goes.random() for _ in chain[1:]], "\n")


def _qa(seed: int, haystack: str) -> _Task:
    q = qa.question_for(seed)
    k = qa.fact_paragraph(q)
    return _Task(_QA_TEMPLATE.format(query=q.question, context="{context}"), _QA_PREFIX, q.answers,
                 [qa.paragraphs()[k]], "after", [], "\n\n", k if haystack == "document" else None)


# --- checks -------------------------------------------------------------------------------------------------------
def _check(task, tokenizer, context, depth, seed, haystack, chat) -> None:
    if task not in TASKS:
        raise SampleError(f"task: {task!r} is not allowed; allowed: {', '.join(TASKS)}")
    if haystack not in HAYSTACKS:
        raise SampleError(f"haystack: {haystack!r} is not allowed; allowed: {', '.join(HAYSTACKS)}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise SampleError(f"context: {context!r} is not allowed; allowed: a whole number of tokens, at least "
                          f"{MIN_CONTEXT}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, (int, float))
                              or not math.isfinite(depth) or not 0 <= depth <= 100):
        raise SampleError(f"depth: {depth!r} is not allowed; allowed: 0..100 (percent of the haystack before the "
                          "needle) or None (drawn from the seed)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SampleError(f"seed: {seed!r} is not allowed; allowed: a whole number")
    if not isinstance(chat, bool):
        raise SampleError(f"chat: {chat!r} is not allowed; allowed: True, False")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise SampleError("chat: this tokenizer has no chat template; allowed: chat=False")


# --- the sample ---------------------------------------------------------------------------------------------------
def sample(task: str, tokenizer, context: int, depth: float | None, seed: int, haystack: str = "noise",
           chat: bool = True) -> Sample:
    """One prompt of at most `context` tokens (and within a few of it) with its needle(s) at `depth`; see the
    module's docstring.  Bad settings raise SampleError (a ValueError) with one line."""
    _check(task, tokenizer, context, depth, seed, haystack, chat)
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
    weigh = _Weights(tokenizer)

    tail = t.template.partition("{context}")[2]

    def build(words: int):
        sents, inserts = _layout(t, haystack, words, d, weigh)
        text, needle_spans, hay_spans = _render(sents, inserts, t.needle_sep)
        user = t.template.format(context=text)
        return user, len(_ids(tokenizer, user, tail, prefix, chat)), (text, inserts, needle_spans, hay_spans)

    user, text, inserts, needle_spans, hay_spans = _fit(build, context, task)
    primary = [x for _, x in inserts].index(t.needles[0])
    measured = _needle_depth(tokenizer, user, text, needle_spans, hay_spans, primary, chat)
    return Sample(task, context, None if depth is None else float(depth), seed, haystack, user, tail, prefix,
                  t.answers, measured, MAX_NEW_TOKENS[task], chat)


def _needle_depth(tokenizer, user, text, needle_spans, hay_spans, primary, chat) -> float | None:
    """Percent of the haystack's tokens (needles not counted) before the needle, on the prompt as tokenized: a
    token counts where its last character is."""
    if not hay_spans:
        return 0.0
    head = _render_chat(tokenizer, user) if chat else user
    spans = None
    if user in head:
        offset = head.index(user) + user.index(text)
        try:
            spans = tokenizer(head, add_special_tokens=not chat, return_offsets_mapping=True)["offset_mapping"]
        except (NotImplementedError, TypeError, ValueError, KeyError):  # a tokenizer without offsets
            pass
    start = needle_spans[primary][0]
    if spans is None:  # count the haystack's pieces on their own
        before = sum(len(_encode(tokenizer, text[a:b], False)) for a, b in hay_spans if a < start)
        total = sum(len(_encode(tokenizer, text[a:b], False)) for a, b in hay_spans)
    else:
        starts = [a for a, _ in hay_spans]
        before = total = 0
        for s, e in spans:  # a token counts where it ends (" The" starts on the space before its sentence)
            last = e - offset - 1
            k = bisect.bisect_right(starts, last) - 1
            if e > s and k >= 0 and last < hay_spans[k][1]:
                total += 1
                before += last < start
    return round(100.0 * before / total, 2) if total else 0.0


def _match(task: str, answers: tuple[str, ...], reply: str) -> float:
    if task == "qa":
        return 1.0 if qa.contains(reply, answers) else 0.0
    low = reply.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def score(sample: Sample, reply: str) -> float:
    """RULER's string_match_all (niah, variable tracking): the share of the references the reply contains,
    case-insensitive.  QA: 1.0 when the reply contains any accepted form of the answer (as a whole word), else 0."""
    return _match(sample.task, sample.answers, reply)


# --- conversations: one context in turn 1, a question about another part of it in every turn ----------------------
MULTITURN_TASKS = ("niah_single_number", "niah_single_word", "niah_single_uuid", "qa")
MAX_TURNS = 20

_MT_TEMPLATE = ("Some special magic {kind}s are hidden within the following text. Make sure to memorize it. I will "
                "quiz you about the {kind}s afterwards.\n{context}\n{question}")
_MT_QUESTION = "What is the special magic {kind} for {key} mentioned in the provided text?"
_MT_PREFIX = "The special magic {kind} for {key} mentioned in the provided text is"
_QA_LATER = ("Answer the question based on the given documents. Only give me the answer and do not output any "
             "other words.\n\nQuestion: {query}")
# Turn 1 where it asks nothing (`asked` without 1): the instruction and the context alone.
_MT_LATER = "Remember the special magic {kind}s: I will ask you about them later."
_QA_QUIET = ("Read the following documents: I will ask you questions about them later.\n\nThe following are given "
             "documents.\n\n{context}")


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
    """Turn 1's (context ids, question ids), as `prompt_parts`; later turns go through the engine's
    `Prompter.next` with their answer prefix."""
    first = conv.turns[0]
    return _parts(tokenizer, first.user, first.tail, first.answer_prefix, conv.chat)


def conversation_ids(conv: Conversation, tokenizer) -> list[int]:
    """Turn 1's token ids: `conversation_parts` one after the other."""
    return sum(conversation_parts(conv, tokenizer), [])


def question_ids(conv: Conversation, tokenizer, n: int) -> list[int]:
    """What follows turn 1's context when turn `n` (0-based) asks its question right after it, every earlier
    question and answer cut (kvpress's multi-question mode; `bench tasks --multiturn --history drop`): the question
    ids turn 1 would have had, asking it."""
    first, turn = conv.turns[0], conv.turns[n]
    context = first.user[:len(first.user) - len(first.tail)]
    return _parts(tokenizer, context + turn.tail, turn.tail, turn.answer_prefix, conv.chat)[1]


def score_turns(conv: Conversation, replies: list[str]) -> list[float]:
    """Each turn's reply scored against that turn's references (`score`'s rules); None for a turn that asks about no
    needle (`asked`)."""
    if len(replies) != len(conv.turns):
        raise ValueError(f"{len(replies)} replies for {len(conv.turns)} turns")
    return [_match(conv.task, t.answers, r) if t.answers else None for t, r in zip(conv.turns, replies)]


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
    scored = [score_from_context(conv.task, t.answers, r, replies[:n]) if t.answers else (None, False)
              for n, (t, r) in enumerate(zip(conv.turns, replies))]
    return [s for s, _ in scored], [c for _, c in scored]


def _report_stream(words: int) -> tuple[tuple[str, str], ...]:
    """The report from its start, then RULER's noise: long enough for `words` words (no fact is stated twice)."""
    doc = _stream("document")
    noise = _stream("noise")
    return doc + noise * (words // 20 + 2)


def conversation(task: str, tokenizer, context: int, turns: int, seed: int, haystack: str = "noise",
                 chat: bool = True, asked: tuple[int, ...] | None = None) -> Conversation:
    """A conversation after SCBench's multi-turn mode (Li et al., ICLR 2025: a shared context, then a query per
    turn) on RULER's needles: turn 1 carries a context of at most `context` tokens holding one needle per turn and
    asks about one of them; each later turn asks about another, answerable from turn 1 alone.

    niah_single_*: `turns` keys, each with its own value; the needles sit at evenly spread depths (the first at the
    haystack's start, the last at its end), asked in an order drawn from the seed.  qa with the noise haystack:
    `turns` questions about different paragraphs of the report, the paragraphs placed as niah's needles; qa with the
    document haystack: the report itself from its start (then RULER's noise if the context is longer), and
    `turns` questions whose paragraphs the context holds whole, drawn from the seed.  Everything comes from
    generators seeded with the settings, as `sample`'s.

    `asked` (turn numbers, 1-based): only these turns ask, one needle each (turn 1 then holds that many); the others
    are the twenty-turn scenario's chat, in order, scored by nothing (the papers' setting: questions about turn 1
    at turns 5, 10 and 20 of a conversation)."""
    _check(task, tokenizer, context, 0, seed, haystack, chat)
    if task not in MULTITURN_TASKS:
        raise SampleError(f"task: {task!r} has no multi-turn form; allowed: {', '.join(MULTITURN_TASKS)}")
    if isinstance(turns, bool) or not isinstance(turns, int) or not 2 <= turns <= MAX_TURNS:
        raise SampleError(f"turns: {turns!r} is not allowed; allowed: whole numbers 2..{MAX_TURNS}")
    if asked is not None and (not asked or any(isinstance(t, bool) or not isinstance(t, int) for t in asked)
                              or list(asked) != sorted(set(asked)) or not 1 <= asked[0] <= asked[-1] <= turns):
        raise SampleError(f"asked: {asked!r} is not allowed; allowed: turn numbers 1..{turns}, increasing, at least one")
    asking = list(asked) if asked else list(range(1, turns + 1))
    n_asked = len(asking)
    says = random.Random(f"{task}|{seed}|{turns}|conversation" if asked is None else
                         f"{task}|{seed}|{turns}|{tuple(asked)}|conversation")
    gap = "" if chat else " "  # as `sample`: in plain text the answer prefix follows the question after a space
    order = says.sample(range(n_asked), n_asked)  # asked turn n asks about needle order[n] (needle i at place i)
    if task == "qa":
        if haystack == "document":
            conv = _report_conversation(tokenizer, context, n_asked, seed, chat, says, 1 in asking)
            return _between(conv, turns, asking) if asked else conv
        picked = _distinct_paragraphs(says, n_asked, range(len(qa.QUESTIONS)))
        if len(picked) < n_asked:
            raise SampleError(f"turns: {n_asked} asking turns are not allowed for qa; allowed: up to {len(picked)} "
                              "(the report's questions are about that many different paragraphs)")
        needles = [qa.paragraphs()[qa.fact_paragraph(q)] for q in picked]
        asks = [(_QA_LATER.format(query=q.question), _QA_PREFIX, q.answers, q.question) for q in picked]
        tails = [_qa_tail(q.question) for q in picked]
        template = _QA_TEMPLATE.replace("{query}", picked[order[0]].question) if 1 in asking else _QA_QUIET
        sep = "\n\n"
    else:
        kind = {"niah_single_word": "word", "niah_single_uuid": "uuid"}.get(task, "number")
        keys = _distinct(lambda: _word(says), n_asked)
        values = _distinct(lambda: _value(kind, says), n_asked, avoid=keys)
        needles = [_NIAH_NEEDLE.format(kind=kind, key=k, value=v) for k, v in zip(keys, values)]
        asks = [(_MT_QUESTION.format(kind=kind, key=k), _MT_PREFIX.format(kind=kind, key=k), (v,),
                 _MT_QUESTION.format(kind=kind, key=k)) for k, v in zip(keys, values)]
        question = asks[order[0]][0] if 1 in asking else _MT_LATER.format(kind=kind)
        template, sep = _MT_TEMPLATE.format(kind=kind, context="{context}", question=question), "\n"
        tails = [_MT_TEMPLATE.format(kind=kind, context="{context}", question=a[0]).partition("{context}")[2]
                 for a in asks]
    # The first needle at the haystack's start (depth 0), the others at evenly spread shares of its boundaries (one
    # needle alone: in the middle).
    first_prefix = asks[order[0]][1] if 1 in asking else ""
    t = _Task(template, first_prefix, (), needles, "anywhere", [i / (n_asked - 1) for i in range(1, n_asked)], sep)
    weigh = _Weights(tokenizer)

    tail = template.partition("{context}")[2]

    def build(words: int):
        sents, inserts = _layout(t, haystack, words, 0.0 if n_asked > 1 else 50.0, weigh)
        text, needle_spans, hay_spans = _render(sents, inserts, sep)
        user = template.format(context=text)
        prefix = gap + t.answer_prefix if t.answer_prefix else ""
        return user, len(_ids(tokenizer, user, tail, prefix, chat)), (text, inserts, needle_spans, hay_spans)

    user, text, inserts, needle_spans, hay_spans = _fit(build, context, task)
    placed = [x for _, x in inserts]
    depth = [_needle_depth(tokenizer, user, text, needle_spans, hay_spans, placed.index(x), chat) for x in needles]
    out = [Turn(asks[i][0], asks[i][3], gap + asks[i][1], asks[i][2], depth[i], tails[i]) for i in order]
    if 1 in asking:
        out[0] = replace(out[0], user=user)
    else:
        out.insert(0, Turn(user, "", "", (), None, tail))
    conv = Conversation(task, context, seed, haystack, tuple(out), MAX_NEW_TOKENS[task], chat)
    return _between(conv, turns, asking) if asked else conv


def _between(conv: Conversation, turns: int, asking: list[int]) -> Conversation:
    """The asking turns at their numbers, the twenty-turn scenario's chat (its turns in order) in the others."""
    from ...plain.scenarios import scenarios

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


def _report_conversation(tokenizer, context: int, n: int, seed: int, chat: bool, says: random.Random,
                         first_asks: bool = True) -> Conversation:
    """qa on the document: the report from its start, and `n` questions about paragraphs it holds whole (the first
    in turn 1, or with `first_asks` False all after a turn 1 that asks nothing)."""
    gap = "" if chat else " "
    shuffled = list(range(len(qa.QUESTIONS)))
    says.shuffle(shuffled)

    def window(question: str | None):
        template = _QA_TEMPLATE.replace("{query}", question) if question is not None else _QA_QUIET
        prefix = gap + _QA_PREFIX if question is not None else ""
        tail = template.partition("{context}")[2]

        def build(words: int):
            sents = _forward(_report_stream(words), words)
            text, _, hay_spans = _render(sents, [], "\n\n")
            user = template.format(context=text)
            return user, len(_ids(tokenizer, user, tail, prefix, chat)), (text, [], [], hay_spans)

        return _fit(build, context, "qa")

    # The window with the longest question asked first holds at most the paragraphs of any other first question's.
    longest = max(qa.QUESTIONS, key=lambda q: len(_encode(tokenizer, q.question, False))).question
    text = window(longest if first_asks else None)[1]
    held = [i for i in shuffled if qa.paragraphs()[qa.fact_paragraph(qa.QUESTIONS[i])] in text]
    picked = _distinct_paragraphs(says, n, held)
    if len(picked) < n:
        raise SampleError(f"context: {context} tokens of the report hold whole paragraphs for {len(picked)} "
                          f"different questions; allowed: turns up to {len(picked)} at this context, or a longer "
                          "context")
    user, text, _, _, hay_spans = window(picked[0].question if first_asks else None)
    out = [] if first_asks else [Turn(user, "", "", (), None, _QA_QUIET.partition("{context}")[2])]
    for q in picked:
        para = text.index(qa.paragraphs()[qa.fact_paragraph(q)])
        depth = _needle_depth(tokenizer, user, text, [(para, para)], hay_spans, 0, chat)
        out.append(Turn(_QA_LATER.format(query=q.question) if out else user, q.question, gap + _QA_PREFIX, q.answers,
                        depth, _qa_tail(q.question)))
    return Conversation("qa", context, seed, "document", tuple(out), MAX_NEW_TOKENS["qa"], chat)


def _qa_tail(question: str) -> str:
    """The end of the QA template after the documents, asking `question`."""
    return _QA_TEMPLATE.replace("{query}", question).partition("{context}")[2]


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


def _fit(build, context: int, task: str):
    """The most words of haystack whose prompt is at most `context` tokens (as `sample` searches)."""
    smallest = build(0)[1]
    if smallest > context:
        raise SampleError(f"context: {context} tokens is too small for {task} (its instruction, needle(s) and "
                          f"question take {smallest} tokens with this tokenizer and seed); "
                          f"allowed: at least {smallest}")
    lo, hi = 0, 64
    while build(hi)[1] <= context:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if build(mid)[1] <= context:
            lo = mid
        else:
            hi = mid
    for more in range(lo + 1, lo + 5):
        if build(more)[1] <= context:
            lo = more
    user, _, rest = build(lo)
    return (user, *rest)

