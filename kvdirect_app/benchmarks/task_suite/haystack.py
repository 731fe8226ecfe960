"""The haystack, the needles placed in it and the prompt fitted to a context length: what a single-turn sample
(`single_turn`) and a conversation (`multi_turn`) are both built from.

The tasks' names and settings, the needles' shared templates and words, the haystacks, where needles go in them
(the layout), the longest prompt that fits a context length in tokens of the model's own tokenizer (`fit`), the
needle's depth measured on the finished prompt, the prompt's token ids, the settings' checks and the score rule.

The haystacks: ``noise`` is RULER's noise ("The grass is green. The sky is blue. The sun is yellow. Here we go.
There and back again.", one such line after another); ``document`` is the report in presets/long_document.md (its
opening instruction line left out), repeated as needed.  Either is cut after a whole number of words so that the
prompt is as long as asked: ``context`` counts every token the model is fed before it answers (the chat template,
the user message, the answer prefix; `single_turn.prompt_ids`), and the prompt is the longest that does not pass it
(a few tokens short at most: a word is a token or two).

Depth: needles go in at sentence boundaries, each on a line of its own (RULER inserts needles between the haystack's
sentences).  ``depth`` d (0..100) puts the needle at the boundary nearest d percent of the haystack's tokens; the
haystack is the same at every depth (give or take its last word), only the needle moves.  With several needles, the
needle that d places is the asked one (multi-key; the three distractors go to boundaries drawn at random) or the
first one (multi-value, multi-query, the variable chain: the others go to random boundaries after it, in order).
``depth=None`` draws d from the seed, as RULER draws its depths.  ``Sample.needle_depth`` is measured on the
finished prompt: the percent of the haystack's tokens (the needles' own tokens not counted, so that 0 and 100 can be
reached with several needles) that come before that needle.  In a chat the answer prefix opens the assistant's turn;
with ``chat=False`` it follows the question after a space (RULER's base template).

Generation lengths (``Sample.max_new_tokens``): RULER generates 128 tokens for niah, 30 for variable tracking, 32
for qa, for long answers of big models.  Ours are bounds for exact short answers of small models: a 7-digit number
or a word is under 10 tokens with SmolLM2's tokenizer (digits are single tokens), so 16; a UUID ~37, so 48; four
numbers with separators ~40, so 48; five variable names ~20, so 32; a QA answer, 32 (RULER's).  The tests check
that the references fit.
"""

from __future__ import annotations

import bisect
import math
import random
import uuid
from dataclasses import dataclass
from functools import lru_cache

from ...plain.errors import UserError
from . import qa

TASKS = (
    "niah_single_number",
    "niah_single_word",
    "niah_single_uuid",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "qa",
)
HAYSTACKS = ("noise", "document")
DEPTHLESS: tuple[str, ...] = ()  # tasks that take no depth: none, every task places its (first) needle at one
# A floor for settings checks: no task fits in fewer tokens (`single_turn.sample` names each task's own minimum:
# with SmolLM2's tokenizer from 79 tokens, niah_single_word as plain text, to 237, qa through the chat template).
MIN_CONTEXT = 64

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
MAX_NEW_TOKENS = {
    "niah_single_number": 16,
    "niah_single_word": 16,
    "niah_single_uuid": 48,
    "niah_multikey": 16,
    "niah_multivalue": 48,
    "niah_multiquery": 48,
    "variable_tracking": 32,
    "qa": 32,
}

ADJECTIVES = (
    "amber",
    "brave",
    "calm",
    "clever",
    "crimson",
    "curly",
    "dusty",
    "eager",
    "early",
    "fancy",
    "fluffy",
    "gentle",
    "giant",
    "glossy",
    "golden",
    "grumpy",
    "happy",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "lively",
    "lucky",
    "mellow",
    "misty",
    "noble",
    "odd",
    "olive",
    "plucky",
    "polite",
    "proud",
    "quick",
    "quiet",
    "rapid",
    "rusty",
    "sandy",
    "shiny",
    "silent",
    "silky",
    "sleepy",
    "smoky",
    "sunny",
    "swift",
    "tidy",
    "velvet",
    "wild",
    "windy",
    "witty",
)
NOUNS = (
    "acorn",
    "anchor",
    "apple",
    "badger",
    "basket",
    "beetle",
    "blanket",
    "bucket",
    "button",
    "candle",
    "carrot",
    "castle",
    "cobbler",
    "comet",
    "cricket",
    "dolphin",
    "falcon",
    "feather",
    "fiddle",
    "garden",
    "glacier",
    "hammer",
    "harbor",
    "helmet",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "lantern",
    "lemon",
    "meadow",
    "mitten",
    "needle",
    "orchard",
    "otter",
    "parrot",
    "pebble",
    "pepper",
    "pillow",
    "pocket",
    "rabbit",
    "saddle",
    "spider",
    "teapot",
    "thimble",
    "tulip",
    "walnut",
    "whistle",
)

# The needles' and the QA set's templates, RULER's; each kind's question and answer prefix are its own module's.
NIAH_NEEDLE = "One of the special magic {kind}s for {key} is: {value}."
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
    "the given documents. Only give me the answer and do not output any other words.\n\n"
    "Question: {query}"
)
QA_PREFIX = "Answer:"


class SampleError(UserError):
    """A bad task setting; the one-line message names the setting and its allowed values."""


# --- prompts ------------------------------------------------------------------------------------------------------
def render_chat(tokenizer, user: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )


def encode(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def split_ids(tokenizer, user: str, tail: str, answer_prefix: str, chat: bool) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the prompt as the Studio feeds it (the user turn through the chat template, or
    plain text with the tokenizer's special tokens; then the answer prefix), cut where the context ends and `tail`,
    the rest of the user message, begins.  Each part is encoded on its own, as kvpress's pipeline encodes the
    context and the question, so the two settings of `bench tasks --question` feed the same ids."""
    head = render_chat(tokenizer, user) if chat else user
    at = head.rfind(user)
    if at < 0 or not user.endswith(tail):
        raise SampleError(
            "chat: this tokenizer's chat template changes the user message, so the context cannot be "
            "cut from the question; allowed: chat=False"
        )
    at += len(user) - len(tail)
    return (
        encode(tokenizer, head[:at], not chat),
        encode(tokenizer, head[at:], False) + encode(tokenizer, answer_prefix, False),
    )


def joined_ids(tokenizer, user: str, tail: str, answer_prefix: str, chat: bool) -> list[int]:
    context, question = split_ids(tokenizer, user, tail, answer_prefix, chat)
    return context + question


# --- haystacks ----------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def stream(name: str, skip: int | None = None) -> tuple[tuple[str, str], ...]:
    """One cycle of a haystack's sentences, each with the separator that follows it.  `skip`: the document
    without that paragraph, starting with the paragraph after it (the QA window's stream)."""
    if name == "noise":
        sents = qa.sentences(NOISE)
        return tuple((s, "\n" if i == len(sents) - 1 else " ") for i, s in enumerate(sents))
    paras = list(qa.paragraphs())
    if skip is not None:
        paras = paras[skip + 1 :] + paras[:skip]
    out = []
    for p in paras:
        sents = qa.sentences(p)
        out += [(s, "\n\n" if i == len(sents) - 1 else " ") for i, s in enumerate(sents)]
    return tuple(out)


class Weights:
    """Tokens per sentence (with its leading space), measured once per sentence: the haystack's token positions."""

    def __init__(self, tokenizer):
        self.tok, self.seen = tokenizer, {}

    def __call__(self, text: str) -> int:
        if text not in self.seen:
            self.seen[text] = len(encode(self.tok, " " + text, False))
        return self.seen[text]


def first_words(cycle, words: int) -> list[tuple[str, str, float]]:
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
class Task:
    """What one sample puts in the haystack and around it: its template, answer prefix and references, and its
    needles with where they go."""

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


def layout(t: Task, haystack: str, words: int, d: float, weigh: Weights):
    """(sentences, inserts): the haystack's sentences and (boundary, needle) pairs, boundary j = after j
    sentences."""
    if t.window is None:  # the haystack from its start; the needle moves within it
        sents = first_words(stream(haystack), words)
        cum = [0.0]
        for text, _, _ in sents:
            cum.append(cum[-1] + weigh(text))
        b = _nearest(cum, d / 100.0 * cum[-1])
    else:  # a window of the report around the fact's paragraph
        cycle = stream("document", t.window)
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
        ahead = first_words(cycle, words)
        whole_words, whole_weight = [0], [0.0]
        for text, _, share in ahead:
            if share == 1.0:
                whole_words.append(whole_words[-1] + len(text.split(" ")))
                whole_weight.append(whole_weight[-1] + weigh(text))

        def after_weight(r: int) -> float:  # the tokens of the first r words after the fact (`first_words`'s cut)
            k = bisect.bisect_right(whole_words, r) - 1
            rest = r - whole_words[k]
            return whole_weight[k] + (weigh(" ".join(ahead[k][0].split(" ")[:rest])) if rest else 0.0)

        after = [after_weight(words - u) for u in used]
        nb = min(range(len(cum)), key=lambda j: (abs(cum[j] - d / 100.0 * (cum[j] + after[j])), j))
        sents = back[:nb][::-1] + first_words(cycle, words - used[nb])
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


def render_context(sents, inserts, needle_sep: str) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
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


# --- the needles' keys and values ---------------------------------------------------------------------------------
def adjective_noun(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def needle_value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "word":
        return adjective_noun(rng)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def distinct(make, n: int, avoid=()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        x = make()
        if x not in out and x not in avoid:
            out.append(x)
    return out


# --- checks -------------------------------------------------------------------------------------------------------
def check_settings(task, tokenizer, context, depth, seed, haystack, chat) -> None:
    if task not in TASKS:
        raise SampleError(f"task: {task!r} is not allowed; allowed: {', '.join(TASKS)}")
    if haystack not in HAYSTACKS:
        raise SampleError(f"haystack: {haystack!r} is not allowed; allowed: {', '.join(HAYSTACKS)}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise SampleError(
            f"context: {context!r} is not allowed; allowed: a whole number of tokens, at least {MIN_CONTEXT}"
        )
    if depth is not None and (
        isinstance(depth, bool)
        or not isinstance(depth, (int, float))
        or not math.isfinite(depth)
        or not 0 <= depth <= 100
    ):
        raise SampleError(
            f"depth: {depth!r} is not allowed; allowed: 0..100 (percent of the haystack before the "
            "needle) or None (drawn from the seed)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SampleError(f"seed: {seed!r} is not allowed; allowed: a whole number")
    if not isinstance(chat, bool):
        raise SampleError(f"chat: {chat!r} is not allowed; allowed: True, False")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise SampleError("chat: this tokenizer has no chat template; allowed: chat=False")


# --- the finished prompt: where its needle is, what a reply scores ----------------------------------------------
def measure_depth(tokenizer, user, text, needle_spans, hay_spans, primary, chat) -> float | None:
    """Percent of the haystack's tokens (needles not counted) before the needle, on the prompt as tokenized: a
    token counts where its last character is."""
    if not hay_spans:
        return 0.0
    head = render_chat(tokenizer, user) if chat else user
    spans = None
    if user in head:
        offset = head.index(user) + user.index(text)
        try:
            spans = tokenizer(head, add_special_tokens=not chat, return_offsets_mapping=True)["offset_mapping"]
        except (NotImplementedError, TypeError, ValueError, KeyError):  # a tokenizer without offsets
            pass
    start = needle_spans[primary][0]
    if spans is None:  # count the haystack's pieces on their own
        before = sum(len(encode(tokenizer, text[a:b], False)) for a, b in hay_spans if a < start)
        total = sum(len(encode(tokenizer, text[a:b], False)) for a, b in hay_spans)
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


def match_score(task: str, answers: tuple[str, ...], reply: str) -> float:
    """A reply against its references (`single_turn.score`'s rule): the share of them it holds, or for qa 1.0 when
    it holds an accepted form of the answer."""
    if task == "qa":
        return 1.0 if qa.contains(reply, answers) else 0.0
    low = reply.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


# --- fitting the prompt to the context ----------------------------------------------------------------------------
def fit(build, context: int, task: str):
    """The most words of haystack whose prompt is at most `context` tokens, found by the `build(words)` a sample
    or a conversation hands in."""
    smallest = build(0)[1]
    if smallest > context:
        raise SampleError(
            f"context: {context} tokens is too small for {task} (its instruction, needle(s) and "
            f"question take {smallest} tokens with this tokenizer and seed); "
            f"allowed: at least {smallest}"
        )
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
