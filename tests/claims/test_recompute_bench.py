"""The recompute-vs-read microbenchmark (claims/recompute.py): coverage of the grid, the recompute's exactness
against a real forward, the bound, the verdict's consistency with the numbers, the figure.  No timing asserts."""

import copy
import json
import math

import pytest
import torch

from kvdirect_app.claims import recompute as rc
from kvdirect_app.claims.verdicts import SIZE_TOLERANCE
from kvdirect_app.models import compat

from ..conftest import tiny

BATCHES = (1, 2)
CONTEXTS = (8, 48)


@pytest.fixture(scope="module")
def result():
    return rc.measure(tiny("tiny-llama"), batch_sizes=BATCHES, contexts=CONTEXTS, repeats=1)


def test_rows_for_every_cell(result):
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(b, n) for b in BATCHES for n in CONTEXTS]
    json.dumps(result)  # plain JSON types only
    assert result["model"] == "tiny-llama" and result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["threads"] == torch.get_num_threads()
    assert result["host_bytes_per_s"] is None
    for key in ("device_flops_per_s", "device_bytes_per_s", "flop_per_byte"):
        assert math.isfinite(result[key]) and result[key] > 0
    for row in result["rows"]:
        assert row["skipped"] is None and row["tokens"] == row["batch"] * row["context"]
        for key in ("read_ms", "recompute_ms", "speedup", "bound_speedup", "intensity"):
            assert math.isfinite(row[key]) and row[key] > 0, key
        assert row["speedup"] == pytest.approx(row["read_ms"] / row["recompute_ms"])
        assert row["host_read_ms"] is None and row["host_speedup"] is None
        # tiny-llama: d = 64, 2 KV heads of 16: 64 elements of K/V per token, 2 * 64 * 64 FLOPs per token.
        assert row["kv_bytes"] == row["tokens"] * 64 * 4
        assert row["residual_bytes"] == row["tokens"] * 64 * 4
        assert row["flops"] == row["tokens"] * 2 * 64 * 64
        assert row["intensity"] == pytest.approx(row["flops"] / row["residual_bytes"])
        expected = (row["kv_bytes"] / result["device_bytes_per_s"]) / (
            row["flops"] / result["device_flops_per_s"] + row["residual_bytes"] / result["device_bytes_per_s"]
        )
        assert row["bound_speedup"] == pytest.approx(expected)
    # r = 1 here: the residual is as large as the K/V, so the bound is below 1 whatever the FLOPs.
    assert result["ratio_r"] == 1.0
    assert all(r["bound_speedup"] < 1 for r in result["rows"])


def _forward_kv(loaded, index: int, ids: torch.Tensor):
    """The raw residual entering decoder layer `index` (forward pre-hook) and the K/V the model handed its
    cache there, from one real batched forward."""
    captured = {}
    layer = compat.decoder_layers(loaded.model)[index]

    def hook(module, args, kwargs):
        captured["residual"] = (args[0] if args else kwargs["hidden_states"]).clone()

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        cache = compat.Cache(
            layers=[
                compat.DynamicSlidingWindowLayer(s.sliding_window) if s.is_sliding else compat.DynamicLayer()
                for s in compat.layer_specs(loaded.config)
            ]
        )
        with torch.inference_mode():
            loaded.model(input_ids=ids, cache=cache, use_cache=True)
    finally:
        handle.remove()
    return captured["residual"], cache.layers[index].keys, cache.layers[index].values


# Plain; per-head k_norm; full-width k_norm and no input norm (post-norm); mixed layer types, per-type RoPE.
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-olmo2", "tiny-gemma3"])
def test_recompute_equals_the_layer(name):
    loaded = tiny(name)
    specs = [s for s in compat.layer_specs(loaded.config) if not s.is_sliding]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 37), generator=gen)
    for spec in (specs[0], specs[-1]):
        residual, keys, values = _forward_kv(loaded, spec.index, ids)
        recompute = rc.Recomputer(loaded, spec.index)
        with torch.inference_mode():
            k, v = recompute(residual)
        assert k.shape == keys.shape and v.shape == values.shape
        assert torch.equal(k, keys) and torch.equal(v, values), (name, spec.index)
    if "olmo2" in name:
        assert recompute.norm is None
    else:
        assert recompute.norm is not None
    assert any("k_norm" in part for part in recompute.includes) == (name != "tiny-llama")


def test_default_layer_is_global_and_bad_layers_refused():
    loaded = tiny("tiny-gemma3")
    specs = compat.layer_specs(loaded.config)
    chosen = rc.Recomputer(loaded)
    assert not specs[chosen.index].is_sliding
    sliding = next(s.index for s in specs if s.is_sliding)
    with pytest.raises(ValueError, match="sliding"):
        rc.Recomputer(loaded, sliding)
    with pytest.raises(ValueError, match="out of range"):
        rc.Recomputer(loaded, len(specs))


def _rule(result) -> str:
    rows = [r for r in result["rows"] if not r["skipped"]]
    best = max(r["speedup"] for r in rows)
    host = [r["host_speedup"] for r in rows if r.get("host_speedup") is not None]
    top = max([best, *host])
    if top >= rc.PAPER_SPEEDUP * (1 - SIZE_TOLERANCE):
        return "holds"
    return "holds in direction, not in size" if top > 1 else "does not hold here"


def _faked(result, speedup: float, host: float | None = None):
    fake = copy.deepcopy(result)
    for row in fake["rows"]:
        row["read_ms"] = row["recompute_ms"] * speedup
        row["speedup"] = speedup
        if host is not None:
            row["host_read_ms"] = row["recompute_ms"] * host
            row["host_speedup"] = host
            row["host_bound_speedup"] = host
    if host is not None:
        fake["host_bytes_per_s"] = 25e9
    return fake


def test_summary_verdict_follows_the_numbers(result):
    s = rc.summary(result)
    assert s["verdict"] in rc.VERDICTS and s["verdict"] == _rule(result)
    assert s["best_speedup"] == max(r["speedup"] for r in result["rows"])
    assert s["largest_bound"] == max(r["bound_speedup"] for r in result["rows"])
    assert (s["best_at"]["batch"], s["best_at"]["context"]) in [(b, n) for b in BATCHES for n in CONTEXTS]
    assert isinstance(s["sentence"], str) and "\n" not in s["sentence"]
    json.dumps(s)
    # Mutations: the same result with recompute made faster, or faster only against a host copy.
    cases = [
        (6.0, None, "holds"),
        (2.0, None, "holds in direction, not in size"),
        (0.5, 3.0, "holds in direction, not in size"),
        (0.5, 6.0, "holds"),
        (0.5, 0.8, "does not hold here"),
        (0.25, None, "does not hold here"),
    ]
    for speedup, host, verdict in cases:
        fake = _faked(result, speedup, host)
        out = rc.summary(fake)
        assert out["verdict"] == verdict == _rule(fake), (speedup, host, out["sentence"])
        assert out["best_speedup"] == speedup
        assert f"{(speedup if speedup > 1 else 1 / speedup):.3g}x" in out["sentence"]
    assert "host memory" in rc.summary(_faked(result, 0.5, 3.0))["sentence"]
    assert rc.summary(_faked(result, 6.0))["cells_above_bound"] == len(result["rows"])  # bound < 1 here


def test_figure_has_bound_and_paper_reference(result):
    fig = rc.figure(result)
    metas = [t.meta for t in fig.data]
    assert "bound" in metas and "paper" in metas
    bound = fig.data[metas.index("bound")]
    assert bound.line.dash == "dot"
    paper = fig.data[metas.index("paper")]
    assert set(paper.y) == {rc.PAPER_SPEEDUP} and "5x" in paper.name
    assert sum(1 for t in fig.data if t.name and t.name.startswith("batch ")) == len(BATCHES)
    assert fig.layout.xaxis.type == "log" and fig.layout.font.size == 16
    assert any(s.y0 == 1 and s.y1 == 1 for s in fig.layout.shapes)
    assert any("recompute wins above" in (a.text or "") for a in fig.layout.annotations)
    title = fig.layout.title.text
    assert "tiny-llama" in title and "cpu" in title and "float32" in title
    # The host-copy regime (faked here: no CUDA) is drawn dashed.
    host_fig = rc.figure(_faked(result, 0.5, 3.0))
    assert any(t.line.dash == "dash" for t in host_fig.data if t.name and "host-copy" in t.name)
    assert "host_bound" in [t.meta for t in host_fig.data]


def test_cells_over_the_cap_are_skipped_and_said():
    loaded = tiny("tiny-llama")
    out = rc.measure(loaded, batch_sizes=(1,), contexts=(8, 4096), repeats=1, max_cell_bytes=1 << 20, host_copy=True)
    small, big = out["rows"]
    assert small["skipped"] is None and small["speedup"] > 0
    assert big["skipped"] and "cap" in big["skipped"] and big["speedup"] is None and big["read_ms"] is None
    assert any("host copy needs a CUDA device" in n for n in out["notes"])
    assert rc.summary(out)["skipped_cells"] == 1
    rc.figure(out)  # draws what was measured
