"""KNorm and PyramidKV: the selection each paper defines, and layers that hold different token counts.

KNorm keeps the keys of lowest L2 norm and leaves the first layers whole; PyramidKV gives each layer its own
SnapKV budget.  So global layers of one type hold different counts while the model builds one mask per type:
checked here are the per-layer budgets against the papers' formulas, the bytes against the formula, the
first global layer holding the most (it sizes the mask), and a prefill chunk after eviction seeing every
stored token of its own layer and its own tokens causally, in both kernel modes, batched and alone.
"""

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from kvdirect_app import strategy_cache
from kvdirect_app.engine.hooks import InputTap
from kvdirect_app.engine.lockstep import Row, run_batch
from kvdirect_app.engine.runner import Engine
from kvdirect_app.kernels.invariant import Kernels
from kvdirect_app.measure.observe import Observer, Owner
from kvdirect_app.models import compat
from kvdirect_app.models.threads import threads_set
from kvdirect_app.strategies import parse_spec, parse_specs
from kvdirect_app.strategies.base import FullLayer
from kvdirect_app.strategies.scored import ScoredLayer, per_layer
from kvdirect_app.strategies.scored_attention import fit_mask

from ..runs import tiny
from .test_eviction import N_KV, TURN_PLAN, TURNS, _drive, _kept

CPU = torch.device("cpu")


# --- KNorm ---------------------------------------------------------------------------------------------------------


@pytest.mark.check
@pytest.mark.parametrize("decode", ["hold", "grow"])
def test_knorm_keeps_the_keys_of_lowest_l2_norm_per_kv_head(decode):
    budget = 5
    kept = [set() for _ in range(N_KV)]
    for layer, seen, keys, _, q, prefill in _drive(f"knorm:budget={budget}:decode={decode}", TURN_PLAN):
        for h in range(N_KV):
            candidates = kept[h] | set(range(seen - q, seen))
            if len(candidates) > budget and (prefill or decode == "hold"):  # grow: only a prompt is compressed
                candidates = sorted(candidates, key=lambda p: (float(keys[h, p].norm()), -p))[:budget]
            kept[h] = set(candidates)
        assert _kept(layer) == kept, (seen, prefill)
    assert (layer.keys.shape[-2] > budget) == (decode == "grow")


@pytest.mark.check
@pytest.mark.parametrize(
    "family, spec, whole",
    [
        ("tiny-llama", "knorm", {0, 1}),
        ("tiny-llama", "knorm:skip=0", set()),
        ("tiny-gemma3", "knorm", set()),
        ("tiny-gemma3", "knorm:skip=3", {2}),
    ],
)
def test_knorm_leaves_the_global_layers_before_skip_whole(family, spec, whole):
    """`skip` counts decoder layers (the paper's layers 0 and 1); tiny-gemma3's global layers are 2 and 5."""
    cache = parse_spec(spec).build_cache(tiny(family).model)
    assert {i for i, layer in enumerate(cache.layers) if isinstance(layer, FullLayer)} == whole
    scored = [layer for layer in cache.layers if isinstance(layer, ScoredLayer)]
    assert [(layer.rank, layer.count) for layer in scored] == [(r, len(scored)) for r in range(len(scored))]


# --- PyramidKV's budgets -------------------------------------------------------------------------------------------


def _paper_budgets(budget, window, beta, count, seen):
    """Real-valued: beyond the window, the top layer keeps mean/beta, the bottom twice the mean less that (capped at
    the prompt, the official code's branch), the layers between on a straight line; a prompt shorter than
    max(budget, 2 x mean) gives every layer the uniform budget."""
    extra = budget - window
    if count == 1 or seen < max(budget, 2 * extra):
        return [budget] * count
    bottom = min(2 * extra - extra / beta, seen - window)
    top = 2 * extra - bottom
    return [window + bottom - r * (bottom - top) / (count - 1) for r in range(count)]


@pytest.mark.check
@pytest.mark.parametrize(
    "budget, window, beta, count, seen, exact",
    [
        (8, 2, 20, 4, 40, [14, 10, 6, 2]),
        (232, 32, 20, 5, 10_000, [422, 327, 232, 137, 42]),  # the official code's, where its integer steps are exact
        (6, 2, 20, 4, 9, [9, 7, 5, 3]),  # the bottom layer capped at the prompt beyond the window
        (8, 2, 20, 4, 11, [8, 8, 8, 8]),  # shorter than twice the mean beyond the window: uniform
        (64, 32, 20, 30, 5000, None),
        (64, 32, 20, 30, 70, None),
        (100, 32, 3, 7, 500, None),
        (9, 4, 20, 1, 500, [9]),
    ],
)
def test_pyramidkv_budgets_follow_the_papers_arithmetic_sequence_and_sum_to_the_uniform_total(
    budget, window, beta, count, seen, exact
):
    pyramid = parse_spec(f"pyramidkv:budget={budget}:window={window}:beta={beta}")
    got = list(pyramid.layer_budgets(count, seen))
    want = _paper_budgets(budget, window, beta, count, seen)
    assert all(abs(g - w) < 1 for g, w in zip(got, want)), (got, want)
    assert sum(got) == count * budget and got == sorted(got, reverse=True)
    assert exact is None or got == exact
    if (budget, count, seen) == (64, 30, 5000):
        assert (got[0], got[-1]) == (94, 34)  # 32 + (64 - 1.6) and 32 + 1.6, rounded


@pytest.mark.check
@pytest.mark.parametrize("decode", ["grow", "hold"])
def test_each_pyramidkv_layer_keeps_snapkvs_choice_at_its_own_budget(decode):
    """PyramidKV reuses SnapKV's scoring (hand-checked in test_eviction.py) with its layer's budget."""
    plan, count = [[30, 1, 1, 1], [6, 1, 1, 1]], 4
    settings = f"window=2:kernel=3:decode={decode}"
    pyramid = parse_spec(f"pyramidkv:budget=8:beta=2:{settings}")
    assert pyramid.layer_budgets(count, 30) == (11, 9, 7, 5)  # 2 + (9, 7, 5, 3)
    for rank, budget in enumerate(pyramid.layer_budgets(count, 30)):
        ours = _drive(pyramid.spec(), plan, rank=rank, count=count)
        for (layer, seen, *_), (snap, *_) in zip(ours, _drive(f"snapkv:budget={budget}:{settings}", plan)):
            assert _kept(layer) == _kept(snap), (rank, seen)
            assert layer.keys.shape[-2] <= budget or decode == "grow"


# --- through the engine: each layer its own count, bytes by formula, both kernel modes, batched and alone ---------

SPECS = (
    "pyramidkv:budget=8:window=2",
    "pyramidkv:budget=6:window=2:beta=2:decode=hold",
    "knorm:budget=6",
    "knorm:budget=5:skip=0:decode=grow",
)
SAME = ("token_ids", "teacher_forced_agreement", "max_abs_dlogit", "kl_mean")


@pytest.mark.parametrize("kernels", ["invariant", "native"])
def test_each_layer_holds_its_own_budget_the_first_holds_the_most_and_bytes_match_the_formula(kernels):
    loaded = tiny("tiny-llama")
    results, pyramids = [], 0
    for batch in (True, False):
        engine = Engine(loaded, parse_specs(",".join(SPECS)), max_new_tokens=6, threads=1, kernels=kernels, batch=batch)
        assert engine.kernels.mode == kernels
        for event in engine.run(TURNS):
            if event["type"] not in ("step", "turn_end"):
                continue
            for lane in engine.lanes:
                strategy, seen = lane.strategy, lane.cache.get_seq_length()
                layers = [layer for layer in lane.cache.layers if not layer.is_sliding]
                held = [layer.keys.shape[-2] for layer in layers]
                assert held == sorted(held, reverse=True), lane.label  # the first global layer sizes the mask
                pyramids += len(set(held)) > 1 and strategy.name == "pyramidkv"
                for layer in layers:
                    if not isinstance(layer, ScoredLayer):
                        assert layer.keys.shape[-2] == seen, lane.label  # skipped: kept whole
                        continue
                    formula = strategy.stored(seen, lane.forwards, layer.count)
                    assert layer.keys.shape[-2] == per_layer(formula, layer.rank), lane.label
                    if strategy.holds(False):
                        assert layer.keys.shape[-2] <= per_layer(strategy.layer_budgets(layer.count, seen), layer.rank)
        results.append(engine.results()["strategies"])
    assert pyramids  # the pyramid was there, not only uniform budgets
    batched, alone = results
    for spec in SPECS:
        assert batched[spec]["state_bytes"]["formula_matches_measurement"], spec
        assert batched[spec]["state_bytes"]["peak"] >= batched[spec]["state_bytes"]["formula_peak"], spec
        assert {k: batched[spec][k] for k in SAME} == {k: alone[spec][k] for k in SAME}, spec
        assert batched[spec]["state_bytes"]["final_persistent"] == alone[spec]["state_bytes"]["final_persistent"]


# --- a prefill chunk after eviction ----------------------------------------------------------------------------------

EXPECTED = "kvdirect_test_expected_mask"
CAUSAL = ("pyramidkv:budget=8:window=2", "knorm:budget=5")
FIRST, CHUNK = list(range(40, 80)), [60, 61, 62, 63]
HELD = ([14, 10, 6, 2], [40, 40, 5, 5])  # PyramidKV's pyramid; KNorm's layers 0 and 1 whole


def _expected_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own (sdpa) attention with the mask a layer holding key.shape[-2] keys must get: every stored key
    visible, the chunk's own keys causal."""
    q, t = query.shape[-2], key.shape[-2]
    mask = torch.ones(q, t, dtype=torch.bool)
    mask[:, t - q :] = torch.tril(torch.ones(q, q, dtype=torch.bool))
    sdpa = compat.attention_function(module, "sdpa")
    return sdpa(module, query, key, value, mask.view(1, 1, q, t), **kwargs)


def _stored(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _expected_logits(model, stored) -> torch.Tensor:
    """The chunk's last logits over the same stored K/V in a DynamicCache, every layer with its own mask."""
    reference = DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(stored):
        reference.update(keys.clone(), values.clone(), i)
    compat.register_attention(EXPECTED, _expected_attention)
    start = len(FIRST)
    with compat.attention_implementation(model.config, EXPECTED):
        positions = torch.arange(start, start + len(CHUNK)).view(1, -1)
        return compat.forward_rows(model, torch.tensor([CHUNK]), reference, positions)[0]


@pytest.mark.parametrize("kernels", ["native", "invariant"])
def test_after_eviction_a_prefill_chunk_sees_every_stored_token_of_its_layer_and_is_causal(kernels):
    """Through the engine's pass (`lockstep.run_batch`), batched and alone: the chunk's logits equal those of the
    same stored K/V in a DynamicCache whose every layer gets its own mask."""
    loaded = tiny("tiny-llama")
    model = loaded.model
    run = Kernels.for_model(loaded, kernels, threads=1)
    assert run.mode == kernels
    tap, observer = InputTap(model, CPU), Observer(CPU)
    caches = [parse_spec(spec).build_cache(model) for spec in CAUSAL]
    try:
        with torch.inference_mode(), threads_set(1):
            run_batch(
                model,
                [Row(Owner(spec, "lane"), cache, FIRST) for spec, cache in zip(CAUSAL, caches)],
                observer,
                tap,
                CPU,
                run,
            )
            for cache in caches:
                cache.end_turn()  # the chunk is the next turn's prompt
            stored = [_stored(cache) for cache in caches]
            assert [[k.shape[-2] for k, _ in layers] for layers in stored] == list(HELD)
            if kernels == "native":  # the mask the model builds for the cache, fitted to each layer
                mask = create_causal_mask(
                    config=model.config,
                    inputs_embeds=torch.zeros(1, 4, 1),
                    attention_mask=None,
                    cache=caches[0],
                    position_ids=None,
                    allow_is_causal_skip=False,
                )
                for keys, _ in stored[0]:
                    t = keys.shape[-2] + 4
                    expected = torch.ones(4, t, dtype=torch.bool)
                    expected[:, t - 4 :] = torch.tril(torch.ones(4, 4, dtype=torch.bool))
                    assert torch.equal(fit_mask(mask, t)[0, 0].bool(), expected)
            alone = [cache.fork() for cache in caches]
            rows = [Row(Owner(spec, "lane"), cache, CHUNK, len(FIRST)) for spec, cache in zip(CAUSAL, caches)]
            run_batch(model, rows, observer, tap, CPU, run)
            singles = [Row(Owner(spec, "lane"), cache, CHUNK, len(FIRST)) for spec, cache in zip(CAUSAL, alone)]
            for row in singles:
                run_batch(model, [row], observer, tap, CPU, run)
            tap.clear()  # the reference's forwards feed none of the caches
            for spec, layers, row, single in zip(CAUSAL, stored, rows, singles):
                want = _expected_logits(model, layers)
                for got in (row.logits, single.logits):
                    if kernels == "native":
                        assert torch.equal(got, want), spec
                    else:  # the block attention's sums differ from SDPA's in the last bits, never by a token seen
                        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        tap.close()


def test_inside_strategy_cache_a_prefill_chunk_after_eviction_is_causal_per_layer():
    """The model's own forward and attention (`strategy_cache`, sdpa): the input tap fits the mask to each layer."""
    model = tiny("tiny-llama").model
    for spec, held in zip(CAUSAL, HELD):
        with strategy_cache(model, spec) as cache, torch.inference_mode():
            model(input_ids=torch.tensor([FIRST]), cache=cache)
            stored = _stored(cache)
            assert [k.shape[-2] for k, _ in stored] == held
            got = compat.forward_step(model, torch.tensor([CHUNK]), cache)
            assert torch.equal(got, _expected_logits(model, stored)), spec
