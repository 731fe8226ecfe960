"""The RULER-style task generators (kvdirect_app/benchmarks/task_suite: single_turn.py, multi_turn.py,
haystack.py) and the long document's QA set (tasks/qa.py),
on SmolLM2's tokenizer alone (no model): determinism, needle depth, prompt length, the QA set against the file,
the scores, the one-line errors."""

import random
import re

import pytest

from kvdirect_app.benchmarks import task_suite as g
from kvdirect_app.benchmarks.task_suite import qa
from kvdirect_app.benchmarks.task_suite.tokenizer import tokenizer_for

pytestmark = pytest.mark.check  # the inner loop (`make check`)

NIAH = [t for t in g.TASKS if t != "qa"]


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for("smollm2-135m")


def _context(s: g.Sample) -> str:
    """The haystack with its needles: the user message without the instruction and the question."""
    if s.task == "variable_tracking":
        return s.user.split("\n\n", 1)[1].rsplit("\nQuestion:", 1)[0]
    if s.task == "qa":
        return s.user.split("The following are given documents.\n\n", 1)[1].split("\n\nAnswer the question", 1)[0]
    return s.user.split("\n", 1)[1].rsplit("\n", 1)[0]


def _needles(s: g.Sample) -> list[str]:
    if s.task == "qa":
        return [qa.paragraphs()[qa.fact_paragraph(qa.question_for(s.seed))]]
    marker = "VAR " if s.task == "variable_tracking" else "One of the special magic"
    return [line for line in _context(s).split("\n") if line.startswith(marker)]


def _placed(s: g.Sample) -> str:
    """The needle that `depth` places: the asked one (single, multi-key), else the first in the text."""
    needles = _needles(s)
    if s.task in ("qa", "niah_multivalue", "niah_multiquery", "variable_tracking"):
        return needles[0]
    return next(n for n in needles if s.answers[0] in n)


def _depth_by_text(s: g.Sample, tok) -> float:
    """An independent measure: tokens of the haystack (needle lines removed) before the needle, in percent."""
    ctx = _context(s)
    at = ctx.index(_placed(s))
    strip = lambda text: re.sub(r"\n+", "\n", "\n".join(x for x in text.split("\n") if x not in _needles(s)))
    count = lambda text: len(tok(strip(text), add_special_tokens=False)["input_ids"]) if text.strip() else 0
    return 100.0 * count(ctx[:at]) / count(ctx)


def test_same_settings_give_the_same_sample_whatever_ran_before(tok):
    for task in g.TASKS:
        for haystack in g.HAYSTACKS:
            random.seed(1)
            a = g.sample(task, tok, 512, 50, 7, haystack)
            random.seed(2)  # the global generator is not used
            random.random()
            b = g.sample(task, tok, 512, 50.0, 7, haystack)
            assert a == b, (task, haystack)
    assert g.sample("niah_single_number", tok, 512, None, 3) == g.sample("niah_single_number", tok, 512, None, 3)


def test_another_seed_gives_other_needles(tok):
    for task in NIAH:
        a, b = (g.sample(task, tok, 512, 50, seed) for seed in (0, 1))
        assert set(a.answers).isdisjoint(b.answers), task
        assert a.user != b.user
    # QA: the seed walks the question set
    questions = {
        g.sample("qa", tok, 512, 50, seed, "document").user.rsplit("Question: ", 1)[1]
        for seed in range(len(qa.QUESTIONS))
    }
    assert len(questions) == len(qa.QUESTIONS)


@pytest.mark.parametrize("context", [512, 2048])
@pytest.mark.parametrize("haystack", g.HAYSTACKS)
def test_needle_at_the_asked_depth(tok, context, haystack):
    # Noise: a boundary every few tokens.  The report: the needle goes between sentences of ~20-40 tokens, so at
    # 512 tokens (~350 of haystack) the nearest boundary can be ~6 points away.
    tol = 2.0 if haystack == "noise" else {512: 6.0, 2048: 2.0}[context]
    for task in NIAH:
        for depth in (0, 50, 100):
            for seed in (0, 1):
                s = g.sample(task, tok, context, depth, seed, haystack)
                assert abs(s.needle_depth - depth) <= tol, (task, depth, seed, s.needle_depth)
                assert abs(_depth_by_text(s, tok) - s.needle_depth) <= 1.5, (task, depth, seed)
                lines = _context(s).split("\n")
                if depth == 0:
                    assert lines[0] == _placed(s)
                if depth == 100 and task not in ("niah_multikey",):  # all needles at the end
                    assert lines[-len(_needles(s)) :] == _needles(s)
                if task == "variable_tracking":  # each name in its chain lines only
                    assert [_context(s).count(n) for n in s.answers] == [2, 2, 2, 2, 1]
                else:
                    assert all(s.user.count(a) == 1 for a in s.answers), task  # a value is in its needle only


@pytest.mark.parametrize("context", [512, 2048])
def test_qa_fact_at_the_asked_depth(tok, context):
    # The report's window starts at a sentence: the fact's paragraph is as near the depth as a sentence allows.
    tol = {512: 15.0, 2048: 4.0}[context]
    for seed in range(0, len(qa.QUESTIONS), 6):
        for depth in (0, 50, 100):
            for haystack in g.HAYSTACKS:
                s = g.sample("qa", tok, context, depth, seed, haystack)
                assert abs(s.needle_depth - depth) <= (tol if haystack == "document" else 2.0), (seed, depth)
                assert abs(_depth_by_text(s, tok) - s.needle_depth) <= 1.5


def test_prompt_is_as_long_as_asked_never_longer(tok):
    for task in g.TASKS:
        for haystack in g.HAYSTACKS:
            for context, chat in ((512, True), (777, False), (2048, True)):
                s = g.sample(task, tok, context, 30, 5, haystack, chat=chat)
                n = len(g.prompt_ids(s, tok))
                assert context - 6 <= n <= context, (task, haystack, context, n)
    s = g.sample("niah_single_number", tok, 600, 50, 0)
    chat = tok.apply_chat_template([{"role": "user", "content": s.user}], tokenize=False, add_generation_prompt=True)
    assert g.prompt_ids(s, tok) == (
        tok(chat, add_special_tokens=False)["input_ids"] + tok(s.answer_prefix, add_special_tokens=False)["input_ids"]
    )
    assert g.prompt_text(s, tok) == chat + s.answer_prefix


def test_a_byte_level_tokenizer_too():
    byte = tokenizer_for("tiny-llama")
    for haystack, tol in (("noise", 3.0), ("document", 10.0)):  # a sentence of the report is ~200 bytes
        s = g.sample("niah_multikey", byte, 2048, 50, 0, haystack)
        assert 2044 <= len(g.prompt_ids(s, byte)) <= 2048 and abs(s.needle_depth - 50) <= tol, haystack


def test_every_task_fits_above_min_context(tok):
    for task in g.TASKS:
        for chat in (True, False):
            with pytest.raises(g.SampleError, match=r"allowed: at least (\d+)") as info:
                g.sample(task, tok, g.MIN_CONTEXT, 50, 0, chat=chat)
            least = int(re.search(r"at least (\d+)", str(info.value)).group(1))
            s = g.sample(task, tok, least, 50, 0, chat=chat)
            assert len(g.prompt_ids(s, tok)) == least
    assert set(g.DEPTHLESS) <= set(g.TASKS)


def test_the_qa_set_against_the_document():
    text = qa.DOCUMENT.read_text(encoding="utf-8")
    assert len(qa.QUESTIONS) >= 20 and len({q.question for q in qa.QUESTIONS}) == len(qa.QUESTIONS)
    for q in qa.QUESTIONS:
        k = qa.fact_paragraph(q)
        paragraph = qa.paragraphs()[k]
        assert qa.occurrences(text, q.answers[0]) == 1, q.answers[0]  # stated once in the file
        assert q.clue in paragraph, q.clue  # the question's key fact is in the same paragraph
        for form in q.answers[1:]:  # an accepted form is in that paragraph or nowhere
            assert qa.occurrences(text, form) == qa.occurrences(paragraph, form) <= 1, form
        others = "\n".join(p for i, p in enumerate(qa.paragraphs()) if i != k)
        assert not qa.contains(others, q.answers), q.question


def test_each_qa_answer_is_in_its_context_once(tok):
    for seed, q in enumerate(qa.QUESTIONS):
        for context, depth, haystack in (
            (512, 0, "document"),
            (512, 50, "document"),
            (512, 100, "document"),
            (512, 50, "noise"),
        ) + (((2048, 50, "document"),) if seed % 3 == 0 else ()):
            s = g.sample("qa", tok, context, depth, seed, haystack)
            assert s.answers == q.answers
            assert qa.occurrences(_context(s), q.answers[0]) == 1, (seed, context, depth, haystack)
            assert q.clue in _context(s) and q.question in s.user


def test_answers_fit_the_generation_length(tok):
    for task in g.TASKS:
        s = g.sample(task, tok, 512, 50, 0)
        longest = ", ".join(s.answers) if task != "qa" else max(s.answers, key=len)
        assert len(tok(" " + longest + ".", add_special_tokens=False)["input_ids"]) <= s.max_new_tokens - 2, task
    assert max(g.MAX_NEW_TOKENS.values()) <= 64


def test_scores(tok):
    one = g.sample("niah_single_uuid", tok, 512, 50, 0)
    assert g.score(one, f" {one.answers[0].upper()}.") == 1.0
    assert g.score(one, " 123e4567-e89b-12d3-a456-426614174000") == 0.0
    many = g.sample("niah_multivalue", tok, 512, 50, 0)
    assert g.score(many, " " + ", ".join(many.answers)) == 1.0
    assert g.score(many, f" {many.answers[0]} and {many.answers[2]}") == 0.5
    assert g.score(many, " none") == 0.0
    vt = g.sample("variable_tracking", tok, 512, 50, 0)
    assert g.score(vt, " " + " ".join(vt.answers[:3])) == pytest.approx(0.6)
    q = g.sample("qa", tok, 512, 50, 6, "document")  # "How tall was Brenn's tower?"
    assert q.answers[0] == "twenty-two metres"
    assert g.score(q, " It was 22 metres tall.") == 1.0
    assert g.score(q, " Twenty-two metres") == 1.0
    assert g.score(q, " 122 metres") == 0.0 and g.score(q, " fourteen nautical miles") == 0.0


@pytest.mark.parametrize(
    "args,setting",
    [
        (("niah_single_number", 512, -1, 0), "depth"),
        (("niah_single_number", 512, 100.5, 0), "depth"),
        (("niah_single_number", 512, float("nan"), 0), "depth"),
        (("niah_single_number", 512, True, 0), "depth"),
        (("niah", 512, 50, 0), "task"),
        (("niah_single_number", 0, 50, 0), "context"),
        (("niah_single_number", "512", 50, 0), "context"),
        (("qa", 200, 50, 0), "context"),
        (("niah_single_number", 512, 50, 1.5), "seed"),
    ],
)
def test_bad_settings_are_one_line(tok, args, setting):
    task, context, depth, seed = args
    with pytest.raises(ValueError) as info:
        g.sample(task, tok, context, depth, seed)
    message = str(info.value)
    assert isinstance(info.value, g.SampleError) and "\n" not in message
    assert message.startswith(f"{setting}: ") and "allowed: " in message
    for call, name in (
        (lambda: g.sample("qa", tok, 512, 50, 0, haystack="essay"), "haystack"),
        (lambda: g.sample("qa", tok, 512, 50, 0, chat="yes"), "chat"),
        (lambda: tokenizer_for("nope"), "preset"),
    ):
        with pytest.raises(g.SampleError, match=f"^{name}: .*allowed: "):
            call()


def test_too_small_names_the_minimum(tok):
    with pytest.raises(g.SampleError) as info:
        g.sample("niah_multiquery", tok, 150, 50, 0)
    least = int(re.search(r"allowed: at least (\d+)$", str(info.value)).group(1))
    assert least > 150
    g.sample("niah_multiquery", tok, least, 50, 0)


# --- conversations (bench tasks --multiturn) -----------------------------------------------------------------------
CONVERSATIONS = [(t, h) for t in g.MULTITURN_TASKS for h in g.HAYSTACKS]


def _turn1_context(c: g.Conversation) -> str:
    user = c.turns[0].user
    if c.task == "qa":
        return user.split("The following are given documents.\n\n", 1)[1].split("\n\nAnswer the question", 1)[0]
    return user.split("\n", 1)[1].rsplit("\n", 1)[0]


def _asked(c: g.Conversation, n: int) -> str:
    """The needle line (niah) or the fact's paragraph (qa) that turn n's references come from, found in the text."""
    ctx = _turn1_context(c)
    if c.task == "qa":
        q = next(q for q in qa.QUESTIONS if q.question == c.turns[n].question)
        return qa.paragraphs()[qa.fact_paragraph(q)]
    key = c.turns[n].question.split(" for ", 1)[1].split(" mentioned")[0]
    return next(line for line in ctx.split("\n") if line.startswith("One of the special magic") and f" {key} " in line)


def _text_depth(c: g.Conversation, n: int, tok) -> float:
    """An independent measure of turn n's needle depth: tokens of the context (needle lines removed, as the
    generator counts its haystack) before that needle, in percent."""
    ctx = _turn1_context(c)
    at = ctx.index(_asked(c, n))
    needles = (
        set()
        if c.haystack == "document" and c.task == "qa"
        else {_asked(c, k) for k in range(len(c.turns)) if c.turns[k].answers}
    )
    strip = lambda text: " ".join(x.strip() for x in text.split("\n") if x.strip() and x not in needles)
    count = lambda text: len(tok(strip(text), add_special_tokens=False)["input_ids"]) if strip(text) else 0
    return 100.0 * count(ctx[:at]) / count(ctx)


@pytest.mark.parametrize("task, haystack", CONVERSATIONS)
def test_a_conversation_is_seeded_and_every_later_question_is_answered_by_turn_one_alone(tok, task, haystack):
    for context, turns in ((1024, 5), (2048, 3)):
        random.seed(5)
        a = g.conversation(task, tok, context, turns, 3, haystack)
        random.seed(6)  # the global generator is not used
        assert g.conversation(task, tok, context, turns, 3, haystack) == a
        assert g.conversation(task, tok, context, turns, 4, haystack).turns[0].user != a.turns[0].user
        ids = g.conversation_ids(a, tok)
        assert context - 20 <= len(ids) <= context, len(ids)
        assert len(a.turns) == turns and len({t.question for t in a.turns}) == turns  # each turn asks another
        first = a.turns[0].user
        for n, t in enumerate(a.turns):
            assert t.question in t.user and t.answer_prefix
            needle = _asked(a, n)
            assert first.count(needle) == 1  # the asked needle (or paragraph) is in turn 1, once
            if task == "qa":
                assert qa.contains(needle, t.answers) and qa.occurrences(first, t.answers[0]) == 1
            else:
                assert first.count(t.answers[0]) == 1 and t.answers[0] in needle
            if n:  # a later turn says nothing of its answer: only turn 1 holds it
                assert not g.score_turns(a, [t.user if k == n else "" for k in range(turns)])[n]


@pytest.mark.parametrize("task, haystack", CONVERSATIONS)
def test_each_turns_needle_is_at_its_measured_depth_and_the_needles_spread_over_the_context(tok, task, haystack):
    c = g.conversation(task, tok, 2048, 5, 1, haystack)
    depths = [t.needle_depth for t in c.turns]
    for n in range(len(c.turns)):
        assert abs(_text_depth(c, n, tok) - depths[n]) <= 1.5, (n, depths)
    if not (task == "qa" and haystack == "document"):  # needles at five evenly spread places, asked in any order
        tol = 2.0 if haystack == "noise" else 4.0
        for got, want in zip(sorted(depths), (0, 25, 50, 75, 100)):
            assert abs(got - want) <= tol, depths
        assert depths != sorted(depths) or g.conversation(task, tok, 2048, 5, 2, haystack).turns != c.turns


def test_a_later_turn_fits_its_bound_in_tokens(tok):
    from kvdirect_app.benchmarks.task_suite.grid import LATER_TOKENS
    from kvdirect_app.models.prompts import Prompter

    class Loaded:
        tokenizer, chat = tok, True

    prompter = Prompter(Loaded())
    for task, haystack in CONVERSATIONS:
        c = g.conversation(task, tok, 2048, 8 if task == "qa" else 20, 0, haystack)
        for t in c.turns[1:]:
            later = prompter.next(t.user, pending=1) + prompter.encode(t.answer_prefix, False)
            assert len(later) <= LATER_TOKENS, (task, len(later))


def test_each_turn_is_scored_against_its_own_references(tok):
    c = g.conversation("niah_single_number", tok, 1024, 3, 0)
    right = [t.answers[0] for t in c.turns]
    assert g.score_turns(c, [f" {right[0]}.", " 1234567.", f"It is {right[2]}"]) == [1.0, 0.0, 1.0]
    assert g.score_turns(c, [right[1], right[2], right[0]]) == [0.0, 0.0, 0.0]  # another turn's answer is wrong
    q = g.conversation("qa", tok, 2048, 3, 0, "document")
    forms = [t.answers[-1] for t in q.turns]  # any accepted form counts, as a whole word
    assert g.score_turns(q, [f"Answer: {forms[0]}", "no idea", forms[2].upper()]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 replies for 3 turns"):
        g.score_turns(c, ["a", "b"])


@pytest.mark.parametrize("task, haystack", CONVERSATIONS)
def test_asked_turns_ask_about_turn_one_and_the_turns_between_chat(tok, task, haystack):
    """The papers' setting: turn 1 holds a needle for each of turns 5, 10 and 20, which ask about them; the other
    turns are the twenty-turn scenario's chat, in order, scored by nothing."""
    from kvdirect_app.plain.scenarios import scenarios

    chat = scenarios()["twenty-turns"]["turns"]
    c = g.conversation(task, tok, 1024, 20, 0, haystack, asked=(5, 10, 20))
    assert len(c.turns) == 20 and 1000 <= len(g.conversation_ids(c, tok)) <= 1024
    asking = [n + 1 for n, t in enumerate(c.turns) if t.answers]
    assert asking == [5, 10, 20] and not c.turns[0].question and not c.turns[0].answer_prefix
    assert [t.user for n, t in enumerate(c.turns[1:], 2) if n not in asking] == chat[:16]
    first = c.turns[0].user
    for n in (4, 9, 19):
        t = c.turns[n]
        assert t.question in t.user and t.answer_prefix and first.count(_asked(c, n)) == 1
        assert abs(_text_depth(c, n, tok) - t.needle_depth) <= 1.5
    if task != "qa":  # three needles: at the start, the middle and the end
        assert sorted(round(c.turns[n].needle_depth, -1) for n in (4, 9, 19)) == [0, 50, 100]
    scores = g.score_turns(c, [t.answers[0] if t.answers else "" for t in c.turns])
    assert [n + 1 for n, x in enumerate(scores) if x is not None] == [5, 10, 20] and set(scores) == {None, 1.0}
    both = g.conversation(task, tok, 1024, 6, 1, haystack, asked=(1, 6))  # turn 1 asks too
    assert both.turns[0].answers and both.turns[0].question in both.turns[0].user and both.turns[5].answers
    assert g.conversation(task, tok, 1024, 5, 0, haystack) == g.conversation(
        task, tok, 1024, 5, 0, haystack, asked=None
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (("niah_single_number", 1024, 5, 0, "noise", True, (0, 5)), ["asked", "1..5"]),
        (("niah_single_number", 1024, 5, 0, "noise", True, (5, 3)), ["asked", "increasing"]),
        (("niah_single_number", 1024, 5, 0, "noise", True, ()), ["asked", "at least one"]),
        (("niah_multikey", 1024, 3, 0, "noise"), ["task", "no multi-turn form", "niah_single_number", "qa"]),
        (("niah_single_number", 1024, 1, 0, "noise"), ["turns", "2..20"]),
        (("niah_single_number", 1024, 21, 0, "noise"), ["turns", "2..20"]),
        (("qa", 1024, 8, 0, "document"), ["context", "turns up to", "longer context"]),
        (("qa", 2048, 9, 0, "noise"), ["turns", "qa", "up to 8"]),
        (("qa", 300, 3, 0, "noise"), ["context", "too small", "at least"]),
    ],
)
def test_bad_conversation_settings_are_one_line(tok, args, words):
    with pytest.raises(g.SampleError) as e:
        g.conversation(args[0], tok, *args[1:])
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
