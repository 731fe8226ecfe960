"""`bench reproduce`: a tiny-model report with every section; every number read back from results.json, and
every verdict and reason following from the cells' numbers (recomputed here, not read from the claims)."""

import json
import re

import pytest

from kvdirect_app import bench
from kvdirect_app.claims import papers, render, reproduce
from kvdirect_app.claims.verdicts import VERDICTS, judge, worst
from kvdirect_app.units import fmt_bytes

NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("claims")
    assert bench.main(["reproduce", "--model", MODEL, "--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def cell(results: dict, section: str, verb: str | None = None) -> dict:
    return next(c for c in results["cells"] if c["section"] == section and (verb is None or c["kind"] == verb))


# The report's own sentences, made from the numbers: a number may appear in them only as a value found elsewhere.
DERIVED = ("reason", "words", "notes", "measured_on")


def allowed_numbers(results: dict) -> set[str]:
    """Every number a report may print: each value of results.json in each of the report's formats, and the
    numbers inside its input strings (the papers' claims, names, settings, the rule) but not inside the
    sentences the report derives (reasons, notes: `DERIVED`).

    Mutation that fails `test_every_number_in_the_report_comes_from_results_json`: a number hard-coded into a
    reason or note (e.g. `sections._turns20` appending "about 4711.5x in the paper's setting")."""
    seen = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k not in DERIVED:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str):
            seen.update(NUMBER.findall(x))
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            texts = [render.number(x), fmt_bytes(x)]
            if isinstance(x, int):
                texts.append(f"{x:,}")
            for text in texts:
                seen.update(NUMBER.findall(text))

    walk(results)
    return seen


def test_every_claim_is_in_the_report_with_the_papers_figures_and_one_of_four_verdicts(report):
    out, results, text = report
    head, details = text.split(render.DETAILS)
    for name, claim in papers.CLAIMS.items():
        stored = results["claims"][name]
        assert claim.title in head and claim.quote in head
        assert (f"### {claim.title}" if not claim.section else claim.title) in details
        assert stored["verdict"] in VERDICTS and f"**{stored['verdict']}**" in head and stored["reason"] in head
        assert [f["key"] for f in stored["figures"]] == [p["key"] for p in stored["parts"]]
        for f in stored["figures"]:
            assert {"value", "unit", "measures", "model", "direction", "tolerance"} <= set(f)
        assert stored["verdict"] == worst(p["verdict"] for p in stored["parts"])
    assert results["claims"]["bytes"]["basis"] == "computed from the config"
    assert results["rule"]["text"] in head and "10%" in head
    for name in ("agreement", "recompute", "patching"):
        assert (out / f"{name}.html").stat().st_size > 1000 and (out / f"{name}.png").stat().st_size > 5000
    assert results["date"] in text


def test_every_number_in_the_report_comes_from_results_json(report):
    _, results, text = report
    allowed = allowed_numbers(results)
    stray = [n for n in NUMBER.findall(text) if n not in allowed]
    assert not stray, stray[:10]


def test_reasons_and_verdicts_follow_from_the_cells(report):
    """Our figures recomputed here from the cells' own JSON; each must be in the claim's reason, and the verdict
    must be the rule's on it."""
    _, results, _ = report
    claims = results["claims"]

    def figure(name: str, key: str):
        return next(f for f in papers.CLAIMS[name].figures if f.key == key)

    def rule(name: str, key: str, ours) -> str:
        f = figure(name, key)
        return judge(f.value, ours, f.direction, f.tolerance, f.neutral)

    runs = [c["json"] for c in results["cells"] if c["section"] == "turns20"]
    assert {j["model"] for j in runs} == {MODEL, reproduce.MHA}
    for name, prefix in (("turns20", "kvdirect"), ("turns20_anchorkv", "anchorkv")):
        for j in runs:  # each model's ratio, on the claim's own method, in the reason with its verdict
            lanes = j["strategies"]
            own = min(r["state_bytes"]["peak"] for spec, r in lanes.items()
                      if spec.startswith(prefix) and r["mode"] == "exact" and r["token_match"] == 1.0)
            ratio = lanes["full"]["state_bytes"]["peak"] / own
            assert f"{render.number(ratio)}x ({rule(name, 'peak_ratio', ratio)})" in claims[name]["reason"]
            if j["model"] == MODEL:  # the report's model decides
                assert f"{render.number(ratio)}x here" in claims[name]["reason"]
                assert claims[name]["verdict"] == rule(name, "peak_ratio", ratio)

    patched = [c["json"] for c in results["cells"] if c["section"] == "patching"]
    assert {j["model"] for j in patched} >= set(reproduce.FAMILIES)
    assert all(j["min_control_kl"] > 0 for j in patched)  # the control moves the distribution: it can fail
    kl = max(j["max_kl"] for j in patched)
    assert claims["patching"]["verdict"] == worst([rule("patching", "kl", kl),
                                                   rule("patching", "dlogit", max(j["max_abs_dlogit"] for j in patched))])
    assert claims["exactness_accelerator"]["verdict"] == "not measured"  # no accelerator in this run

    tasks = cell(results, "tasks")["json"]
    lanes = [(spec, lane, c["lanes"]["full"]) for c in tasks["cells"] for spec, lane in c["lanes"].items()
             if spec != "full"]
    exact = [lane["equal_full"] and lane["score"] == full["score"] for _, lane, full in lanes if lane["exact"]]
    changed = {lane["strategy"] for _, lane, full in lanes if not lane["exact"] and lane["score"] != full["score"]}
    assert claims["tasks"]["verdict"] == worst([rule("tasks", "exact", sum(exact) / len(exact)),
                                                rule("tasks", "lossy", len(changed) / len(reproduce.EVICTION))])

    rows = cell(results, "agreement")["json"]["rows"]
    named = ("h2o", "streaming_llm", "snapkv", "tova", "window")  # the five baselines claim 3's quote names
    baselines = [r["token_match"] for r in rows if r["mode"] is None and r["strategy"] in named]
    assert {r["strategy"] for r in rows if r["mode"] is None} == set(reproduce.EVICTION)  # all seven ran
    assert f"{render.number(min(baselines))}-{render.number(max(baselines))} here" in claims["agreement"]["reason"]
    exact = min(r["token_match"] for r in rows if r["mode"] == "exact")
    assert claims["agreement"]["verdict"] == worst([rule("agreement", "exact", exact),
                                                    rule("agreement", "baselines", (min(baselines), max(baselines)))])

    replay = cell(results, "replay")["json"]["replay"]
    speedup = replay["naive"]["seconds"] / replay["cascade"]["seconds"]
    ideal = replay["naive"]["layer_passes"] / replay["cascade"]["layer_passes"]
    assert f"{render.number(speedup)}x here" in claims["replay"]["reason"]
    assert f"is {render.number(ideal)}x" in claims["replay"]["reason"]
    assert "the most it can be" not in claims["replay"]["reason"]

    speedups = [r["speedup"] for r in cell(results, "recompute")["json"]["rows"] if r["speedup"] is not None]
    assert f"{render.number(max(speedups))}x here" in claims["recompute"]["reason"]
    assert claims["recompute"]["verdict"] == rule("recompute", "speedup", max(speedups))

    own = next(c for c in results["cells"] if c["section"] == "bytes" and c["json"]["source"] == MODEL)
    s_star = own["json"]["break_even_spacing_token_id_anchor"]
    parked = [r for r in cell(results, "parked")["json"]["rows"] if r["strategy"].startswith("anchorkv")
              and int(re.search(r"spacing=(\d+)", r["strategy"]).group(1)) >= s_star]
    least = min(r["capacity_vs_full"] for r in parked)
    assert f"{render.number(least)}-" in claims["parked"]["reason"]
    most = max(r["capacity_vs_full"] for r in parked)
    assert claims["parked"]["verdict"] == rule("parked", "capacity", (least, most))

    runs = [r for c in results["cells"] if c["section"] == "exactness" for r in c["json"]["strategies"].values()
            if r["mode"] == "exact" and r["rebuilt_token_layers"] > 0]
    equal = sum(1 for r in runs if r["kv_exact"])
    counted = f"{equal} of {len(runs)} exact-mode runs that rebuilt K/V bit-equal"
    assert runs and counted in claims["exactness"]["reason"]


def test_every_cell_records_where_it_ran(report):
    _, results, text = report
    for c in results["cells"]:
        env = c["env"]
        assert env["cpus"] >= 1 and env["processor"] and env["torch"], c["name"]
        if c["section"] == "bytes":
            assert env["device"].startswith("none"), env
        else:
            assert env["device"] == "cpu" and env["threads"] == 1, (c["name"], env)
    assert text.count("Ran on: ") == len(papers.SECTIONS)
    assert "Ran on: cpu, 1 thread; CPU " in text


def test_quick_runs_its_knobs_and_says_what_it_leaves_out(report):
    _, results, text = report
    knobs = reproduce.knobs(MODEL, quick=True)
    config = cell(results, "turns20", "run")["config"]
    assert config["max_new_tokens"] == knobs.turns_new_tokens
    assert len(config["strategies"].split(",")) == len(knobs.turns_lanes)
    assert not any(c["kind"] == "sweep" for c in results["cells"] if c["section"] == "turns20")
    line = next(line for line in text.splitlines() if line.startswith("`--quick` leaves out"))
    left_out = [lane for lane in reproduce.FULL.turns_lanes if lane not in reproduce.QUICK.turns_lanes]
    assert left_out and all(lane in line for lane in left_out) and "equal measured peak" in line


def test_the_quick_plan_keeps_the_twenty_turn_claims_lanes():
    quick, full = reproduce.QUICK, reproduce.FULL
    assert set(quick.turns_lanes) < set(full.turns_lanes) and quick.turns_new_tokens < full.turns_new_tokens
    # The claim needs the full cache, an exact lane with the lowest peak, KV-Direct's own lane and baselines.
    assert {"full", "kvdirect", "anchorkv:spacing=L:rebuild=step"} <= set(quick.turns_lanes)
    assert len(set(quick.turns_lanes) & set(reproduce.EVICTION)) >= 2
    specs = reproduce.plan(MODEL, quick=False)
    run = next(c for c in specs if c["section"] == "turns20")["config"]
    assert len(run["strategies"].split(",")) == len(reproduce.LANES)
    differ = [k for k, v in vars(quick).items() if v != vars(full)[k]]
    assert len(reproduce.leaves_out(vars(quick), vars(full))) == len(differ) > 0
    assert reproduce.leaves_out(vars(full), vars(full)) == []


def test_bad_reproduce_input_is_one_line(capsys):
    assert bench.main(["reproduce", "--model", "no-such-model", "--out", "/tmp/x"]) == 2
    assert bench.main(["reproduce", "--model", MODEL, "--executor", "dask", "--out", "/tmp/x"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "executor: unknown executor 'dask'; allowed: local, ray" in err
