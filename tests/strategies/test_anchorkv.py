"""AnchorKV: exactness at every spacing on every tiny family (each family's union run, tests/runs.py), replay
counts, park and resume, settings."""

import pytest
import torch

from kvdirect_app.engine.runner import Engine, run_to_end
from kvdirect_app.models.geometry import ModelGeometry
from kvdirect_app.strategies import StrategyError, parse_specs
from kvdirect_app.strategies.anchorkv import rebuild_all

from ..conftest import bad_spec_error
from ..runs import TINY_FAMILIES, all_sliding, anchorkv_lanes, run_once, tiny, tiny_union
from .test_exactness_tiny import ANCHORKV_FAST, fast_mode_reports_its_error, native_fast_run

TURNS = ["Tell me about caches.", "Why do keys need positions?"]


def _check_exact(result, n_layers, rebuilds=True, specs=None):
    ref = result["strategies"]["full"]
    for spec in specs or result["strategies"]:
        r = result["strategies"][spec]
        assert r["token_ids"] == ref["token_ids"] and r["token_match"] == 1.0, spec
        assert r["kv_exact"] is True and r["layers_compared"] == n_layers and r["shape_mismatches"] == 0, spec
        assert r["max_abs_dlogit"] == 0.0, spec
        assert r["state_bytes"]["formula_matches_measurement"], spec
        assert r["state_bytes"]["peak"] >= r["state_bytes"]["formula_peak"], spec
        if spec != "full":
            assert (r["rebuilt_token_layers"] > 0) == rebuilds, spec


@pytest.mark.check
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_spacing_is_bit_equal_and_keeps_tokens(family, dtype):
    run = tiny_union(family, dtype)
    L = run.engine.loaded.config.num_hidden_layers
    _check_exact(run.result, L, rebuilds=not all_sliding(run.engine.loaded), specs=("full",) + anchorkv_lanes(L))


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3", "tiny-mistral", "tiny-olmo2"])
def test_park_and_resume_rebuild_exactly(family):
    loaded = tiny(family)
    L = loaded.config.num_hidden_layers
    specs = (
        "full,kvdirect:budget=3,kvdirect:budget=3:rebuild=turn,anchorkv:spacing=2:budget=3,"
        f"anchorkv:spacing={L}:budget=3:rebuild=step"
    )
    result = run_once(loaded, specs, TURNS + ["Once more."], 5, park=True).result
    _check_exact(result, L, rebuilds=family != "tiny-mistral")
    for spec, r in result["strategies"].items():
        assert len(r["parks"]) == 2
        assert all(p["bytes"] == p["formula_bytes"] for p in r["parks"]), spec
        assert all(p["resume_ms"] is not None for p in r["parks"]), spec


def test_deepest_spacing_with_token_id_anchor_parks_at_four_bytes_per_token():
    loaded = tiny("tiny-llama")
    L = loaded.config.num_hidden_layers
    engine = Engine(loaded, parse_specs(f"full,anchorkv:spacing={L}:budget=4"), max_new_tokens=4)
    run_to_end(engine, TURNS[:1])
    event = engine.park()
    record = event["lanes"][f"anchorkv:spacing={L}:budget=4"]
    assert record["bytes"] == 4 * record["seen"] == record["formula_bytes"]
    assert engine.results()["strategies"]["full"]["state_bytes"]["final_persistent"] > 100 * record["bytes"]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_cascade_and_naive_rebuild_the_same_kv_with_the_predicted_pass_counts(family):
    """Every token's K/V rebuilt from the anchors alone, after the union run, at the shallowest and the deepest
    spacing: both replays give the full cache's K/V, with the pass counts the geometry predicts."""
    run = tiny_union(family)
    engine = run.engine
    geom = ModelGeometry.from_config(engine.loaded.config, engine.loaded.dtype)
    L = geom.num_layers
    lanes = {lane.label: lane for lane in engine.lanes}
    shallow, deep = (lanes[f"anchorkv:spacing={s}:budget=2:rebuild=step"] for s in (1, L))
    reference = engine.reference.cache
    observer = engine.observer
    for lane in (shallow, deep):
        anchors = lane.strategy.anchor_layers(geom)
        kept = observer.tallies[lane.label].copy()
        try:
            with torch.inference_mode(), engine.kernel_scope():
                for kind in ("cascade", "naive"):
                    observer.tallies[lane.label].clear()  # the observer counts a replay's passes
                    with observer.region(lane.owner, "replay"):
                        kv = rebuild_all(lane.cache, kind)
                    assert observer.tallies[lane.label]["layer passes"] == geom.replay_passes(
                        anchors, cascade=kind == "cascade"
                    )
                    assert kv and len(kv) == len(geom.global_layers)
                    for g, (k, v) in kv.items():
                        assert torch.equal(k, reference.layers[g].keys) and torch.equal(v, reference.layers[g].values)
        finally:
            observer.tallies[lane.label] = kept
    deep_anchors = deep.strategy.anchor_layers(geom)
    assert geom.replay_passes(deep_anchors, cascade=False) > geom.replay_passes(deep_anchors, cascade=True)


@pytest.mark.parametrize("kernels", ["invariant", "native"])
def test_one_chunk_replay_reports_its_drift(kernels):
    """Fast mode replays all old tokens as one chunk with the model's own kernels (its GEMMs and its attention),
    whatever the run's.  In both kernel modes that rounds differently from what the forward computed here (fp32):
    under invariant kernels the forward's attention was the block attention and the replay's is the model's own
    (~1e-6 apart); under native ones the forward's decoded rows were one-row calls and the replay's one chunk is
    not.  The replayed layers' K/V differ and the report says so, while the exact sibling (the same anchors and
    budget, replayed as the mode promises) is bit-equal: the drift is the one chunk's.

    Mutation that fails it: fast mode replaying as exact mode does (in anchorkv.py, the `one_chunk` property
    returning False): its K/V become bit-equal and the report says exact, in both kernel modes."""
    run = tiny_union("tiny-llama") if kernels == "invariant" else native_fast_run("tiny-llama")
    result = run.result
    assert result["kernels"]["mode"] == kernels
    fast = result["strategies"][ANCHORKV_FAST]
    assert fast["kernels"] == {"forward": kernels, "rebuild": "native, one call"}
    fast_mode_reports_its_error(fast)
    exact = result["strategies"]["anchorkv:spacing=2:budget=2:rebuild=step"]
    assert exact["kv_exact"] is True and exact["max_abs_dk"] == 0.0 and exact["rebuilt_token_layers"] > 0


@pytest.mark.check
@pytest.mark.parametrize(
    "text, words",
    [
        ("anchorkv:spacing=0", "spacing=0 must be >= 1"),
        ("anchorkv:anchors=1-2", "must include layer 0"),
        ("anchorkv:anchors=a-b", "anchors='a-b' is not allowed; allowed:"),
        ("anchorkv:replay=fastest", "replay='fastest' is not allowed; allowed: cascade, naive"),
        ("anchorkv:rebuild=never", "allowed: step, turn"),
        ("anchorkv:token_id_anchor=maybe", "is not a valid bool"),
    ],
)
def test_bad_settings(text, words):
    assert words in bad_spec_error(text)


def test_spacing_beyond_the_model_is_refused_when_the_cache_is_built():
    loaded = tiny("tiny-llama")
    with pytest.raises(StrategyError, match="spacing=9 must be between 1 and L=4"):
        Engine(loaded, parse_specs("anchorkv:spacing=9"))
