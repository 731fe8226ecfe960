"""`bench reproduce --render DIR`: every verdict recomputed from results.json's cells (no model runs).

The fixture is the committed SmolLM2 quick run (docs/claims/results.json), copied into a temporary folder; a
run JSON written before the engine recorded each strategy's `mode` gets it from its spec here (the renderer
itself never reads a mode from a name).  Mutations edit the cells' numbers and require the verdict to follow.
"""

import copy
import json
import re
from pathlib import Path

import pytest

from kvdirect_app import bench
from kvdirect_app.claims import render, reproduce
from kvdirect_app.claims.verdicts import DIRECTION_ONLY, FAILS, HOLDS, NOT_MEASURED

COMMITTED = Path(__file__).resolve().parent.parent / "docs" / "claims" / "results.json"


def _mode(spec: str):
    if spec.startswith(("kvdirect", "anchorkv")):
        return "fast" if "mode=fast" in spec else "exact"
    return None


@pytest.fixture(scope="module")
def committed() -> dict:
    results = json.loads(COMMITTED.read_text())
    for cell in results["cells"]:
        j = cell["json"]
        if isinstance(j.get("strategies"), dict):  # bench run
            for spec, r in j["strategies"].items():
                r.setdefault("mode", _mode(spec))
        for r in j.get("rows", []):  # bench sweep rows carry their spec; other rows are left alone
            if "spec" in r:
                r.setdefault("mode", _mode(r["spec"]))
    return results


def cells(results: dict, section: str) -> list[dict]:
    return [c for c in results["cells"] if c["section"] == section]


def verdicts(results: dict) -> dict:
    return {name: c["verdict"] for name, c in reproduce.reassess(results)["claims"].items()}


def rendered(tmp_path: Path, results: dict, capsys) -> tuple[dict, str, str]:
    """Write `results` as DIR/results.json, run `reproduce --render DIR`; (results.json after, report, stdout)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "results.json").write_text(json.dumps(results))
    capsys.readouterr()
    assert bench.main(["reproduce", "--render", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    return json.loads((tmp_path / "results.json").read_text()), (tmp_path / "report.md").read_text(), printed


def row_verdict(report: str, title: str) -> str:
    row = next(line for line in report.splitlines() if line.startswith(f"| {title}:"))
    return re.search(r"\| \*\*(.+?)\*\* \|", row).group(1)


# --- mutations: the numbers change, so must the verdicts --------------------------------------------------------
def set_baselines(results: dict, value: float):
    for r in cells(results, "agreement")[0]["json"]["rows"]:
        if r["mode"] is None:
            r["token_match"] = value


def set_capacity(results: dict, value: float):
    for r in cells(results, "parked")[0]["json"]["rows"]:
        if r["strategy"].startswith("anchorkv"):
            r["capacity_vs_full"] = value


def twenty_turns(results: dict) -> dict:
    """The report's model's twenty-turn run: its lanes by spec."""
    return next(c for c in cells(results, "turns20") if c["json"]["model"] == results["model"])["json"]["strategies"]


def set_peak_ratio(results: dict, ratio: float, prefix: str = ""):
    """Every exact lane (whose spec starts with `prefix`) of the twenty-turn run peaks at the full cache's peak /
    ratio."""
    strategies = twenty_turns(results)
    full = strategies["full"]["state_bytes"]["peak"]
    for spec, r in strategies.items():
        if r["mode"] == "exact" and spec.startswith(prefix):
            r["state_bytes"]["peak"] = int(full / ratio)


def set_replay_speedup(results: dict, speedup: float):
    replay = cells(results, "replay")[0]["json"]["replay"]
    replay["naive"]["seconds"] = replay["cascade"]["seconds"] * speedup


def set_recompute_speedup(results: dict, speedup: float):
    for r in cells(results, "recompute")[0]["json"]["rows"]:
        r["read_ms"], r["speedup"] = r["recompute_ms"] * speedup, speedup


def exactness_rows(results: dict):
    for c in cells(results, "exactness"):
        for spec, r in c["json"]["strategies"].items():
            yield spec, r


def test_the_committed_run_renders_with_the_verdicts_its_numbers_give(committed):
    got = verdicts(committed)
    assert got["bytes"] == HOLDS  # computed from the config: 5 KiB and 136 KiB
    assert got["recompute"] == FAILS  # 0.02x against 5x
    assert got["agreement"] == DIRECTION_ONLY  # baselines up to 0.891 against the paper's 28%
    assert got["parked"] == DIRECTION_ONLY  # 1.43x at s* = 2 against the paper's 5.78x
    claims = reproduce.reassess(committed)["claims"]
    # A measured value above the ideal pass ratio is explained, never called the most it can be.
    assert "the most it can be" not in claims["replay"]["reason"]
    replay = cells(committed, "replay")[0]["json"]
    above = replay["speedup"] > replay["ideal_pass_ratio"]
    assert ("a naive pass cost more than a cascade pass" in claims["replay"]["reason"]) == above
    assert "1: 0.69x" in claims["parked"]["reason"]  # spacing 1 (below s*) listed, not counted


def test_stored_verdicts_and_reasons_are_not_trusted(committed, tmp_path, capsys):
    forged = copy.deepcopy(committed)
    for section in forged["sections"].values():
        section["verdict"], section["reason"] = "holds", "forged"
    forged["claims"] = {"recompute": {"verdict": "holds"}}
    after, report, printed = rendered(tmp_path, forged, capsys)
    assert "forged" not in report and after["claims"]["recompute"]["verdict"] == FAILS
    assert row_verdict(report, "4. Recompute vs read") == FAILS == row_verdict(printed, "4. Recompute vs read")


def test_render_follows_mutations_of_every_claim(committed, tmp_path, capsys):
    """Three edits of the numbers, each moving every claim to another verdict, each rendered by the CLI."""
    a = copy.deepcopy(committed)
    set_baselines(a, 0.2)
    set_capacity(a, 1.0)
    set_peak_ratio(a, 1.0)
    set_replay_speedup(a, 1.0)
    set_recompute_speedup(a, 6.0)
    next(r for _, r in exactness_rows(a) if r["mode"] == "exact" and r["rebuilt_token_layers"])["kv_exact"] = False
    gemma = next(c for c in cells(a, "bytes") if c["json"]["source"].endswith("gemma-3-4b.json"))
    gemma["json"]["residual_bytes_per_layer"] = 10240
    b = copy.deepcopy(committed)
    set_baselines(b, 0.7)
    set_capacity(b, 6.0)
    set_peak_ratio(b, 2.0)
    set_replay_speedup(b, 2.0)
    set_recompute_speedup(b, 2.0)
    c = copy.deepcopy(committed)
    set_baselines(c, 0.99)  # the edit: baselines that keep 99% of the tokens lose nothing
    expected = [(a, {"agreement": HOLDS, "parked": FAILS, "turns20": FAILS, "replay": FAILS, "recompute": HOLDS,
                     "exactness": FAILS, "bytes": FAILS}),
                (b, {"agreement": DIRECTION_ONLY, "parked": HOLDS, "turns20": DIRECTION_ONLY,
                     "replay": DIRECTION_ONLY, "recompute": DIRECTION_ONLY}),
                (c, {"agreement": FAILS})]
    for i, (results, want) in enumerate(expected):
        after, report, printed = rendered(tmp_path / str(i), results, capsys)
        for name, verdict in want.items():
            title = after["claims"][name]["title"]
            assert after["claims"][name]["verdict"] == verdict, (i, name, after["claims"][name]["reason"])
            assert row_verdict(report, title) == verdict == row_verdict(printed, title), (i, name)


def test_claim_2_is_judged_on_kv_directs_own_lane(committed, tmp_path, capsys):
    """The issue's acceptance: KV-Direct's lane at 0.1x the full cache's peak turns claim 2 to holds; AnchorKV's
    lanes, edited either way, change claim 2 not at all (they move 2b, their own row).  Mutation that fails it:
    judging claim 2 on the best exact lane of any method (the code before this issue)."""
    before = verdicts(committed)
    own = copy.deepcopy(committed)
    set_peak_ratio(own, 10.0, prefix="kvdirect")
    after, report, printed = rendered(tmp_path / "own", own, capsys)
    assert after["claims"]["turns20"]["verdict"] == HOLDS
    assert row_verdict(report, "2. Twenty turns") == HOLDS == row_verdict(printed, "2. Twenty turns")
    for ratio in (10.0, 0.5):
        other = copy.deepcopy(committed)
        set_peak_ratio(other, ratio, prefix="anchorkv")
        got = verdicts(other)
        assert got["turns20"] == before["turns20"]
        assert got["turns20_anchorkv"] == (HOLDS if ratio > 2.45 else FAILS)
    # The r < 1 model is measured too, and its row names r and its own verdict.
    section = reproduce.reassess(committed)["sections"]["turns20"]
    mha = next(m for m in section["by_model"] if m["model"] == reproduce.MHA)
    assert mha["r"] < 1 and mha["ratio"] > 0 and mha["verdict"] in (HOLDS, DIRECTION_ONLY, FAILS)


def test_patching_holds_only_at_zero_and_only_where_the_control_can_fail(committed):
    """Mutations: one layer's KL a hair above 0 (fails); a model's control at 0 (that model is not counted; all of
    them at 0: not measured)."""
    assert verdicts(committed)["patching"] == HOLDS
    nudged = copy.deepcopy(committed)
    run = cells(nudged, "patching")[0]["json"]
    run["rows"][-1]["kl"] = run["max_kl"] = 1e-12
    assert verdicts(nudged)["patching"] == FAILS
    blind = copy.deepcopy(committed)
    for c in cells(blind, "patching"):
        c["json"]["min_control_kl"] = 0.0
    out = reproduce.reassess(blind)["claims"]["patching"]
    assert out["verdict"] == NOT_MEASURED and "the measurement could not fail" in out["reason"]


def test_task_scores_follow_the_answers(committed):
    """Claim 9 from the answers alone.  Mutations: an exact lane's answer that differs from the full cache's (fails),
    every lossy lane scoring as the full cache (no method changed a score: fails), no task cell (not measured)."""
    out = reproduce.reassess(committed)
    runs = [c["json"] for c in cells(committed, "tasks")]
    exact = [(lane["score"] == c["lanes"]["full"]["score"] and lane["equal_full"]) for j in runs for c in j["cells"]
             for spec, lane in c["lanes"].items() if spec != "full" and lane["exact"]]
    assert exact and out["claims"]["tasks"]["parts"][0]["ours"] == sum(exact) / len(exact)
    methods = {lane["strategy"] for j in runs for c in j["cells"] for lane in c["lanes"].values() if not lane["exact"]}
    assert methods == set(reproduce.EVICTION)  # the seven external methods
    differs = copy.deepcopy(committed)
    lane = next(lane for c in cells(differs, "tasks")[0]["json"]["cells"] for lane in c["lanes"].values()
                if lane["exact"] and lane["strategy"] != "full")
    lane["equal_full"] = False
    assert verdicts(differs)["tasks"] == FAILS
    unchanged = copy.deepcopy(committed)
    for c in cells(unchanged, "tasks")[0]["json"]["cells"]:
        for lane in c["lanes"].values():
            lane["score"] = c["lanes"]["full"]["score"]
    assert reproduce.reassess(unchanged)["claims"]["tasks"]["parts"][1]["ours"] == 0
    assert verdicts(unchanged)["tasks"] == FAILS
    gone = copy.deepcopy(committed)
    for c in cells(gone, "tasks"):
        c["json"]["cells"] = []
    assert verdicts(gone)["tasks"] == NOT_MEASURED


def test_accelerator_exactness_is_not_measured_until_an_accelerator_ran(committed):
    """7b reads only cells that ran on CUDA: none here.  Mutation: one CPU cell relabelled as CUDA makes it
    measured (and moves that cell out of claim 7's count)."""
    out = reproduce.reassess(committed)["claims"]
    assert out["exactness_accelerator"]["verdict"] == NOT_MEASURED and out["exactness"]["verdict"] == HOLDS
    assert "accelerator" not in out["exactness"]["measured_on"]
    moved = copy.deepcopy(committed)
    cell = next(c for c in cells(moved, "exactness") if c["json"]["model"] == moved["model"])
    cell["env"] = {**cell["env"], "device": "cuda:0", "gpu": "a test's label"}
    got = reproduce.reassess(moved)["claims"]["exactness_accelerator"]
    assert got["verdict"] == HOLDS and "cuda:0" in got["measured_on"]


def test_exact_or_fast_is_the_runs_mode_not_its_name(committed):
    named_fast = copy.deepcopy(committed)
    # A run named mode=fast but recorded as exact, not bit-equal: counted, so exactness fails.
    spec, r = next((s, r) for s, r in exactness_rows(named_fast) if "mode=fast" in s and r["rebuilt_token_layers"])
    r["mode"], r["kv_exact"] = "exact", False
    assert verdicts(named_fast)["exactness"] == FAILS
    # A run named as exact but recorded as fast: not counted, so a miss there changes nothing.
    named_exact = copy.deepcopy(committed)
    r = next(r for s, r in exactness_rows(named_exact) if "mode=fast" not in s and r["mode"] == "exact"
             and r["rebuilt_token_layers"])
    r["mode"], r["kv_exact"] = "fast", False
    assert verdicts(named_exact)["exactness"] == HOLDS
    # A run that rebuilt nothing proves nothing either way.
    idle = copy.deepcopy(committed)
    r = next(r for _, r in exactness_rows(idle) if r["mode"] == "exact" and not r["rebuilt_token_layers"])
    r["kv_exact"], r["token_match"] = False, 0.5
    assert verdicts(idle)["exactness"] == HOLDS
    # No mode recorded at all (a run JSON from before the engine wrote it): nothing is counted.
    unrecorded = copy.deepcopy(committed)
    for _, r in exactness_rows(unrecorded):
        r.pop("mode")
    out = reproduce.reassess(unrecorded)["claims"]["exactness"]
    assert out["verdict"] == NOT_MEASURED and "mode not recorded" in out["reason"]


def test_exactness_counts_only_runs_that_rebuilt(committed):
    out = reproduce.reassess(committed)
    rows = [r for _, r in exactness_rows(committed) if r["mode"] == "exact"]
    counted = [r for r in rows if r["rebuilt_token_layers"] > 0]
    section = out["sections"]["exactness"]
    assert section["counted"] == len(counted) and section["idle"] == sum(
        1 for _, r in exactness_rows(committed) if r["mode"] in ("exact", "fast") and not r["rebuilt_token_layers"])
    reason = out["claims"]["exactness"]["reason"]
    assert f"{len(counted)} of {len(counted)} exact-mode runs that rebuilt K/V bit-equal" in reason
    text = render.render(out)
    assert "Nothing to rebuild (0 token-layers), not counted:" in text
    # The kernels are read from the runs, never stated: which computed the forwards, and fast mode's count.
    modes = sorted({(r_json.get("kernels") or {}).get("mode", "mode not recorded")
                    for r_json in (c["json"] for c in cells(committed, "exactness"))})
    assert f"kernels: the reference and every lane's forwards {', '.join(modes)}" in reason
    assert "fast mode (all old tokens in one call, rebuilt with:" in reason
    native = copy.deepcopy(committed)
    for c in cells(native, "exactness"):
        c["json"]["kernels"] = {**(c["json"].get("kernels") or {}), "mode": "native"}
    assert "forwards native" in reproduce.reassess(native)["claims"]["exactness"]["reason"]


def test_missing_figures_are_not_measured(committed):
    no_exact = copy.deepcopy(committed)
    for r in twenty_turns(no_exact).values():
        if r["mode"] == "exact":
            r["token_match"] = 0.5
    assert verdicts(no_exact)["turns20"] == NOT_MEASURED
    no_gemma = copy.deepcopy(committed)
    no_gemma["cells"] = [c for c in no_gemma["cells"] if "gemma-3-4b" not in c["name"]]
    assert verdicts(no_gemma)["bytes"] == NOT_MEASURED


def test_rendered_html_needs_no_network(committed, tmp_path, capsys):
    rendered(tmp_path, committed, capsys)
    pages = list(tmp_path.glob("*.html"))
    assert len(pages) == 3 and (tmp_path / "plotly.min.js").stat().st_size > 100_000
    for page in pages:
        scripts = re.findall(r"<script[^>]*\bsrc=[\"']?([^\"' >]+)", page.read_text())
        assert scripts and not [s for s in scripts if re.match(r"(https?:)?//", s)], (page.name, scripts)


# --- bad input: one line, exit status 2 --------------------------------------------------------------------------
def test_bad_render_input_is_one_line(committed, tmp_path, capsys):
    def error(folder) -> str:
        capsys.readouterr()
        assert bench.main(["reproduce", "--render", str(folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --render: ") and "\n" not in err and "Traceback" not in err
        return err

    assert "no such folder" in error(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    assert "is a file" in error(tmp_path / "file")
    assert "no results.json" in error(tmp_path)
    (tmp_path / "results.json").write_text("{not json")
    assert "not valid JSON" in error(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"model": "smollm2-135m", "quick": True, "cells": 3}))
    assert "no schema field" in error(tmp_path)
    stamped = {"schema": "kvdirect-studio/reproduce", "schema_version": 4}
    (tmp_path / "results.json").write_text(json.dumps({**stamped, "model": "smollm2-135m", "quick": True, "cells": 3}))
    assert "'cells' missing or not a list" in error(tmp_path)
    partial = {**committed, "cells": [c for c in committed["cells"] if c["section"] != "replay"]}
    (tmp_path / "results.json").write_text(json.dumps(partial))
    assert "no cell of section(s) replay" in error(tmp_path)
    broken = copy.deepcopy(committed)
    del cells(broken, "parked")[0]["json"]["rows"][0]["capacity_vs_full"]
    (tmp_path / "results.json").write_text(json.dumps(broken))
    assert "section parked" in error(tmp_path)


def test_render_and_out_are_exclusive(tmp_path, capsys):
    for argv in (["--render", str(tmp_path), "--out", str(tmp_path)], []):
        with pytest.raises(SystemExit) as info:
            bench.main(["reproduce", *argv])
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and "one of the arguments --out --render is required" in err


def test_the_claims_tab_shows_verdicts_computed_from_the_numbers(committed, tmp_path, monkeypatch):
    """The page's cards and table come from `reproduce.load` (the numbers' verdicts), never from the verdicts or
    report stored beside them.  Mutation that fails it: the tab reading results.json's stored claims (as before)."""
    import gradio as gr

    from kvdirect_app.ui import layout

    forged = copy.deepcopy(committed)
    forged = {**reproduce.reassess(forged)}
    for claim in forged["claims"].values():
        claim["verdict"], claim["reason"] = "holds", "forged reason"
    forged.pop("sections")
    (tmp_path / "results.json").write_text(json.dumps(forged))
    (tmp_path / "report.md").write_text("# forged report\n\n## Details\n\nforged details\n")
    monkeypatch.setattr(layout, "CLAIMS", tmp_path)
    with gr.Blocks() as demo:
        layout._claims_tab()
    shown = " ".join(str(getattr(block, "value", "")) for block in demo.blocks.values())
    assert "forged" not in shown
    computed = reproduce.reassess(committed)["claims"]
    assert f'kvd-card-verdict kvd-bad">{FAILS}<' in shown and computed["recompute"]["verdict"] == FAILS
    for claim in computed.values():
        assert claim["measured_on"] in shown and f"**{claim['verdict']}**" in shown
