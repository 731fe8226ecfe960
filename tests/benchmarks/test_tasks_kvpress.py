"""`bench tasks`' lanes at a compression ratio (the field's grid, kvpress's leaderboard form) run each method as its
NVIDIA kvpress 0.5.5 press behaves in kvpress's pipeline: SnapKV and PyramidKV with a 64-token window, KNorm on
every layer at the prompt only; a setting the name gives itself stays; the lanes at a budget keep our defaults.
Every leaderboard row names what its lane ran, every setting included."""

from __future__ import annotations

import pytest

from kvdirect_app.app.ui import tasks_view
from kvdirect_app.benchmarks import api as benchmarks
from kvdirect_app.benchmarks.task_suite.grid import plan
from kvdirect_app.plain.schema import stamp, validate
from kvdirect_app.strategies import StrategyError, kvpress_spec, parse_spec


@pytest.mark.parametrize(
    "name, ran",
    [
        ("snapkv", "snapkv:window=64"),
        ("pyramidkv", "pyramidkv:window=64"),
        ("knorm", "knorm:skip=0:decode=grow"),
        ("snapkv:window=32", "snapkv:window=32"),  # the name's own setting stays, even at our default
        ("knorm:decode=hold", "knorm:decode=hold:skip=0"),
        ("tova", "tova"),  # kvpress's TOVAPress and StreamingLLMPress behave as ours do by default
        ("streaming_llm", "streaming_llm"),
        ("h2o", "h2o"),  # no press of kvpress's
        ("window", "window"),
    ],
)
def test_a_name_gets_kvpress_settings_where_it_does_not_set_them_itself(name, ran):
    assert kvpress_spec(name) == ran
    parse_spec(ran)  # a spec that parses


def test_a_bad_name_is_refused_by_the_same_line_as_everywhere():
    with pytest.raises(StrategyError, match="knorm: unknown setting 'windw'"):
        kvpress_spec("knorm:windw=3")


def test_the_full_spec_names_every_setting_defaults_included():
    assert parse_spec("snapkv").full_spec() == "snapkv:budget=64:window=32:kernel=5:pooling=avg:decode=grow"
    assert parse_spec("knorm:skip=0").full_spec(("budget",)) == "knorm:skip=0:decode=hold"
    assert parse_spec("full").full_spec() == "full"


def test_the_plan_runs_the_ratio_lanes_with_kvpress_settings_and_the_budget_lanes_with_ours():
    p = plan(
        benchmarks.TasksConfig(
            model="tiny-llama", contexts="512", budgets="64", ratios="0.5", strategies="snapkv,knorm,window"
        )
    )
    assert [s for *_, s in p.lanes] == ["snapkv:budget=64", "knorm:budget=64", "window:budget=64"]
    assert p.ratio_lanes == [
        ("snapkv", 0.5, "snapkv:ratio=0.5", "snapkv:window=64"),
        ("knorm", 0.5, "knorm:ratio=0.5", "knorm:skip=0:decode=grow"),
        ("window", 0.5, "window:ratio=0.5", "window"),
    ]


def test_a_run_at_a_ratio_ran_kvpress_settings_and_its_leaderboard_rows_say_so():
    """tiny-llama, one 512-token sample, ratio 0.5 with the question after: the cells record the spec that ran
    (window=64; KNorm skip=0, decode=grow) and the full spec; the leaderboard's `spec` is that full spec, the budget
    standing as the ratio.  Mutation: the plan without `kvpress_spec` (the lanes ran window=32)."""
    out = benchmarks.tasks(
        benchmarks.TasksConfig(
            model="tiny-llama",
            contexts="512",
            depths="50",
            tasks="niah_single_number",
            ratios="0.5",
            strategies="snapkv,knorm,snapkv:window=16,kvdirect",
            threads=1,
        ),
        say=lambda line: None,
    )
    validate(stamp("tasks", out))
    (cell,) = out["cells"]
    budget = cell["lanes"]["snapkv:ratio=0.5"]["budget"]
    assert budget == int(cell["context_tokens"] * 0.5)
    specs = {k: (a["spec"], a["full_spec"]) for k, a in cell["lanes"].items()}
    assert specs == {
        "full": ("full", "full"),
        "snapkv:ratio=0.5": (
            f"snapkv:window=64:budget={budget}",
            "snapkv:window=64:kernel=5:pooling=avg:decode=grow:ratio=0.5",
        ),
        "knorm:ratio=0.5": (f"knorm:skip=0:decode=grow:budget={budget}", "knorm:skip=0:decode=grow:ratio=0.5"),
        "snapkv:window=16:ratio=0.5": (
            f"snapkv:window=16:budget={budget}",
            "snapkv:window=16:kernel=5:pooling=avg:decode=grow:ratio=0.5",
        ),
        "kvdirect:ratio=0.5": (f"kvdirect:budget={budget}", "kvdirect:mode=exact:rebuild=step:ratio=0.5"),
    }
    board = {r["spec"]: r for r in out["leaderboard"]}
    assert sorted(board) == sorted(full for _, full in specs.values())
    assert board["snapkv:window=64:kernel=5:pooling=avg:decode=grow:ratio=0.5"]["strategy"] == "snapkv"
    assert {r["spec"]: r["full_spec"] for r in out["rows"]} == {k: full for k, (_, full) in specs.items()}
    table = tasks_view.table_html(out, 0.5)
    assert "title='ran: snapkv:window=64:kernel=5:pooling=avg:decode=grow:ratio=0.5'" in table, table
