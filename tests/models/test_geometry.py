"""Geometry from configs alone: bytes per token, break-even spacing, replay passes, the DP placement."""

import itertools
import json

import pytest
import torch

from kvdirect_app import bench
from kvdirect_app.models.geometry import ModelGeometry, load_config

pytestmark = pytest.mark.check  # the inner loop (`make check`)

LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
GEMMA = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "sliding_window": 8,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
}


def geom(config: dict, dtype=torch.float32) -> ModelGeometry:
    return ModelGeometry.from_config(load_config(dict(config)), dtype)


def test_bytes_per_token_and_ratio():
    g = geom(LLAMA)
    assert g.kv_bytes_per_token == 4 * 2 * 2 * 16 * 4  # L * 2 * n_kv * d_h * b
    assert g.residual_bytes == 128 * 4
    assert g.ratio_r == 128 / (2 * 2 * 16)
    assert geom(LLAMA, torch.bfloat16).kv_bytes_per_token == 4 * 2 * 2 * 16 * 2


def test_break_even_is_strict_and_the_token_id_anchor_moves_it():
    g = geom(LLAMA)
    # sum_l 2 n_kv d_h = 256 elements; ceil(4/s) * 128: s=1 512, s=2 256 (not < 256), s=3 256, s=4 128.
    assert g.break_even_spacing() == 4
    # With layer 0 as a 4-byte token id, s=2 costs 512 + 4 bytes < 1024 bytes of K/V.
    assert g.break_even_spacing(token_id_anchor=True) == 2
    assert g.anchor_bytes_per_token([0], token_id_anchor=True) == 4


def test_gemma3_4b_matches_the_papers_headline():
    g = ModelGeometry.from_config(load_config("gemma-3-4b"), torch.bfloat16)
    assert g.residual_bytes == 5 * 1024
    assert g.kv_bytes_per_token == 136 * 1024
    assert g.ratio_r == 1.25


def test_config_from_a_json_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    assert ModelGeometry.from_config(load_config(str(path))).kv_bytes_per_token == geom(LLAMA).kv_bytes_per_token


def test_sliding_layers_never_hold_more_than_their_window():
    g = geom(GEMMA)
    kvb = 2 * 1 * 32 * 4
    assert g.full_kv_bytes(100) == 2 * 100 * kvb + 4 * 7 * kvb
    assert g.full_kv_bytes(5) == 6 * 5 * kvb
    assert [layer.index for layer in g.global_layers] == [2, 5]


def test_replay_passes_cascade_and_naive():
    g = geom(LLAMA)
    assert g.replay_passes([0], cascade=True) == 4
    assert g.replay_passes([0], cascade=False) == 1 + 2 + 3 + 4
    assert g.replay_passes([0, 2], cascade=False) == (1 + 2) + (1 + 2)
    assert geom(GEMMA).replay_passes([0], cascade=False) == 3 + 6


@pytest.mark.parametrize("bound", [None, 2, 3, 4, 6])
def test_dp_placement_is_optimal_against_brute_force(bound):
    g = geom(GEMMA)
    anchors, bytes_, passes = g.place_anchors(max_passes=bound)
    best = None
    for r in range(0, g.num_layers):
        for rest in itertools.combinations(range(1, g.num_layers), r):
            cand = [0, *rest]
            p = g.replay_passes(cand, cascade=True)
            if bound is not None and p > bound:
                continue
            key = (g.anchor_bytes_per_token(cand, token_id_anchor=True), p)
            best = key if best is None or key < best else best
    assert (bytes_, passes) == best
    assert g.replay_passes(anchors) == passes and g.anchor_bytes_per_token(anchors, True) == bytes_


def test_dp_bound_that_cannot_be_met_is_an_error():
    with pytest.raises(ValueError, match="no anchor placement"):
        geom(GEMMA).place_anchors(max_passes=1)


def test_breakeven_cli_on_smollm2(tmp_path, capsys):
    out = tmp_path / "be.json"
    assert bench.main(["breakeven", "--model", "smollm2-135m", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ratio_r"] == 1.5 and report["break_even_spacing"] == 2
    for key in (
        "layers",
        "hidden_size",
        "num_kv_heads",
        "head_dim",
        "kv_bytes_per_token",
        "residual_bytes_per_layer",
        "break_even_spacing_token_id_anchor",
        "per_spacing",
    ):
        assert key in report
    assert report["per_spacing"][-1]["anchor_bytes_per_token_token_id_anchor"] == 4
    assert "r = d / (2 n_kv d_h) = 1.5" in capsys.readouterr().out


def test_breakeven_cli_windowed_view_and_bad_input(tmp_path, capsys):
    path = tmp_path / "gemma.json"
    path.write_text(json.dumps(GEMMA))
    out = tmp_path / "w.json"
    assert bench.main(["breakeven", "--config", str(path), "--dtype", "float32", "--json", str(out)]) == 0
    windowed = json.loads(out.read_text())["windowed"]
    assert windowed["dp_placement"]["anchors"] == [0]
    assert all(row["dp_bytes_per_token"] <= row["bytes_per_token"] for row in windowed["uniform"])
    capsys.readouterr()
    assert bench.main(["breakeven", "--config", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert bench.main(["breakeven"]) == 2
    assert "exactly one of --model" in capsys.readouterr().err
