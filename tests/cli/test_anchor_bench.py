"""The `replay` and `capacity` benchmark subcommands on a tiny model (figures are printed, never asserted)."""

import json

from kvdirect_app import bench


def test_replay_rebuilds_exactly_with_the_predicted_passes(tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert (
        bench.main(["replay", "--model", "tiny-gemma3", "--context", "40", "--spacing", "6", "--json", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    for kind in ("cascade", "naive"):
        row = result["replay"][kind]
        assert row["kv_exact"] is True
        assert row["layer_passes"] == row["expected_passes"]
    # Global layers 2 and 5 of 6, one anchor at 0: cascade runs 6 layers, naive 3 + 6.
    assert (result["replay"]["cascade"]["layer_passes"], result["replay"]["naive"]["layer_passes"]) == (6, 9)
    assert "cascade speedup" in capsys.readouterr().out


def test_capacity_parks_real_sessions_and_measures_them(tmp_path, capsys):
    out = tmp_path / "capacity.json"
    assert (
        bench.main(
            [
                "capacity",
                "--model",
                "tiny-llama",
                "--context",
                "4096",
                "--memory-gb",
                "1",
                "--measure-context",
                "64",
                "--measure",
                "2",
                "--budget",
                "8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = {row["strategy"]: row for row in json.loads(out.read_text())["rows"]}
    full, deepest = rows["full"], rows["anchorkv:spacing=4:budget=8"]
    assert deepest["parked_bytes"] == 4 * 4096  # token ids only
    assert full["parked_bytes"] == 4 * 4096 * (2 * 2 * 16 * 4)  # L * T * 2 n_kv d_h b
    assert deepest["sessions"] == 2**30 // deepest["parked_bytes"]
    assert deepest["capacity_vs_full"] == full["parked_bytes"] / deepest["parked_bytes"]
    for name, row in rows.items():
        assert row["sessions_parked"] == 2 and row["measured_at"] == 64, name
        assert row["parked_bytes_measured"] == row["formula_parked_bytes_at_measure"], name  # allocator = formula
        assert row["next_ttft_ms"] is not None, name
    # rebuild=turn rebuilds on resume; rebuild=step leaves it to the next step, so its resume allocates nothing
    step = rows["anchorkv:spacing=4:budget=8:rebuild=step"]
    assert step["resume_peak_bytes"] == step["parked_bytes_measured"]
    assert deepest["resume_peak_bytes"] > deepest["parked_bytes_measured"]
    assert "lower bound" in capsys.readouterr().out


def test_bad_benchmark_input_is_one_line(capsys):
    assert bench.main(["replay", "--model", "tiny-llama", "--spacing", "9", "--context", "16"]) == 2
    assert "--spacing: 9 must be between 1 and L=4" in capsys.readouterr().err
    assert bench.main(["replay", "--model", "tiny-llama", "--spacing", "2", "--context", "5000"]) == 2
    assert "--context: 5000 must be between 2 and the model's context" in capsys.readouterr().err
