"""The attention snapshot: the last query of a turn's prompt, at every layer, heads averaged (tests/runs.py's runs).

Checked against the model's own eager attention weights (transformers' `output_attentions`) for the full
cache; exact strategies hand attention the full cache's K, so their snapshot is the full cache's, bit for bit;
an eviction strategy's snapshot is None exactly where it had evicted; taking snapshots changes no lane's
tokens, bytes or K/V report; batched and one-by-one passes give the same snapshot.
"""

import pytest
import torch

from kvdirect_app.models import compat
from kvdirect_app.strategies import parse_spec

from ..runs import ATTENTION, TINY_FAMILIES, all_sliding, one_by_one, run_once, tiny, tiny_union


def _eager_weights(loaded, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the last query's attention weights over ids, heads averaged: the model's own eager attention."""
    model = loaded.model
    attn = compat.attention_module(compat.decoder_layers(model)[0])
    with torch.inference_mode(), compat.attention_implementation(attn.config, "eager"):
        out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    return [a[0, :, -1].float().mean(dim=0) for a in out.attentions]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_the_snapshot_is_the_models_own_attention_and_marks_what_was_evicted(family):
    """On the family's union run: the snapshot of the last turn's prompt, every lane.

    Which lanes must show the full cache's snapshot is read from the lane's declared class (`claims_exact`: KV-Direct
    and AnchorKV in mode=exact), never from the run's own `kv_exact`: a check that ran only where the run already
    reported its K/V bit-equal would skip exactly the lane that broke.

    Mutation that fails it: KV-Direct's rebuilt K off by a relative 1e-6 (`ResidualLayer.rebuild_old`'s invariant
    branch, `keys[..., :end, :].mul_(1 + 1e-6)` after the projection): the lane's `kv_exact` turns False, which the
    old gate read as "skip", while its snapshot now differs from the full cache's.  A mode=fast lane promises no
    bits: its snapshot is held within 1e-6 of the full cache's (the tiny families' fast lanes measure up to 5e-8),
    and to the bit where its K/V measured bit-equal."""
    run = tiny_union(family)
    engine, evicted, loaded = run.engine, run.evicted_at_last_turn, run.engine.loaded
    maps = engine.attention_maps()
    full = maps["full"]
    turns = sum(e["type"] == "turn" for e in run.events)
    assert set(maps) == set(engine.show) and full["turn"] == turns and len(full["tokens"]) == full["position"] + 1
    ids = engine.reference.history[: full["position"] + 1]
    for j, (ours, eager) in enumerate(zip(full["layers"], _eager_weights(loaded, ids))):
        handed = torch.tensor([w is not None for w in ours])
        weights = torch.tensor([0.0 if w is None else w for w in ours])
        # Eager attention gives 0 to masked positions (outside a sliding window): those are the ones not handed.
        assert torch.allclose(weights, eager, atol=2e-5), (family, j)
        assert bool(handed.all()) or compat.layer_specs(loaded.config)[j].is_sliding, (family, j)
        assert abs(float(weights.sum()) - 1.0) < 1e-4
    exact = [label for label in maps if label != "full" and parse_spec(label).claims_exact]
    assert {label.split(":")[0] for label in exact} == {"kvdirect", "anchorkv"}, exact
    for label, snap in maps.items():
        strategy = label.split(":")[0]
        for j, layer in enumerate(snap["layers"]):
            missing = {i for i, w in enumerate(layer) if w is None}
            assert abs(sum(w for w in layer if w is not None) - 1.0) < 1e-4, (label, j)
            if label in exact:  # exact by its declared mode: the full cache's K, so the same weights
                assert layer == _full_on_same_history(engine, label, maps, j), (label, j)
            elif strategy in ("kvdirect", "anchorkv"):  # mode=fast: one native GEMM, its error measured, not promised
                full_layer = _full_on_same_history(engine, label, maps, j)
                assert [w is None for w in layer] == [w is None for w in full_layer], (label, j)
                assert max(abs(a - b) for a, b in zip(layer, full_layer) if a is not None) <= 1e-6, (label, j)
                if run.result["strategies"][label]["kv_exact"]:  # bit-equal K where it measured so: the same bits
                    assert layer == full_layer, (label, j)
            elif not compat.layer_specs(loaded.config)[j].is_sliding:
                # Not handed = evicted before this step; a token evicted by this very step was still handed.
                assert missing <= evicted[label][j], (label, j)
    if not all_sliding(loaded):
        assert any(w is None for w in maps["window:budget=6"]["layers"][-1]), "the window evicted nothing?"


def _full_on_same_history(engine, label, maps, j):
    lane = next(l for l in engine.lanes if l.label == label)
    assert lane.history[: maps[label]["position"] + 1] == engine.reference.history[: maps["full"]["position"] + 1]
    return maps["full"]["layers"][j]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_snapshots_change_no_figure_and_batching_changes_no_snapshot(family):
    """The same lanes with and without snapshots: the same tokens, reports and bytes (peaks included: the same
    lanes share each pass); and the snapshots of lanes one after another are those of the batched lanes.

    The bytes compared are the allocator trace's (`state_bytes` and each turn's figures, as `ByteBook.summary` and
    `TurnBytes.summary` name them), indexed with [] and required to be measured (an int, not None): a key that
    is gone, or an instrument that measured nothing, fails here instead of comparing None with None.

    Mutation that fails it: the snapshot computed outside the measurement's harness (in lockstep.py's
    `_snapshot`, `with contextlib.nullcontext():` instead of `with harness():`): its buffers are charged to the
    lane, whose peak with snapshots is then above its peak without."""
    loaded = tiny(family)
    with_snap = run_once(loaded, ATTENTION, threads=1)
    without = run_once(loaded, ATTENTION, threads=1, snapshots=False)
    sequential = one_by_one(tiny_union(family))
    assert without.engine.attention_maps() == {}
    maps, alone = with_snap.engine.attention_maps(), sequential.engine.attention_maps()
    assert set(maps) == set(ATTENTION) <= set(alone)
    assert all(maps[label] == alone[label] for label in maps)
    a, b = with_snap.result["strategies"], without.result["strategies"]
    assert set(a) == set(b) == set(ATTENTION)
    for label in a:
        for key in ("token_ids", "kv_exact", "max_abs_dk", "kl_mean", "rebuilt_token_layers"):
            assert a[label][key] == b[label][key], (label, key)
        sa, sb = a[label]["state_bytes"], b[label]["state_bytes"]
        assert sa["instrument"] == sb["instrument"] == "allocator trace (cpu), auditing the allocator ledger (cpu)", (
            label
        )
        for key in ("persistent_peak", "between_turns_peak", "final_persistent", "peak"):
            assert isinstance(sa[key], int) and sa[key] > 0, (label, key, sa[key])
            assert sa[key] == sb[key], (label, key)
        assert sa["peak"] >= sa["persistent_peak"] >= sa["final_persistent"], label
        assert len(a[label]["turns"]) == len(b[label]["turns"]) == 2, label
        for ta, tb in zip(a[label]["turns"], b[label]["turns"]):
            for key in ("peak_during_turn", "between_turns"):
                assert isinstance(ta[key], int) and ta[key] > 0, (label, ta["turn"], key, ta[key])
                assert ta[key] == tb[key], (label, ta["turn"], key)
