"""Answers a reviewer accepts (`bench tasks`): an answer copied from the lane's own earlier replies is not found in
the context; the question read after the context is compressed (kvpress's setting), or inside it; every question
from the compressed context (kvpress's multi-question mode); "changes scores" a paired test at a stated level.
Every expected figure below is worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvdirect_app.benchmarks import api as benchmarks
from kvdirect_app.benchmarks import task_suite as g
from kvdirect_app.cli import main
from kvdirect_app.engine.runner import Engine
from kvdirect_app.models.loading import load_model
from kvdirect_app.plain import stats
from kvdirect_app.strategies import Strategy, parse_spec
from kvdirect_app.strategies.scored import Scored

pytestmark = pytest.mark.check


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", progress=lambda msg: None)


def _conv(task: str, answers: list[tuple[str, ...]]) -> g.Conversation:
    turns = tuple(g.Turn(f"question {n}", f"question {n}", " Answer:", a, 50.0) for n, a in enumerate(answers))
    return g.Conversation(task, 512, 0, "noise", turns, 16)


# --- copies -------------------------------------------------------------------------------------------------------
def test_an_answer_copied_from_the_lanes_own_earlier_reply_scores_0_from_the_context_and_keeps_its_raw_score():
    """niah: turn 1 answers with turn 2's needle (2222222, a wrong answer there); turn 2 then "finds" it: raw 1, from
    the context 0, a copy.  Turn 3's 3333333 stood nowhere before: 1 and 1.  qa: turn 1 says "eighteen forty-three",
    an accepted form of turn 3's answer; turn 3's "1843" is then a copy too, although the form differs.  Mutations:
    a reply counted among its own earlier ones (every hit a copy); earlier replies ignored (no copy)."""
    conv = _conv("niah_single_number", [("1111111",), ("2222222",), ("3333333",)])
    replies = [" 2222222.", " It is 2222222.", " 3333333."]
    assert g.score_turns(conv, replies) == [0.0, 1.0, 1.0]
    assert g.score_turns_from_context(conv, replies) == ([0.0, 0.0, 1.0], [False, True, False])
    qa_conv = _conv("qa", [("1811", "eighteen eleven"), ("34", "thirty-four"), ("1843", "eighteen forty-three")])
    qa_replies = [" In eighteen forty-three.", " 34", " 1843"]
    assert g.score_turns(qa_conv, qa_replies) == [0.0, 1.0, 1.0]
    assert g.score_turns_from_context(qa_conv, qa_replies) == ([0.0, 1.0, 0.0], [False, False, True])
    # Several references (string_match_all): only the ones not said before count.
    assert g.score_from_context("niah_multivalue", ("11", "22", "33", "44"), "11 22 33", [" 22"]) == (0.5, True)
    assert g.score_from_context("niah_single_number", ("5",), " 5", []) == (1.0, False)


def test_a_turn_that_asks_nothing_scores_nothing_and_what_it_said_stands_before_the_later_turns():
    conv = _conv("niah_single_number", [(), ("2222222",)])
    assert g.score_turns_from_context(conv, [" 2222222", " 2222222"]) == ([None, 0.0], [False, True])
    assert g.score_turns_from_context(conv, [" hello", " 2222222"]) == ([None, 1.0], [False, False])


# --- the question after the context -------------------------------------------------------------------------------
def test_the_question_part_is_what_follows_the_context_and_both_parts_make_the_prompt(tiny):
    """The byte-level tokenizer (a token per byte, and one per special token): the question part is the question
    line, the chat template's end ("</s>", "<s>", "assistant: ") and the answer prefix, byte for byte; the context
    part ends where the haystack does."""
    tok = tiny.tokenizer
    s = g.sample("niah_single_number", tok, 512, 50, 0, chat=tiny.chat)
    context, question = g.prompt_parts(s, tok)
    assert context + question == g.prompt_ids(s, tok) and len(context + question) == 510
    assert s.tail == "\nWhat is the special magic number for calm-lemon mentioned in the provided text?"
    assert tok.decode(question) == s.tail + "</s><s>assistant: " + s.answer_prefix
    assert len(question) == len(s.tail) + 2 + len("assistant: ") + len(s.answer_prefix) == 166
    assert tok.decode(context).endswith("The sun is yellow.") and s.tail not in tok.decode(context)


def test_with_the_question_after_a_ratio_counts_the_context_alone(tiny):
    """kvpress's count: a lane at ratio r keeps max(1, int(context x (1 - r))) of the context's 344 tokens (510
    prompt tokens less the 166 of the question part, counted above): 172 at 0.5, 43 at 0.875; with the question
    inside the prompt, 255 and 63 of 510.  The compression is of the context: 1 - 43/344 = 0.875.  Mutation: the
    budget from the prompt's tokens (255)."""
    cfg = benchmarks.TasksConfig(
        model="tiny-llama",
        contexts="512",
        depths="50",
        tasks="niah_single_number",
        ratios="0.5,0.875",
        strategies="window",
        threads=1,
    )
    after = benchmarks.tasks(cfg, say=lambda line: None)
    assert after["question"] == "after"  # the default with --ratios
    cell = after["cells"][0]
    assert (cell["prompt_tokens"], cell["context_tokens"]) == (510, 344)
    assert [cell["lanes"][k]["spec"] for k in ("window:ratio=0.5", "window:ratio=0.875")] == [
        "window:budget=172",
        "window:budget=43",
    ]
    rows = {r["spec"]: r for r in after["rows"]}
    assert rows["window:ratio=0.875"]["compression_ratio"] == pytest.approx(1 - 43 / 344)
    assert {r["question"] for r in after["leaderboard"]} == {"after"}
    inside = benchmarks.tasks(replace(cfg, question="with-context"), say=lambda line: None)
    assert [inside["cells"][0]["lanes"][k]["spec"] for k in ("window:ratio=0.5", "window:ratio=0.875")] == [
        "window:budget=255",
        "window:budget=63",
    ]


@pytest.fixture
def peek():
    """A strategy that keeps the newest tokens and notes the newest candidate of every step that evicts, registered
    for the test only."""

    class Peek(Scored):
        name = "peek-test"
        seen_at_eviction: list = []

        def score(self, step):
            if step.evicts:
                Peek.seen_at_eviction.append(int(step.positions.max()))
            return step.positions.float()

    yield Peek
    Strategy.registry.pop(Peek.name, None)


def test_after_compression_the_question_is_read_with_nothing_evicted(tiny, peek):
    """The context (344 tokens) is compressed at its end, before the question exists: the strategy's choice sees
    positions up to 343 only, never the question's; the question's 166 tokens and the answer's 3 are then all kept
    (43 + 166 + 3 = 212 held).  With the question inside the prompt, the choice sees position 509, and the budget
    holds while decoding (43 held).  Mutations: the question fed as part of the compressed prompt; eviction left on
    after it."""
    tok = tiny.tokenizer
    s = g.sample("niah_single_number", tok, 512, 50, 0, chat=tiny.chat)
    context, question = g.prompt_parts(s, tok)

    def run(**how):
        peek.seen_at_eviction = []
        engine = Engine(tiny, [parse_spec("full"), peek(budget=43)], max_new_tokens=4, twins=False)
        for _ in engine.turn("sample", **how):
            pass
        lane = engine.lanes[0]
        layer = next(layer for layer in lane.cache.layers if hasattr(layer, "positions"))
        return list(peek.seen_at_eviction), sorted(set(layer.positions.flatten().tolist())), lane

    seen, kept, lane = run(ids=context, question=question)
    assert seen and max(seen) == 343, seen
    assert kept == list(range(344 - 43, 344 + 166 + 3)) and len(kept) == 212
    assert [f.keep for f in lane.forwards] == [False, True, True, True, True]  # prompt, question, three answer steps
    seen, kept, lane = run(ids=context + question)
    assert seen[0] == 509 and len(kept) == 43  # the prompt's choice saw the question; decoding evicts on


# --- every question from the compressed context --------------------------------------------------------------------
def test_a_question_from_the_saved_context_is_answered_as_a_fresh_run_on_the_context_and_that_question(tiny):
    """kvpress's multi-question mode: turn 2 from the saved context gives every lane (the full cache, H2O, SnapKV,
    an exact KV-Direct) the same answer, the same tokens held and the same bytes as a fresh engine asked that
    question first; the saved copy's bytes are no lane's (turn 1's held bytes equal a run that saved nothing).
    Mutations: the lanes not put back (turn 2 continues after turn 1's answer); the copy saved as the lanes' work."""
    tok = tiny.tokenizer
    conv = g.conversation("niah_single_number", tok, 512, 3, 0, chat=tiny.chat)
    context, first = g.conversation_parts(conv, tok)
    second = g.question_ids(conv, tok, 1)
    specs = ["full", "h2o:budget=40", "snapkv:budget=40", "kvdirect:budget=40"]

    def engine():
        return Engine(tiny, [parse_spec(x) for x in specs], max_new_tokens=5, twins=False)

    saved = engine()
    for _ in saved.turn("t1", ids=context, question=first, save_context=True):
        pass
    for _ in saved.turn("t2", question=second, from_context=True):
        pass
    fresh = engine()
    for _ in fresh.turn("t2", ids=context, question=second):
        pass
    plain = engine()
    for _ in plain.turn("t1", ids=context, question=first):
        pass
    a, b = saved.results()["strategies"], fresh.results()["strategies"]
    for spec in specs:
        assert a[spec]["turn_token_ids"][1] == b[spec]["turn_token_ids"][0], spec
        assert a[spec]["turns"][1]["between_turns"] == b[spec]["turns"][0]["between_turns"], spec
        assert a[spec]["turns"][0]["between_turns"] == plain.results()["strategies"][spec]["turns"][0]["between_turns"]
    for x, y in zip(saved.all_lanes, fresh.all_lanes):
        # Five tokens chosen, four fed (the last is chosen, not fed).
        assert x.cache.get_seq_length() == y.cache.get_seq_length() == len(context) + len(second) + 4
        assert x.history == y.history
    assert a["kvdirect:budget=40"]["kv_exact"] is True


def test_engine_refuses_a_turn_from_a_context_never_saved(tiny):
    from kvdirect_app.models.prompts import InputError

    engine = Engine(tiny, [parse_spec("full")], max_new_tokens=2)
    with pytest.raises(InputError, match="from_context: needs a context saved"):
        list(engine.turn("q", question=[5, 6], from_context=True))
    with pytest.raises(InputError, match="save_context: the context is what precedes a question"):
        list(engine.turn("q", save_context=True))


MULTI = benchmarks.TasksConfig(
    model="tiny-llama",
    multiturn=True,
    contexts="512",
    tasks="niah_single_number",
    turns=3,
    samples=2,
    ratios="0.875",
    strategies="kvdirect,window,h2o",
    threads=1,
)


def test_with_the_history_dropped_nothing_earlier_can_be_copied_and_exact_lanes_still_equal_the_full_cache():
    out = benchmarks.tasks(replace(MULTI, history="drop"), say=lambda line: None)
    assert (out["question"], out["history"]) == ("after", "drop") and out["exact_answers_equal_full"]
    for cell in out["cells"]:
        for lane in cell["lanes"].values():
            assert lane["scores_from_context"] == lane["scores"] and lane["copies"] == 0
    for rows in out["by_turn"].values():
        assert all(r["from_context"] == r["score"] and r["copies"] == 0 for r in rows)


def test_with_the_history_kept_the_from_context_score_follows_each_lanes_own_replies():
    out = benchmarks.tasks(MULTI, say=lambda line: None)
    assert out["history"] == "keep"
    conv = lambda seed: g.conversation("niah_single_number", load_model("tiny-llama").tokenizer, 512, 3, seed)  # noqa
    for cell in out["cells"]:
        for lane in cell["lanes"].values():
            own, copied = g.score_turns_from_context(conv(cell["seed"]), lane["replies"])
            assert (lane["scores_from_context"], lane["copied_turns"], lane["copies"]) == (own, copied, sum(copied))
    for spec, rows in out["by_turn"].items():
        for n, r in enumerate(rows):
            values = [c["lanes"][spec]["scores_from_context"][n] for c in out["cells"]]
            assert r["from_context"] == pytest.approx(sum(values) / 2)
            assert (r["from_context_low"], r["from_context_high"]) == stats.bootstrap_interval(values)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--question", "before"], ["question", "'before'", "after, with-context"]),
        (["--history", "drop"], ["history", "--multiturn"]),
        (["--multiturn", "--history", "forget"], ["history", "'forget'", "keep, drop"]),
        (["--multiturn", "--history", "drop", "--question", "with-context"], ["history", "drop", "--question after"]),
        (["--multiturn", "--history", "drop", "--asked", "2,3"], ["asked", "--history drop"]),
    ],
)
def test_bad_question_and_history_settings_get_one_line(args, words, capsys):
    code = main(["tasks", "--model", "tiny-llama", "--contexts", "512", "--tasks", "niah_single_number", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


# --- verdicts beyond noise -----------------------------------------------------------------------------------------
def test_the_sign_test_by_hand():
    """P(X >= k) for X ~ Binomial(n, 1/2): 1 of 1 is 1/2; 3 of 3, 1/8; 5 of 6, 7/64; 10 of 10, 1/1024."""
    assert stats.sign_test(1, 0) == 0.5 and stats.sign_test(3, 0) == 0.125
    assert stats.sign_test(5, 1) == 7 / 64 and stats.sign_test(10, 0) == 1 / 1024 and stats.sign_test(0, 0) == 1.0


def test_one_lower_sample_of_45_is_not_a_change_and_10_of_10_is():
    """Mutations: the mean rule (one lower sample, the rest tied: the mean is lower, "changes"); a test without the
    sample-count floor (4 of 4 lower: p = 1/16, called "no change" instead of "not enough samples")."""
    one = stats.changes([-1.0] + [0.0] * 44)
    assert (one["verdict"], one["p"], one["samples"], one["lower"], one["higher"]) == (stats.NO_CHANGE, 0.5, 45, 1, 0)
    ten = stats.changes([-0.5] * 10)
    assert (ten["verdict"], ten["p"]) == (stats.CHANGES, 1 / 1024)
    assert (
        stats.changes([-1.0] * 4)["verdict"] == stats.TOO_FEW and stats.changes([-1.0] * 5)["verdict"] == stats.CHANGES
    )
    assert stats.changes([1.0] * 20)["verdict"] == stats.NO_CHANGE  # higher is not a loss


def test_the_bootstrap_interval_holds_the_mean_and_is_a_point_for_equal_values():
    assert stats.bootstrap_interval([0.5] * 7) == (0.5, 0.5) and stats.bootstrap_interval([]) is None
    low, high = stats.bootstrap_interval([0.0, 1.0] * 6)
    assert 0.0 < low < 0.5 < high < 1.0 and stats.bootstrap_interval([0.0, 1.0] * 6) == (low, high)
