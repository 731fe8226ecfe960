"""`bench tasks`: every lane answers each generated sample, scored; exact lanes checked against the full cache's
answers (a check that can fail); the results file validated; bad settings refused with one line; the Tasks tab's
views drawn from a file alone."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvdirect_app.app.ui import tasks_view
from kvdirect_app.benchmarks import api as benchmarks
from kvdirect_app.benchmarks.task_suite import runner
from kvdirect_app.benchmarks.task_suite.grid import ratio_budget
from kvdirect_app.benchmarks.task_suite.summary import summarise
from kvdirect_app.cli import main
from kvdirect_app.plain.schema import SchemaError, stamp, validate
from kvdirect_app.strategies.window import Window

TINY = benchmarks.TasksConfig(
    model="tiny-llama",
    contexts="512",
    depths="0,100",
    tasks="niah_single_number",
    budgets="8,64",
    strategies="kvdirect,anchorkv,window,h2o",
    threads=1,
)


@pytest.fixture(scope="module")
def tiny_result():
    return benchmarks.tasks(TINY, say=lambda line: None)


@pytest.mark.check
def test_every_lane_answers_every_sample_and_exact_lanes_equal_the_full_cache(tiny_result):
    out = tiny_result
    assert [(c["task"], c["context"], c["depth"]) for c in out["cells"]] == [
        ("niah_single_number", 512, 0),
        ("niah_single_number", 512, 100),
    ]
    specs = [
        "full",
        "kvdirect:budget=8",
        "kvdirect:budget=64",
        "anchorkv:budget=8",
        "anchorkv:budget=64",
        "window:budget=8",
        "window:budget=64",
        "h2o:budget=8",
        "h2o:budget=64",
    ]
    for cell in out["cells"]:
        assert list(cell["lanes"]) == specs and cell["prompt_tokens"] <= 512
        for spec, lane in cell["lanes"].items():
            assert lane["exact"] == (spec.split(":")[0] in ("full", "kvdirect", "anchorkv"))
            assert not lane["equal_full"] or lane["reply"] == cell["lanes"]["full"]["reply"]
            if lane["exact"]:
                assert lane["equal_full"] and lane["score"] == cell["lanes"]["full"]["score"]
            else:
                assert lane["held_bytes"] < cell["lanes"]["full"]["held_bytes"]  # the budget holds: fewer bytes
    assert out["exact_answers_equal_full"] and out["exact_mismatches"] == []
    rows = {r["spec"]: r for r in out["rows"]}
    for spec in specs:
        mean = sum(c["lanes"][spec]["score"] for c in out["cells"]) / 2
        assert rows[spec]["score"] == mean and rows[spec]["cells"] == 2
    assert rows["window:budget=8"]["compression_ratio"] == pytest.approx(
        sum(1 - 8 / c["prompt_tokens"] for c in out["cells"]) / 2
    )
    assert rows["kvdirect:budget=8"]["compression_ratio"] == 0  # keeps (or rebuilds) every token's K/V
    assert [h["depth"] for h in out["heatmap"]["full"]] == [0, 100]
    validate(stamp("tasks", out))


@pytest.mark.check
def test_the_exactness_check_fails_when_a_lossy_lane_claims_to_be_exact(monkeypatch):
    """Mutation: the window at budget 8 said exact: its answers differ from the full cache's, and the run says so."""
    monkeypatch.setattr(Window, "claims_exact", True)
    out = benchmarks.tasks(replace(TINY, depths="50", budgets="8", strategies="window"), say=lambda line: None)
    assert not out["exact_answers_equal_full"]
    assert out["exact_mismatches"] == [["niah_single_number", 512, 50, "window:budget=8"]]


@pytest.mark.check
@pytest.mark.parametrize(
    "args, words",
    [
        (["--depths", "101"], ["depths", "0..100"]),
        (["--depths", "50,50"], ["depths", "twice"]),
        (["--contexts", "900000"], ["contexts", "context of 1024"]),
        (["--contexts", "100"], ["context", "too small", "at least"]),
        (["--tasks", "needle"], ["tasks", "niah_single_number", "qa"]),
        (["--haystack", "hay"], ["haystack", "noise", "document"]),
        (["--budgets", "0"], ["budgets", "1.."]),
        (["--strategies", "window:budget=4"], ["budget", "remove budget="]),
        (["--strategies", "nothing"], ["nothing"]),
        (["--samples", "0"], ["samples", "1..1000"]),
        (["--ratios", "0"], ["ratios", "above 0 and below 1"]),
        (["--ratios", "1.5"], ["ratios", "above 0 and below 1"]),
        (["--ratios", "half"], ["ratios", "'half'", "kvpress"]),
        (["--ratios", "0.5,0.50"], ["ratios", "0.5 is listed twice"]),
        (["--multiturn", "--turns", "1"], ["turns", "2..20"]),
        (["--turns", "3"], ["turns", "--multiturn"]),
        (["--multiturn", "--depths", "50"], ["depths", "--multiturn", "leave it out"]),
        (["--multiturn", "--tasks", "niah_multikey"], ["tasks", "'niah_multikey'", "niah_single_number", "qa"]),
        (["--multiturn", "--asked", "6"], ["asked", "'6'", "1..5"]),
        (["--asked", "2"], ["asked", "--multiturn"]),
        (["--multiturn", "--turns", "0"], ["--turns", "0 is not allowed", "2..20"]),
        (["--threads", "0"], ["--threads", "0 is not allowed", ">= 1"]),
        (["--threads", "-1"], ["--threads", "-1 is not allowed", ">= 1"]),
        (["--workers", "0"], ["--workers", ">= 1"]),
        (["--multiturn", "--turns", "20", "--asked", "5,10,20"], ["turns", "leave no room", "allowed: up to", "turns"]),
    ],
)
def test_bad_settings_get_one_line_naming_the_setting(args, words, capsys):
    code = main(["tasks", "--model", "tiny-llama", "--contexts", "512", "--tasks", "niah_single_number", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


@pytest.mark.check
def test_the_tasks_tab_draws_from_a_file_and_refuses_another_kind(tiny_result, tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(stamp("tasks", tiny_result)))
    result = tasks_view.load(path)
    fig = tasks_view.heatmap_figure(result, 8)
    names = [t.hovertemplate.split("<br>")[0] for t in fig.data]
    assert names == ["full", "kvdirect:budget=8", "anchorkv:budget=8", "window:budget=8", "h2o:budget=8"]
    assert [list(row) for row in fig.data[0].z] == [[h["score"] for h in result["heatmap"]["full"]]]
    points, full = tasks_view.frontier_points(result)
    assert len(points) == 9 and full == next(r["score"] for r in result["rows"] if r["spec"] == "full")
    table = tasks_view.table_html(result, 64)
    assert "window" not in table.lower() or "Sliding window" in table
    assert table.count("<tr>") == 1 + 5  # the header, the full cache, four lanes at budget 64
    assert result["measured_at"] in tasks_view.head_html(result)
    (tmp_path / "sweep.json").write_text(json.dumps({"schema": "kvdirect-studio/sweep", "schema_version": 1}))
    with pytest.raises(SchemaError, match="expected 'kvdirect-studio/tasks'"):
        tasks_view.load(tmp_path / "sweep.json")
    (tmp_path / "old.json").write_text(json.dumps({"schema": "kvdirect-studio/tasks", "schema_version": 0}))
    with pytest.raises(SchemaError, match="version 0 is not supported"):
        tasks_view.load(tmp_path / "old.json")


def test_the_shipped_result_is_a_valid_tasks_file_whose_exact_answers_equal_the_full_caches():
    path = tasks_view.shipped()
    assert path is not None, "presets/tasks/ ships no result"
    result = tasks_view.load(path)
    validate(result)
    assert result["exact_answers_equal_full"]
    for cell in result["cells"]:
        for lane in cell["lanes"].values():
            assert not lane["exact"] or lane["equal_full"]
    assert {r["strategy"] for r in result["rows"]} >= {
        "full",
        "kvdirect",
        "anchorkv",
        "h2o",
        "streaming_llm",
        "snapkv",
        "tova",
        "window",
        "knorm",
        "pyramidkv",
    }
    assert summarise(result["cells"], result["question"]) == {
        "rows": result["rows"],
        "heatmap": result["heatmap"],
        **({"leaderboard": result["leaderboard"]} if result.get("ratios") else {}),
    }


def test_smollm2_a_window_of_64_cannot_see_a_needle_in_the_middle_and_exact_lanes_answer_as_the_full_cache():
    """The real model, one 512-token sample: the full cache finds the needle; a window of the last 64 tokens
    cannot hold it (it sits ~250 tokens back) and so cannot answer; KV-Direct answers as the full cache."""
    out = benchmarks.tasks(
        benchmarks.TasksConfig(
            contexts="512", depths="50", tasks="niah_single_number", budgets="64", strategies="kvdirect,window"
        ),
        say=lambda line: None,
    )
    lanes = out["cells"][0]["lanes"]
    assert lanes["full"]["score"] == 1.0, lanes["full"]["reply"]
    assert lanes["window:budget=64"]["score"] == 0.0 and lanes["kvdirect:budget=64"]["equal_full"]


KEPT_HEAP = """
import resource, torch
from kvdirect_app.plain import rss

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def cycle():  # a 64 MiB block filled and freed, ten times: the page faults of it
    before = faults()
    for _ in range(10):
        x = torch.ones(16 << 20)
        del x
    return faults() - before

out = cycle()
with rss.kept_heap() as kept:
    cycle()  # the heap grows to hold the block once
    inside = cycle()
    released = rss.release()
after = cycle()
print(kept, released, out, inside, after)
"""


def test_a_task_cell_keeps_freed_blocks_in_the_heap_and_hands_them_back_after(monkeypatch):
    """Inside `rss.kept_heap` a freed 64 MiB block's pages are used again without faulting them in afresh, and
    `release` gives nothing back; after it, glibc's own policy again (the block is mapped and faulted in anew).
    Every task cell runs its turn inside it.  Mutations: the trim threshold left as it was (the heap's top is
    handed back on free); `task_cell` without it."""
    import subprocess
    import sys
    from contextlib import contextmanager

    done = subprocess.run([sys.executable, "-c", KEPT_HEAP], capture_output=True, text=True, timeout=120, check=True)
    kept, released, out, inside, after = done.stdout.split()
    assert (kept, released) == ("True", "False"), done.stdout
    out, inside, after = int(out), int(inside), int(after)
    assert inside * 4 < min(out, after), (out, inside, after)

    entered = []
    real = runner.rss.kept_heap

    @contextmanager
    def counted():
        with real() as ok:
            entered.append(ok)
            yield ok

    monkeypatch.setattr(runner.rss, "kept_heap", counted)
    benchmarks.tasks(replace(TINY, depths="0", budgets="8", strategies="window"), say=lambda line: None)
    assert entered == [True]


def test_a_ratio_is_a_budget_from_each_samples_prompt_with_the_question_in_it(tmp_path):
    """With --question with-context a ratio counts the whole prompt: the share of its K/V tokens a layer drops,
    int(tokens x (1 - ratio)) kept.  Worked out by hand for tiny-llama's 512-token samples (510 prompt tokens): ratio
    0.5 keeps 255, 0.75 keeps int(127.5) = 127 (compression 1 - 127/510 = 0.7510); a ratio whose budget equals a listed
    one (255) runs once and both lanes get its answer.  The leaderboard rows are kvpress's (strategy, ratio, task,
    score); the Tasks tab offers each budget and each ratio.  Mutations: round() for int() (128 kept); the lanes of a
    ratio shown at a budget that one sample's ratio budget happens to equal."""
    assert (ratio_budget(0.5, 510), ratio_budget(0.75, 510), ratio_budget(0.99, 50)) == (
        255,
        127,
        1,
    )
    out = benchmarks.tasks(
        replace(
            TINY,
            depths="0,100",
            budgets="255",
            ratios="0.5,0.75",
            strategies="window,kvdirect",
            question="with-context",
        ),
        say=lambda line: None,
    )
    validate(stamp("tasks", out))
    assert out["ratios"] == [0.5, 0.75] and out["budgets"] == [255]
    for cell in out["cells"]:
        assert cell["prompt_tokens"] == 510
        lanes = cell["lanes"]
        assert [(k, a["budget"], a["ratio"]) for k, a in lanes.items() if k != "full"] == [
            ("window:budget=255", 255, None),
            ("kvdirect:budget=255", 255, None),
            ("window:ratio=0.5", 255, 0.5),
            ("window:ratio=0.75", 127, 0.75),
            ("kvdirect:ratio=0.5", 255, 0.5),
            ("kvdirect:ratio=0.75", 127, 0.75),
        ]
        assert lanes["window:ratio=0.5"]["spec"] == "window:budget=255"
        assert lanes["window:ratio=0.5"]["reply"] == lanes["window:budget=255"]["reply"]
        assert lanes["window:ratio=0.75"]["held_bytes"] < lanes["window:ratio=0.5"]["held_bytes"]
        assert lanes["kvdirect:ratio=0.75"]["equal_full"]
    rows = {r["spec"]: r for r in out["rows"]}
    assert rows["window:ratio=0.75"]["compression_ratio"] == pytest.approx(1 - 127 / 510)
    assert rows["window:ratio=0.75"]["ratio"] == 0.75 and rows["window:ratio=0.75"]["budget"] is None
    assert rows["kvdirect:ratio=0.75"]["compression_ratio"] == 0  # keeps (or rebuilds) every token's K/V
    board = {(r["strategy"], r["ratio"]): r for r in out["leaderboard"]}
    assert sorted(board) == [("full", 0.0), ("kvdirect", 0.5), ("kvdirect", 0.75), ("window", 0.5), ("window", 0.75)]
    assert board[("window", 0.75)]["task"] == "niah_single_number" and board[("window", 0.75)]["cells"] == 2
    assert board[("window", 0.75)]["score"] == rows["window:ratio=0.75"]["score"]
    assert tasks_view.settings(out) == [("budget 255", 255), ("ratio 0.5", 0.5), ("ratio 0.75", 0.75)]
    assert tasks_view.specs_at(out, 255) == ["full", "window:budget=255", "kvdirect:budget=255"]
    assert tasks_view.specs_at(out, 0.75) == ["full", "window:ratio=0.75", "kvdirect:ratio=0.75"]
    assert "ratio 0.75" in tasks_view.heatmap_figure(out, 0.75).layout.title.text
    assert "window" in tasks_view.table_html(out, 0.75)


MULTI = benchmarks.TasksConfig(
    model="tiny-llama",
    multiturn=True,
    contexts="512",
    tasks="niah_single_number",
    turns=3,
    samples=2,
    ratios="0.5,0.875",
    strategies="kvdirect,anchorkv,window,snapkv",
    threads=1,
)


@pytest.fixture(scope="module")
def tiny_multi():
    return benchmarks.tasks(MULTI, say=lambda line: None)


@pytest.mark.check
def test_a_conversation_runs_turn_by_turn_each_turn_scored_and_exact_lanes_equal_the_full_cache(tiny_multi):
    from kvdirect_app.benchmarks.task_suite import multi_turn
    from kvdirect_app.models.loading import load_model

    out = tiny_multi
    validate(stamp("tasks", out))
    assert out["multiturn"] and out["turns"] == 3 and out["depths"] == [] and out["ratios"] == [0.5, 0.875]
    assert [(c["task"], c["context"], c["seed"], c["depth"]) for c in out["cells"]] == [
        ("niah_single_number", 512, 0, None),
        ("niah_single_number", 512, 1, None),
    ]
    loaded = load_model("tiny-llama", progress=lambda msg: None)
    for cell in out["cells"]:
        conv = multi_turn.conversation("niah_single_number", loaded.tokenizer, 512, 3, cell["seed"], chat=loaded.chat)
        assert [(t["question"], t["references"], t["needle_depth"]) for t in cell["turns"]] == [
            (t.question, list(t.answers), t.needle_depth) for t in conv.turns
        ]
        full = cell["lanes"]["full"]
        for spec, lane in cell["lanes"].items():
            assert len(lane["replies"]) == 3 and lane["reply"] == lane["replies"][0]
            assert lane["scores"] == multi_turn.score_turns(conv, lane["replies"])
            assert lane["score"] == pytest.approx(sum(lane["scores"]) / 3)
            if lane["exact"]:
                assert lane["equal_full_turns"] == [True] * 3 and lane["replies"] == full["replies"]
            elif spec.startswith("window"):  # it keeps 256 or 64 of 508 prompt tokens: turn 1's reply differs
                assert not lane["equal_full_turns"][0] and lane["held_bytes"] < full["held_bytes"]
            assert lane["equal_full"] == all(lane["equal_full_turns"])
    for spec, turns in out["by_turn"].items():
        assert [t["turn"] for t in turns] == [1, 2, 3]
        for n, t in enumerate(turns):
            assert t["score"] == pytest.approx(sum(c["lanes"][spec]["scores"][n] for c in out["cells"]) / 2)
            assert t["answers_equal_full"] == sum(c["lanes"][spec]["equal_full_turns"][n] for c in out["cells"])
    assert out["exact_answers_equal_full"]


@pytest.mark.check
def test_an_exact_lane_whose_later_turn_differs_is_named_with_its_seed_and_turn(monkeypatch):
    """Mutation: the window said exact.  Its answers differ from the full cache's; each differing turn is named."""
    monkeypatch.setattr(Window, "claims_exact", True)
    out = benchmarks.tasks(replace(MULTI, samples=1, ratios="0.875", strategies="window"), say=lambda line: None)
    lane = out["cells"][0]["lanes"]["window:ratio=0.875"]
    want = [
        ["niah_single_number", 512, None, "window:ratio=0.875", 0, n + 1]
        for n, same in enumerate(lane["equal_full_turns"])
        if not same
    ]
    assert want and out["exact_mismatches"] == want and not out["exact_answers_equal_full"]


@pytest.mark.check
def test_a_later_turn_opens_its_reply_with_the_answer_prefix():
    from kvdirect_app.engine.runner import Engine
    from kvdirect_app.models.loading import load_model
    from kvdirect_app.models.prompts import InputError
    from kvdirect_app.strategies import parse_spec

    loaded = load_model("tiny-llama", progress=lambda msg: None)
    engine = Engine(loaded, [parse_spec("full"), parse_spec("window:budget=8")], max_new_tokens=3, twins=False)
    list(engine.turn("Remember the number 42."))
    pending = engine.reference.pending
    list(engine.turn("Which number?", answer_prefix=" The number is"))
    prefix = engine.prompter.encode(" The number is", False)
    assert engine.turn_chunks[1] == engine.prompter.next("Which number?", pending) + prefix
    with pytest.raises(InputError, match="answer prefix opens a later turn"):
        list(Engine(loaded, [parse_spec("full")], max_new_tokens=2).turn("Hi", answer_prefix=" So"))


def test_smollm2_over_turns_a_window_answers_only_the_needle_it_still_holds():
    """The real model, one three-turn conversation (1,024 tokens, needles at 0, 50 and 100 percent): the full cache
    answers every turn; a window at ratio 0.875 (the last 127 prompt tokens) answers only the turn whose needle sits
    at the end, the others are too far back; KV-Direct answers as the full cache in every turn.  Mutation: every
    turn scored against turn 1's references (the full cache then scores 1, 0, 0)."""
    out = benchmarks.tasks(
        benchmarks.TasksConfig(
            multiturn=True,
            contexts="1024",
            tasks="niah_single_number",
            turns=3,
            samples=1,
            ratios="0.875",
            strategies="kvdirect,window",
        ),
        say=lambda line: None,
    )
    cell = out["cells"][0]
    lanes = cell["lanes"]
    assert lanes["full"]["scores"] == [1.0, 1.0, 1.0], lanes["full"]["replies"]
    assert lanes["kvdirect:ratio=0.875"]["equal_full_turns"] == [True, True, True]
    ends = [t["needle_depth"] == 100.0 for t in cell["turns"]]
    assert sorted(ends) == [False, False, True]
    assert lanes["window:ratio=0.875"]["scores"] == [1.0 if end else 0.0 for end in ends], lanes["window:ratio=0.875"][
        "replies"
    ]
    assert [t["score"] for t in out["by_turn"]["window:ratio=0.875"]] == lanes["window:ratio=0.875"]["scores"]


@pytest.mark.check
def test_the_turn_chart_draws_each_lanes_score_by_turn_with_the_full_cache_as_the_reference(tiny_multi, tmp_path):
    path = tmp_path / "multi.json"
    path.write_text(json.dumps(stamp("tasks", tiny_multi)))
    result = tasks_view.load(path)
    fig = tasks_view.turns_figure(result, 0.875)
    specs = tasks_view.specs_at(result, 0.875)
    assert specs == ["full", "kvdirect:ratio=0.875", "anchorkv:ratio=0.875", "window:ratio=0.875", "snapkv:ratio=0.875"]
    assert [t.name.split(" ")[0] for t in fig.data] == ["Full", "KV-Direct", "AnchorKV", "Sliding", "SnapKV"]
    assert "reference" in fig.data[0].name and fig.data[0].line.width > fig.data[1].line.width
    raw = tasks_view.turns_figure(result, 0.875, score=tasks_view.RAW)
    for trace, raw_trace, spec in zip(fig.data, raw.data, specs):
        assert [round(x) for x in trace.x] == [1, 2, 3]  # the strategies side by side within a turn
        assert list(trace.y) == pytest.approx([t["from_context"] for t in result["by_turn"][spec]])
        assert list(raw_trace.y) == pytest.approx([t["score"] for t in result["by_turn"][spec]])
        assert list(trace.error_y.array) == pytest.approx(
            [t["from_context_high"] - t["from_context"] for t in result["by_turn"][spec]]
        )
        assert [d[3] for d in trace.customdata] == [t["copies"] for t in result["by_turn"][spec]]
    assert "ratio 0.875" in fig.layout.title.text and "0.5" in tasks_view.turns_figure(result, 0.5).layout.title.text
    assert "2 conversations of 3 turns" in tasks_view.head_html(result)
    assert "in every turn of every conversation" in tasks_view.head_html(result)


def test_the_shipped_multiturn_result_is_valid_and_its_exact_answers_equal_the_full_caches_in_every_turn():
    path = tasks_view.shipped(multiturn=True)
    assert path is not None and path.stem.endswith("-multiturn"), "presets/tasks/ ships no multi-turn result"
    assert tasks_view.shipped() != path  # the single-turn result is another file
    result = tasks_view.load(path)
    validate(result)
    assert result["multiturn"] and result["turns"] >= 5 and len(result["ratios"]) >= 2
    assert result["exact_answers_equal_full"]
    for cell in result["cells"]:
        assert len(cell["turns"]) == result["turns"]
        for lane in cell["lanes"].values():
            assert not lane["exact"] or lane["equal_full_turns"] == [True] * result["turns"]
    assert {r["strategy"] for r in result["rows"]} >= {
        "full",
        "kvdirect",
        "anchorkv",
        "h2o",
        "streaming_llm",
        "snapkv",
        "tova",
        "window",
        "knorm",
        "pyramidkv",
    }
    summary = summarise(result["cells"], result["question"])
    assert summary["by_turn"] == result["by_turn"] and summary["rows"] == result["rows"]


@pytest.mark.check
def test_a_missing_shipped_result_says_which_command_makes_it():
    from kvdirect_app.app.ui import tasks_tab

    said = tasks_tab._nothing("no result is shipped in presets/tasks/", "--multiturn ", "smollm2-135m-multiturn.json")
    assert "bench tasks --multiturn --json presets/tasks/smollm2-135m-multiturn.json" in said
    assert "no result is shipped" in said


@pytest.mark.check
def test_a_stale_setting_from_a_hurried_visitor_is_skipped_never_an_error_in_the_page():
    """A model picked while an earlier change is queued: the event may carry the ratio of the result shown a moment
    ago after the pickers' choices were emptied (no result for that model and history).  Gradio refused such a value
    with an error in the page (a browser test saw "Value: 0.875 is not in the list of choices: []"); the pickers take
    it and the drawing skips what is not the result's.  Mutation that fails it: either picker without
    allow_custom_value."""
    import gradio as gr

    from kvdirect_app.app.ui import tasks_tab, tasks_view

    result = tasks_view.load(tasks_view.shipped(multiturn=True))
    ratio = [v for _, v in tasks_view.settings(result)][-1]
    with gr.Blocks():
        setting, task = tasks_tab._pickers(result, "test")
    setting.choices, task.choices = [], [(tasks_view.ALL, tasks_view.ALL)]  # what a missing result's update sets
    assert setting.preprocess(ratio) == ratio and task.preprocess(result["tasks"][-1]) == result["tasks"][-1]
    assert tasks_tab._known(result, ratio, tasks_view.ALL) and tasks_tab._known(result, ratio, result["tasks"][-1])
    assert not tasks_tab._known(None, ratio, tasks_view.ALL)
    assert not tasks_tab._known(result, 0.123, tasks_view.ALL) and not tasks_tab._known(result, ratio, "no task")


@pytest.mark.check
@pytest.mark.parametrize(
    "argv, words",
    [
        (["roofline", "--threads", "-1"], ["--threads", "-1 is not allowed", ">= 1"]),
        (["roofline", "--max-new-tokens", "1"], ["--max-new-tokens", "2"]),
        (["run", "--threads", "0", "--prompt", "Hi"], ["--threads", "0 is not allowed"]),
        (["sweep", "--workers", "-1", "--prompt", "Hi"], ["--workers", "-1 is not allowed"]),
        (["reproduce", "--threads", "-1", "--out", "x"], ["--threads", "-1 is not allowed"]),
        (["replay", "--spacing", "0"], ["--spacing", "0 is not allowed", ">= 1"]),
    ],
)
def test_every_number_is_checked_where_it_is_parsed(argv, words, capsys):
    """No number is silently replaced: a thread count of 0 or -1 is an error, never "the default" (the reviewer's
    cases: roofline --threads -1 ended in a traceback; tasks and roofline took 0 as the default)."""
    code = main([*argv, "--model", "tiny-llama"] if argv[0] != "reproduce" else argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


@pytest.mark.check
def test_a_thread_count_given_in_code_is_checked_too():
    from kvdirect_app.benchmarks import sweeps
    from kvdirect_app.plain.errors import UserError

    with pytest.raises(UserError, match="threads: 0 is not allowed; allowed: whole numbers >= 1"):
        benchmarks.tasks(replace(TINY, threads=0), say=lambda line: None)
    with pytest.raises(UserError, match="threads: -1 is out of range"):
        sweeps.budget_cells({}, None, None, [], False, {"threads": -1})


def _cell(held: dict[str, int | None], budget: int = 16, prompt: int = 512) -> dict:
    lanes = {
        spec: {
            "strategy": spec.split(":")[0],
            "budget": None if spec == "full" else budget,
            "ratio": None,
            "spec": spec,
            "score": 1.0,
            "exact": spec == "full",
            "equal_full": spec == "full",
            "held_bytes": b,
            "peak_bytes": b,
        }
        for spec, b in held.items()
    }
    return {
        "task": "qa",
        "context": prompt,
        "depth": 50,
        "prompt_tokens": prompt,
        "context_tokens": prompt,
        "lanes": lanes,
    }


def test_the_measured_compression_stands_beside_the_nominal_one():
    """A lane that holds the full cache's bytes under budget=16 of 512 tokens: nominal 0.969, measured 0; one that
    holds a quarter: 0.75; none measured: None (not 0).  Mutation: the measured figure taken from the budget (as
    the nominal one is) made the first 0.969."""
    cells = [_cell({"full": 1000, "mine:budget=16": 1000, "window:budget=16": 250, "blind:budget=16": None})]
    rows = {r["spec"]: r for r in summarise(cells)["rows"]}
    assert rows["mine:budget=16"]["compression_ratio"] == pytest.approx(1 - 16 / 512)
    assert rows["mine:budget=16"]["measured_compression"] == 0.0
    assert rows["window:budget=16"]["measured_compression"] == pytest.approx(0.75)
    assert rows["blind:budget=16"]["measured_compression"] is None and rows["full"]["measured_compression"] == 0.0
    assert "measured" in scores_table_head(rows)


def scores_table_head(rows: dict) -> str:
    from kvdirect_app.cli.tasks import scores_table

    return scores_table([{**r, "full_score": 1.0} for r in rows.values()]).splitlines()[0]


def test_the_tasks_tab_shows_the_measured_compression_of_a_shipped_file_beside_the_nominal():
    """The shipped result (written before the summary carried it) shows it too, from each cell's bytes: KNorm, which
    keeps its first layers whole, compresses less than its nominal ratio says, and less than the window.  Mutation:
    the table's measured cell filled with the nominal ratio (KNorm's equal to it)."""
    result = tasks_view.load(tasks_view.shipped())
    cells = result["cells"]
    knorm, window = (next(s for s in cells[0]["lanes"] if s.startswith(name + ":")) for name in ("knorm", "window"))
    nominal = {r["spec"]: r["compression_ratio"] for r in result["rows"]}
    assert tasks_view.measured(cells, knorm) < nominal[knorm] - 0.05
    assert tasks_view.measured(cells, knorm) < tasks_view.measured(cells, window)
    setting = cells[0]["lanes"][knorm]["ratio"] or cells[0]["lanes"][knorm]["budget"]
    table = tasks_view.table_html(result, setting)
    row = next(r for r in table.split("<tr>") if tasks_view.title(knorm) in r)
    assert f"<td>{nominal[knorm]:.2f}</td><td>{tasks_view.measured(cells, knorm):.2f}</td>" in row
    assert "compression (nominal)</th>" in table and "measured</th>" in table


def test_a_run_reports_the_measured_compression_from_its_own_bytes(tiny_result):
    """Each row's measured compression is its lanes' held bytes against the full cache's, cell by cell."""
    rows = {r["spec"]: r for r in tiny_result["rows"]}
    for spec in ("window:budget=8", "kvdirect:budget=8"):
        want = sum(
            1 - c["lanes"][spec]["held_bytes"] / c["lanes"]["full"]["held_bytes"] for c in tiny_result["cells"]
        ) / len(tiny_result["cells"])
        assert rows[spec]["measured_compression"] == pytest.approx(want)
    assert rows["window:budget=8"]["measured_compression"] > 0.5
    validate(stamp("tasks", tiny_result))
