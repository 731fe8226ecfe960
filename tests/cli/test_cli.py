"""The benchmark CLI: JSON shape, and one clear line for every kind of bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdirect_app import bench
from kvdirect_app.plain.schema import schema_of

ROOT = Path(__file__).resolve().parents[2]

TOP_KEYS = {"model", "device", "dtype", "prompt_ids", "strategies"}
STRATEGY_KEYS = {
    "token_ids",
    "text",
    "token_match",
    "first_divergence",
    "kv_exact",
    "max_abs_dk",
    "max_abs_dv",
    "max_abs_dlogit",
    "kl_mean",
    "state_bytes",
    "latency_ms",
    "tokens_per_s",
}


def test_run_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    code = bench.main(
        [
            "run",
            "--model",
            "tiny-qwen3",
            "--strategies",
            "full,kvdirect:budget=4:mode=exact",
            "--prompt",
            "hello",
            "--max-new-tokens",
            "6",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "kvdirect:budget=4:mode=exact" in printed and "K/V exact" in printed
    result = json.loads(out.read_text())
    assert TOP_KEYS <= set(result)
    assert set(result["strategies"]) == {"full", "kvdirect:budget=4:mode=exact"}
    for r in result["strategies"].values():
        assert STRATEGY_KEYS <= set(r)
        assert {"persistent_peak", "peak", "formula_peak"} <= set(r["state_bytes"])
        assert len(r["token_ids"]) in range(1, 7)
    exact = result["strategies"]["kvdirect:budget=4:mode=exact"]
    assert exact["token_match"] == 1.0 and exact["kv_exact"] is True


def test_a_long_prompt_is_read_in_pieces_with_progress(capsys):
    code = bench.main(
        [
            "run",
            "--model",
            "tiny-llama",
            "--strategies",
            "full,kvdirect:budget=4",
            "--raw",
            "--prompt",
            "cache " * 30,
            "--prefill-chunk",
            "8",
            "--max-new-tokens",
            "2",
        ]
    )
    assert code == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "prompt tokens" in line]
    assert lines and lines[0].startswith("turn 1: read 8 of ") and " of " in lines[-1]
    done, total = (int(x.replace(",", "")) for x in lines[-1].split("read ")[1].split(" prompt")[0].split(" of "))
    assert done == total and len(lines) == -(-total // 8)


# Bad input through the CLI: tests/app/test_public.py (the same cases as the API and the UI handlers).


def test_cuda_request_without_cuda_is_an_error_not_a_fallback(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present here")
    code = bench.main(["run", "--model", "tiny-llama", "--device", "cuda", "--max-new-tokens", "2"])
    assert code == 2
    assert "device: 'cuda' is not available here; allowed: auto, cpu" in capsys.readouterr().err


def test_the_module_runs_as_a_program_and_fails_cleanly(tmp_path):
    """The one test that runs the CLI as a program (every other test calls `bench.main` in-process): a bad
    strategy and an argparse error are each one line and status 2; and the schema check carries into the child
    process through the environment (conftest sets KVDIRECT_VALIDATE_JSON): a document its schema refuses (here:
    a schema that requires a field no result has) is not written."""

    def bench(*args, code=None, env=None):
        argv = ["-c", code, *args] if code else ["-m", "kvdirect_app.bench", *args]
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, env=env)

    proc = bench("run", "--model", "tiny-llama", "--strategies", "h2o_typo")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown strategy 'h2o_typo'")
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    proc = bench("run", "--max-new-tokens", "lots")
    assert proc.returncode == 2
    assert "--max-new-tokens: invalid int value: 'lots'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1

    schemas = tmp_path / "docs" / "schema"
    schemas.mkdir(parents=True)
    strict = schema_of("breakeven") | {"required": [*schema_of("breakeven")["required"], "no_such_field"]}
    (schemas / "breakeven.json").write_text(json.dumps(strict))
    (tmp_path / "presets").symlink_to(ROOT / "presets")
    code = (
        "import sys; from kvdirect_app.plain import paths; paths.CHECKOUT = paths.Path(sys.argv[1]); "
        "from kvdirect_app import bench; sys.exit(bench.main(['breakeven', '--model', 'smollm2-135m', "
        "'--json', sys.argv[2]]))"
    )
    out = tmp_path / "b.json"
    done = bench(str(tmp_path), str(out), code=code, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "no_such_field" in done.stderr and not out.exists(), done.stderr[-500:]


def test_alone_runs_each_strategy_in_a_process_of_its_own_and_loads_no_model_itself(tmp_path, capsys):
    """The parent's own load would be the largest RSS of the process tree that `/usr/bin/time` sees."""
    from pathlib import Path

    from kvdirect_app.cli.run import GNU_TIME
    from kvdirect_app.models import loading as models

    models._LOADED.pop(("tiny-qwen2", "float32", "cpu"), None)
    out = tmp_path / "alone.json"
    assert (
        bench.main(
            [
                "run",
                "--alone",
                "--model",
                "tiny-qwen2",
                "--device",
                "cpu",
                "--strategies",
                "full,kvdirect:budget=4",
                "--prompt",
                "Hi there.",
                "--max-new-tokens",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert ("tiny-qwen2", "float32", "cpu") not in models._LOADED
    data = json.loads(out.read_text())
    assert data["alone"] is True and set(data["strategies"]) == {"full", "kvdirect:budget=4"}
    for spec, r in data["strategies"].items():
        proc = r["process"]
        assert proc["load_peak_rss_bytes"] > 0 and proc["wait4_peak_rss_bytes"] >= proc["rss_before_run_bytes"]
        if Path(GNU_TIME).is_file():  # wait4's figure also counts this (large) test process at the fork
            assert 0 < proc["time_peak_rss_bytes"] <= proc["wait4_peak_rss_bytes"], spec
    assert data["strategies"]["kvdirect:budget=4"]["token_match"] == 1.0
    assert "peak RSS (/usr/bin/time)" in capsys.readouterr().out


def test_roofline_measures_the_machine_and_puts_each_pass_against_it(tmp_path, capsys):
    """`bench roofline`: the best time per row count is the larger of reading the weights once and the arithmetic,
    from this machine's measured GEMM rate and bandwidth and the model's own weight bytes (a tied head once); each
    run's shared pass is put against the roofline of its own row count; a bad --rows is one line, status 2."""
    import torch

    from kvdirect_app.benchmarks import roofline
    from kvdirect_app.models.loading import load_model

    out = tmp_path / "roof.json"
    assert (
        bench.main(
            [
                "roofline",
                "--model",
                "tiny-llama",
                "--strategies",
                "full,window:budget=4",
                "--rows",
                "1,3,8",
                "--step-strategies",
                "full,anchorkv:spacing=1:budget=2:rebuild=step",
                "--max-new-tokens",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())  # validated against docs/schema/roofline.json by the suite's setting
    model = load_model("tiny-llama", device="cpu").model
    weights = {m.weight.data_ptr(): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert report["weights"]["weight_bytes"] == sum(w.numel() * w.element_size() for w in weights.values())
    here = report["machine"]
    assert here["gemm_gflops"]["float32"] > 0 and here["bandwidth_gbs"] > 0
    rows = {r["rows"]: r for r in report["rows"]}
    assert set(rows) == {1, 3, 8}
    for n, r in rows.items():
        assert r["arithmetic_ms"] == pytest.approx(n * rows[1]["arithmetic_ms"])
        assert r["weights_read_ms"] == rows[1]["weights_read_ms"]
        assert r["best_ms"] == max(r["weights_read_ms"], r["arithmetic_ms"])
        assert r["native_linears_ms"] > 0 and r["invariant_linears_ms"] > 0  # the tiny model's probe passes here
    plain, panes = report["runs"]["plain"], report["runs"]["panes"]
    assert plain["rows"] == 1 and panes["rows"] >= 2 and panes["kernels"] == "invariant"
    expected = roofline.best_ms(
        report["weights"]["weight_bytes"],
        report["weights"]["params"],
        panes["rows"],
        here["gemm_gflops"]["float32"],
        here["bandwidth_gbs"],
    )["best_ms"]
    assert panes["best_ms"] == pytest.approx(expected)
    assert panes["shared_over_best"] == pytest.approx(panes["shared_ms"] / panes["best_ms"])
    assert set(panes["own_ms"]) == {"full", "window:budget=4"}
    # Which kernels ran, each run's ratio to the plain full cache, and each step split into its parts: the lanes'
    # own parts add up to what the lanes own, and the split shared pass to the shared pass.
    assert report["kernels"]["linears"] in ("avx512", "avx2") and "fixed-order" in report["kernels"]["invariant"]
    assert set(report["ratios"]) == {"panes", "panes_step"}
    for run in (panes, report["runs"]["panes_step"]):
        parts = run["parts_ms"]
        assert parts["linears"] + parts["shared_rest"] == pytest.approx(run["shared_ms"])
        lanes_own = sum(ms for part, ms in parts.items() if part.startswith("lanes_"))
        assert lanes_own == pytest.approx(sum(run["own_ms"].values()), rel=1e-6, abs=1e-6)
    assert report["runs"]["panes_step"]["parts_ms"]["lanes_replay"] > 0
    printed = capsys.readouterr().out
    assert "copy" in printed and "its roofline" in printed and "GB/s)" in printed and "the step by part" in printed
    assert bench.main(["roofline", "--model", "tiny-llama", "--rows", "0,x"]) == 2
    assert "--rows" in capsys.readouterr().err
