"""Eviction baselines: window, StreamingLLM, H2O, SnapKV, TOVA (KNorm and PyramidKV: test_knorm_pyramidkv.py).

Four layers of checks: a budget larger than the conversation changes nothing
(tiny models of several families); a small budget is never exceeded and the
mask stays right after eviction; each scoring rule keeps the tokens its paper
says it keeps (hand-built tensors against small references written here from
the papers' definitions); settings and the sweep CLI.
"""

import json
import math

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from kvdirect_app import bench
from kvdirect_app.engine.runner import Engine, InputTap, run_to_end
from kvdirect_app.models import compat
from kvdirect_app.strategies import parse_spec, parse_specs
from kvdirect_app.strategies.scored import ScoredLayer, keep_top, take
from kvdirect_app.strategies.scored_attention import attention_probs

from ..conftest import bad_spec_error
from ..runs import LARGE_BUDGET, tiny, tiny_union
from ..specs import EVICTION

TURNS = ["Tell me about caches.", "Why do keys need positions?", "Summarise."]


THREADS = 1  # tiny matrices: a second thread only adds overhead (and stalls on a busy machine)


def _run(loaded, specs, max_new=10, turns=TURNS):
    return run_to_end(Engine(loaded, parse_specs(specs), max_new_tokens=max_new, threads=THREADS), turns)


def _global_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, ScoredLayer)]


# --- a budget larger than the conversation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "family", ["tiny-llama", "tiny-qwen3", "tiny-olmo2", "tiny-gemma2", "tiny-gemma3", "tiny-mistral"]
)
def test_a_budget_larger_than_the_conversation_gives_the_full_caches_tokens(family):
    result = tiny_union(family).result  # its eviction lanes at budget 400
    ref = result["strategies"]["full"]
    seen = len(result["prompt_ids"]) + sum(len(c) for c in result["turn_chunk_ids"][1:]) + len(ref["token_ids"])
    assert 12 < seen < 400  # crosses the sliding window, stays inside the budget
    assert LARGE_BUDGET == tuple(f"{name}:budget=400" for name in EVICTION)
    for name in EVICTION:
        r = result["strategies"][f"{name}:budget=400"]
        assert r["token_ids"] == ref["token_ids"], name
        assert r["token_match"] == 1.0 and r["first_divergence"] is None, name
        assert r["max_abs_dlogit"] == 0.0, name
        assert r["kv_exact"] is None and r["layers_compared"] == 0, name  # eviction caches do not compare K/V
        assert r["claims_exact"] is False, name
        assert r["state_bytes"]["formula_matches_measurement"], name
        assert r["state_bytes"]["peak"] >= r["state_bytes"]["formula_peak"], name


# --- a small budget ---------------------------------------------------------------------------------------------

SMALL = [
    "window:budget=6",
    "streaming_llm:budget=6:sinks=2",
    "h2o:budget=6",
    "h2o:budget=6:recent=0",
    "snapkv:budget=6:window=2:kernel=3:decode=hold",
    "snapkv:budget=6:window=3:kernel=1:pooling=max:decode=hold",
    "tova:budget=6",
    "knorm:budget=6",
    "knorm:budget=6:skip=0",
]


@pytest.mark.parametrize(
    "family, dtype",
    [("tiny-llama", "float32"), ("tiny-qwen3", "bfloat16"), ("tiny-gemma3", "float32"), ("tiny-gemma2", "float32")],
)
def test_a_small_budget_is_never_exceeded_and_bytes_match_the_formula(family, dtype, monkeypatch):
    budget = 6
    forwards = []
    original = ScoredLayer.settle

    def checked_settle(self, *args, **kwargs):  # `update`'s second half, or the pass's `settle(queries)`
        candidates = self.adding[0].shape[-2]
        original(self, *args, **kwargs)
        stored = self.keys.shape[-2]
        assert stored == min(self.seen, budget) and self.positions.shape[-1] == stored
        assert candidates >= stored  # attention saw everything stored plus the new tokens
        forwards.append(stored)

    monkeypatch.setattr(ScoredLayer, "settle", checked_settle)
    loaded = tiny(family, dtype)
    engine = Engine(loaded, parse_specs(",".join(SMALL)), max_new_tokens=8, threads=THREADS)
    for event in engine.run(TURNS):
        if event["type"] not in ("step", "turn_end"):
            continue
        for lane in engine.lanes:
            for cache in (lane.cache, lane.tf_cache):
                if cache is None:
                    continue
                layers = _global_layers(cache)
                assert layers
                # The mask is built once per layer type: every global layer must report the same sizes.
                for q in (1, 7):
                    assert len({layer.get_mask_sizes(q) for layer in layers}) == 1, lane.label
                seen = cache.get_seq_length()
                for layer in layers:
                    states = layer.token_states()
                    assert len(states) == seen
                    rows = layer.keys.shape[1] if layer.strategy.per_head else 1
                    assert min(seen, budget) <= states.count("kv") <= min(seen, budget * rows)
    assert forwards and max(forwards) == budget
    result = engine.results()
    for spec in SMALL:
        r = result["strategies"][spec]
        assert r["state_bytes"]["formula_matches_measurement"], spec
        assert r["state_bytes"]["peak"] >= r["state_bytes"]["formula_peak"], spec
        assert r["kv_exact"] is None, spec
    # Six tokens of a three-turn conversation is lossy for at least one of them.
    assert min(result["strategies"][s]["teacher_forced_agreement"] for s in SMALL) < 1.0


def test_after_eviction_a_prefill_chunk_is_causal_and_sees_every_stored_token():
    loaded = tiny("tiny-llama")
    model, budget = loaded.model, 5
    cache = parse_spec(f"window:budget={budget}").build_cache(model)
    first = torch.arange(40, 52).view(1, -1)
    chunk = torch.arange(60, 64).view(1, -1)
    with torch.inference_mode():
        compat.forward_step(model, first, cache)
        embeds = torch.zeros(1, chunk.shape[1], model.config.hidden_size)
        mask = create_causal_mask(
            config=model.config,
            inputs_embeds=embeds,
            attention_mask=None,
            cache=cache,
            position_ids=None,
            allow_is_causal_skip=False,
        )
        expected = torch.ones(4, budget + 4, dtype=torch.bool)
        expected[:, budget:] = torch.tril(torch.ones(4, 4, dtype=torch.bool))
        assert torch.equal(mask[0, 0].bool(), expected)

        # End to end: the same stored K/V in a plain DynamicCache, with an explicit mask and the original
        # positions, must give the same logits as the eviction cache.
        reference = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):
            reference.update(layer.keys.clone(), layer.values.clone(), i)
        seen = cache.get_seq_length()
        positions = torch.arange(seen, seen + chunk.shape[1]).view(1, -1)
        want = model(
            input_ids=chunk, cache=reference, position_ids=positions, attention_mask=expected.view(1, 1, 4, budget + 4)
        ).logits
        got = model(input_ids=chunk, cache=cache).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "family", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-olmo2", "tiny-gemma2", "tiny-gemma3"]
)
def test_rebuilt_attention_weights_equal_transformers_eager_attention(family):
    """H2O's accumulated attention, before and after an eviction, against the model's own eager weights
    (queries rebuilt with q_norm and RoPE, module scaling, Gemma 2 soft-capping, grouped heads averaged)."""
    loaded = tiny(family)
    model, budget = loaded.model, 8
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    tap = InputTap(model, torch.device("cpu"))
    try:
        cache = parse_spec(f"h2o:budget={budget}:recent=2").build_cache(model)
        tap.target(cache)
        layers = {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, ScoredLayer)}
        with torch.inference_mode():
            model(input_ids=torch.arange(30, 47).view(1, -1), cache=cache)
            before = {
                i: (layer.positions[0].clone(), layer.buffers["accumulated"][0].clone()) for i, layer in layers.items()
            }
            out = model(input_ids=torch.arange(60, 63).view(1, -1), cache=cache, output_attentions=True)
    finally:
        tap.close()
        model.set_attn_implementation(previous)
    for i, layer in layers.items():
        positions, accumulated = before[i]
        n_kv = layer.keys.shape[1]
        weights = out.attentions[i][0].float()  # (H, 3, budget + 3) over each KV head's stored keys, then the chunk
        assert weights.shape[-1] == budget + 3
        step = weights.sum(dim=1).view(n_kv, -1, budget + 3).mean(dim=1)  # (n_kv, budget + 3)
        for h in range(n_kv):
            columns = positions[h % positions.shape[0]].tolist() + [17, 18, 19]
            old = dict(zip(positions[h % positions.shape[0]].tolist(), accumulated[h].tolist()))
            want = {p: old.get(p, 0.0) + float(w) for p, w in zip(columns, step[h])}
            got = dict(zip(layer.positions[0, h].tolist(), layer.buffers["accumulated"][0, h].tolist()))
            assert got and all(got[p] == pytest.approx(want[p], abs=1e-5) for p in got), (family, i, h)


# --- scoring rules on hand-built tensors -------------------------------------------------------------------------

N_KV, GROUPS, D_H = 2, 2, 8
HEADS = N_KV * GROUPS


class Queries:
    """A projector whose attention input *is* the queries: (1, n, HEADS * D_H) -> (1, HEADS, n, D_H)."""

    def __init__(self, scaling=D_H**-0.5, softcap=None):
        self.scaling, self.softcap = scaling, softcap

    def queries(self, x, start):
        return x.view(1, x.shape[1], HEADS, D_H).transpose(1, 2)


def _drive(spec, chunks, projector=None, seed=0, rank=0, count=1):
    """Feed turns of new tokens (a list of turns, each a list of step sizes: the prefill chunk then 1s) to one
    global layer (`rank` of `count`, for strategies whose budget differs per layer).

    Yields after every step: (layer, seen, keys_by_position (n_kv, seen, d_h), queries (HEADS, seen, d_h), step q,
    prefill flag).
    """
    gen = torch.Generator().manual_seed(seed)
    strategy = parse_spec(spec)
    layer = strategy.global_layer(projector or Queries(), rank, count)
    all_k = torch.randn(N_KV, 200, D_H, generator=gen)
    all_q = torch.randn(HEADS, 200, D_H, generator=gen) * 2.0
    seen = 0
    for turn in chunks:
        for i, q in enumerate(turn):
            k = all_k[:, seen : seen + q].unsqueeze(0)
            if hasattr(layer, "capture"):
                layer.capture(all_q[:, seen : seen + q].transpose(0, 1).reshape(1, q, HEADS * D_H))
            layer.update(k, torch.randn(1, N_KV, q, D_H, generator=gen))
            seen += q
            yield layer, seen, all_k[:, :seen], all_q[:, :seen], q, i == 0
        layer.end_turn()


def test_the_pass_splits_an_update_only_where_a_layer_takes_queries():
    """The engine's pass calls `add`, then `settle(queries)` where a layer takes the pass's queries: one that scores
    with attention (H2O), not one that reads none (StreamingLLM) nor a subclass that overrides `update` (it is
    called through it).  A second `add` before `settle` is refused, naming the strategy."""
    layer = parse_spec("h2o:budget=4").global_layer(Queries())
    assert layer.takes_queries and not parse_spec("streaming_llm:budget=4").global_layer().takes_queries

    class Own(type(layer)):
        def update(self, *args, **kwargs):
            return super().update(*args, **kwargs)

    assert not Own(layer.strategy, layer.projector).takes_queries
    k = torch.randn(1, N_KV, 1, D_H)
    layer.add(k, k)
    with pytest.raises(RuntimeError, match="h2o: a forward's tokens were added before the last was settled"):
        layer.add(k, k)


def _kept(layer):
    """Kept positions per selection row, as sets."""
    return [set(row.tolist()) for row in layer.positions[0]]


def _softmax_over(query, keys_by_pos, candidates, scaling, softcap=None):
    """Plain softmax of one query over the candidate positions (a dict position -> weight)."""
    logits = [float(query @ keys_by_pos[p]) * scaling for p in candidates]
    if softcap is not None:
        logits = [math.tanh(x / softcap) * softcap for x in logits]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return {p: e / total for p, e in zip(candidates, exps)}


TURN_PLAN = [[9, 1, 1, 1, 1], [5, 1, 1, 1], [2, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("rows", [1, 3], ids=["per-layer", "per-head"])
def test_the_kept_candidates_are_what_a_gather_takes(rows):
    """`take` (one index_select) against the gather it stands for, with ties and protected tokens among the scores;
    a mutation that takes one head's choice for every head (rows[0] for all) fails the per-head case."""
    gen = torch.Generator().manual_seed(rows)
    keys = torch.randn(1, 3, 40, 8, generator=gen)
    scores = torch.randint(0, 5, (1, rows, 40), generator=gen).float()
    scores[..., -3:] = math.inf
    keep = keep_top(scores, 17)
    index = keep.unsqueeze(-1).expand(1, 3, -1, 8)
    assert torch.equal(take(keys, keep), keys.gather(2, index))
    assert rows == 1 or not torch.equal(keep[0, 0], keep[0, 1])  # the heads chose apart


def test_one_over_the_budget_drops_what_the_sort_drops():
    """`keep_top`'s decode case (T = budget + 1: argmin) against its sort, over scores full of ties, protected and
    -inf tokens, per layer and per head; a mutation dropping the newest of a tie, or keeping the dropped one, fails."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        rows, t = (1, 3)[trial % 2], 2 + trial % 40
        scores = torch.randint(0, 3 + trial % 5, (1, rows, t), generator=gen).float()
        scores[scores == 0] = -math.inf if trial % 3 == 0 else 0.0
        scores[scores == 1] = math.inf if trial % 4 == 0 else 1.0
        budget = t - 1
        newest_first = scores.flip(-1)
        order = torch.sort(newest_first, dim=-1, descending=True, stable=True).indices[..., :budget]
        want = (t - 1 - order).sort(dim=-1).values
        got = keep_top(scores, budget)
        assert got.dtype == want.dtype and torch.equal(got, want), (trial, scores)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_one_query_over_keys_before_it_needs_no_mask(softcap):
    """`attention_probs(causal=False)` (a scorer's one query over its candidates, all at or before it): the bits of
    the masked call, for scattered kept positions and grouped heads; with a key after the query it would differ,
    which is why only a caller that knows the positions says so."""
    gen = torch.Generator().manual_seed(3)
    queries, keys = torch.randn(1, 6, 1, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen)
    positions = torch.tensor([0, 1, 4, 5, 9, 12, 13, 17, 20], dtype=torch.int32).expand(1, 2, 9)
    at = torch.tensor([20])
    masked = attention_probs(queries, keys, at, positions, 0.35, softcap)
    assert torch.equal(attention_probs(queries, keys, at, positions, 0.35, softcap, causal=False), masked)
    early = torch.tensor([13])
    assert not torch.equal(
        attention_probs(queries, keys, early, positions, 0.35, softcap, causal=False),
        attention_probs(queries, keys, early, positions, 0.35, softcap),
    )


def test_window_keeps_the_last_budget_tokens():
    for layer, seen, *_ in _drive("window:budget=6", TURN_PLAN):
        assert _kept(layer) == [set(range(max(0, seen - 6), seen))]


def test_streaming_llm_keeps_the_sinks_and_the_most_recent_tokens():
    for layer, seen, *_ in _drive("streaming_llm:budget=6:sinks=2", TURN_PLAN):
        expected = set(range(seen)) if seen <= 6 else {0, 1} | set(range(seen - 4, seen))
        assert _kept(layer) == [expected]


@pytest.mark.parametrize("recent", [3, 0, 6])
def test_h2o_keeps_heavy_hitters_by_accumulated_attention_and_a_recent_window(recent):
    budget = 6
    scaling = D_H**-0.5
    kept = [set() for _ in range(N_KV)]
    accumulated = [dict() for _ in range(N_KV)]
    for layer, seen, keys, queries, q, _ in _drive(f"h2o:budget={budget}:recent={recent}", TURN_PLAN):
        new = list(range(seen - q, seen))
        for h in range(N_KV):
            candidates = sorted(kept[h] | set(new))
            for p in new:
                accumulated[h][p] = 0.0
            keys_by_pos = {p: keys[h, p] for p in candidates}
            for p_query in new:  # every query of the step adds its attention; heads of a group are averaged
                visible = [p for p in candidates if p <= p_query]
                for j in range(h * GROUPS, (h + 1) * GROUPS):
                    for p, w in _softmax_over(queries[j, p_query], keys_by_pos, visible, scaling).items():
                        accumulated[h][p] += w / GROUPS
            if len(candidates) > budget:
                recent_set = set(candidates[len(candidates) - recent :]) if recent else set()
                rest = [p for p in candidates if p not in recent_set]
                heavy = sorted(rest, key=lambda p: (accumulated[h][p], p), reverse=True)[: budget - recent]
                candidates = sorted(recent_set | set(heavy))
            kept[h] = set(candidates)
            accumulated[h] = {p: accumulated[h][p] for p in candidates}
        assert _kept(layer) == kept
        for h in range(N_KV):
            got = dict(zip(layer.positions[0, h].tolist(), layer.buffers["accumulated"][0, h].tolist()))
            assert got == pytest.approx(accumulated[h], rel=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_tova_evicts_the_token_the_current_query_attends_least_averaged_over_heads(softcap):
    budget = 6
    scaling = D_H**-0.5
    kept = set()
    for layer, seen, keys, queries, q, _ in _drive(f"tova:budget={budget}", TURN_PLAN, Queries(scaling, softcap)):
        candidates = sorted(kept | set(range(seen - q, seen)))
        if len(candidates) > budget:
            last = seen - 1
            mean = {p: 0.0 for p in candidates}
            for j in range(HEADS):
                keys_by_pos = {p: keys[j // GROUPS, p] for p in candidates}
                for p, w in _softmax_over(queries[j, last], keys_by_pos, candidates, scaling, softcap).items():
                    mean[p] += w / HEADS
            candidates = sorted(sorted(candidates, key=lambda p: (mean[p], p), reverse=True)[:budget])
        kept = set(candidates)
        assert _kept(layer) == [kept]


def _pool(values, kernel, how):
    """1-D pooling, stride 1, zero padding of kernel // 2 (max ignores the padding, avg divides by kernel)."""
    half, out = kernel // 2, []
    for i in range(len(values)):
        span = values[max(0, i - half) : i + half + 1]
        out.append(max(span) if how == "max" else sum(span) / kernel)
    return out


@pytest.mark.parametrize(
    "window, kernel, pooling, decode",
    [(2, 3, "max", "hold"), (3, 5, "avg", "grow"), (4, 1, "max", "grow"), (3, 3, "avg", "hold")],
)
def test_snapkv_keeps_the_pooled_votes_of_the_observation_window(window, kernel, pooling, decode):
    budget = 7
    scaling = D_H**-0.5
    kept = [set() for _ in range(N_KV)]
    selected_before = 0
    plan = [[12, 1, 1, 1], [6, 1, 1, 1, 1, 1], [1, 1, 1]]
    spec = f"snapkv:budget={budget}:window={window}:kernel={kernel}:pooling={pooling}:decode={decode}"
    for layer, seen, keys, queries, q, prefill in _drive(spec, plan):
        new = list(range(seen - q, seen))
        if prefill:
            selected_before = seen - window
        for h in range(N_KV):
            candidates = sorted(kept[h] | set(new))
            if len(candidates) <= budget or (not prefill and decode == "grow"):
                kept[h] = set(candidates)  # the paper: nothing is evicted while decoding
                continue
            if prefill:
                observers = new[-min(window, q) :]
                prefix, observed = candidates[:-window], candidates[-window:]
                keys_by_pos = {p: keys[h, p] for p in candidates}
                pooled = {p: 0.0 for p in prefix}
                for j in range(h * GROUPS, (h + 1) * GROUPS):  # pool per query head, then average the group
                    votes = {p: 0.0 for p in candidates}
                    for p_query in observers:
                        visible = [p for p in candidates if p <= p_query]
                        for p, w in _softmax_over(queries[j, p_query], keys_by_pos, visible, scaling).items():
                            votes[p] += w
                    for p, v in zip(prefix, _pool([votes[p] for p in prefix], kernel, pooling)):
                        pooled[p] += v / GROUPS
                chosen = sorted(prefix, key=lambda p: (pooled[p], p), reverse=True)[: budget - window]
                kept[h] = set(chosen) | set(observed)
            else:
                # Holding the budget while decoding: the last prompt's choice stays; the newest fill the rest.
                chosen = [p for p in candidates if p < selected_before]
                kept[h] = set(chosen) | set(candidates[len(candidates) - (budget - len(chosen)) :])
        assert _kept(layer) == kept, (seen, prefill)
    if decode == "grow":
        assert layer.keys.shape[-2] > budget  # the last turn's decoded tokens were all kept


def test_snapkv_shrinks_a_window_that_does_not_fit_the_budget_and_says_so():
    small = parse_spec("snapkv:budget=16")
    assert small.observed == 8 and "observation window is 8" in small.notes[0]
    assert parse_spec("snapkv:budget=1").observed == 1
    assert parse_spec("snapkv").observed == 32 and parse_spec("snapkv").notes == []
    loaded = tiny("tiny-llama")
    result = _run(loaded, "full,snapkv:budget=3,snapkv:budget=16", max_new=4)
    assert result["strategies"]["snapkv:budget=16"]["notes"] == small.notes
    assert result["strategies"]["snapkv:budget=3"]["state_bytes"]["formula_matches_measurement"]


# --- settings and the sweep ---------------------------------------------------------------------------------------


@pytest.mark.check
@pytest.mark.parametrize(
    "text, words",
    [
        ("window:budget=0", "window: budget=0 must be >= 1"),
        ("tova:budget=-3", "tova: budget=-3 must be >= 1"),
        ("tova:sinks=4", "unknown setting 'sinks'; allowed: budget"),
        ("streaming_llm:sinks=-1", "streaming_llm: sinks=-1 must be >= 0"),
        ("h2o:budget=8:recent=9", "h2o: recent=9 must be between 0 and budget=8, or -1 (half the budget)"),
        ("h2o:recent=-2", "recent=-2 must be between 0 and budget=64"),
        ("h2o:budget=0", "h2o: budget=0 must be >= 1"),
        ("snapkv:kernel=4", "snapkv: kernel=4 must be an odd integer >= 1"),
        ("snapkv:kernel=0", "snapkv: kernel=0 must be an odd integer >= 1"),
        ("snapkv:window=0", "snapkv: window=0 must be >= 1"),
        ("snapkv:pooling=median", "snapkv: pooling='median' is not allowed; allowed: avg, max"),
        ("snapkv:decode=forever", "snapkv: decode='forever' is not allowed; allowed: grow, hold"),
        ("knorm:budget=0", "knorm: budget=0 must be >= 1"),
        ("knorm:skip=-1", "knorm: skip=-1 must be >= 0"),
        ("knorm:decode=forever", "knorm: decode='forever' is not allowed; allowed: grow, hold"),
        ("knorm:window=4", "knorm: unknown setting 'window'; allowed: budget, skip, decode"),
        ("pyramidkv:beta=0", "pyramidkv: beta=0 must be >= 1"),
        ("pyramidkv:beta=2.5", "pyramidkv: setting beta='2.5' is not a valid int"),
        ("pyramidkv:kernel=4", "pyramidkv: kernel=4 must be an odd integer >= 1"),
        ("pyramidkv:pooling=median", "pyramidkv: pooling='median' is not allowed; allowed: avg, max"),
    ],
)
def test_bad_settings_name_the_setting_and_its_allowed_values(text, words):
    assert words in bad_spec_error(text)


def test_defaults_are_the_papers():
    h2o, snap, sink = parse_spec("h2o:budget=10"), parse_spec("snapkv"), parse_spec("streaming_llm")
    assert h2o.recent_tokens == 5 and parse_spec("h2o:budget=10:recent=2").recent_tokens == 2
    assert (snap.budget, snap.window, snap.kernel, snap.pooling, snap.decode) == (64, 32, 5, "avg", "grow")
    assert sink.sinks == 4
    knorm, pyramid = parse_spec("knorm"), parse_spec("pyramidkv")
    assert (knorm.budget, knorm.skip, knorm.decode) == (64, 2, "hold")  # layers 0 and 1 whole, every step compressed
    assert (pyramid.budget, pyramid.window, pyramid.kernel, pyramid.pooling, pyramid.decode, pyramid.beta) == (
        64,
        32,
        5,
        "avg",
        "grow",
        20,
    )


def test_sweep_runs_every_strategy_at_every_budget_and_writes_every_row(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    code = bench.main(
        [
            "sweep",
            "--model",
            "tiny-llama",
            "--prompt",
            "Hello there, how are you today?",
            "--strategies",
            "window,h2o:recent=6,snapkv:window=4",
            "--budgets",
            "4,8",
            "--max-new-tokens",
            "5",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.read_text())
    got = {(r["strategy"], r["budget"]) for r in data["rows"]}
    assert got == {("window", 4), ("window", 8), ("h2o:recent=6", 8), ("snapkv:window=4", 4), ("snapkv:window=4", 8)}
    assert data["skipped"] == [
        {
            "strategy": "h2o:recent=6",
            "budget": 4,
            "reason": "h2o: recent=6 must be between 0 and budget=4, or -1 (half the budget)",
        }
    ]
    assert "note: skipping h2o:recent=6 at budget 4" in printed
    for r in data["rows"]:
        assert r["spec"] == f"{r['strategy']}:budget={r['budget']}"
        assert 0.0 <= r["token_match"] <= 1.0 and r["kl_mean"] >= 0.0
        assert r["state_bytes"]["formula_matches_measurement"]
    assert data["reference"]["token_ids"]
    assert "h2o:recent=6" in printed and "token match" in printed


def test_sweep_at_equal_memory_picks_for_each_strategy_the_probe_closest_to_the_exact_strategys_peak(tmp_path):
    from kvdirect_app.benchmarks.sweeps import GRID

    out = tmp_path / "equal.json"
    names = ["anchorkv:anchors=0:rebuild=step", "window", "streaming_llm:sinks=2"]
    code = bench.main(
        [
            "sweep",
            "--model",
            "tiny-llama",
            "--prompt",
            "Hello there, how are you today? " * 3,
            "--strategies",
            ",".join(names),
            "--budgets",
            "8",
            "--equal-memory",
            "--max-new-tokens",
            "4",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    target_run, probes = data["probes"][0], data["probes"][1:]
    # The default target: the measured peak of the first strategy that promises exact K/V, at the first budget.
    assert target_run["strategy"] == f"{names[0]}:budget=8"
    assert data["target_bytes"] == target_run["state_bytes"]["peak"] > 0
    assert [r["strategy"] for r in data["rows"]] == names
    for row in data["rows"]:
        mine = [p for p in probes if p["strategy"] == row["strategy"]]
        assert len(mine) >= 2 and all(p["budget"] in GRID for p in mine)  # a search, not one guess
        distance = [abs(p["state_bytes"]["peak"] - data["target_bytes"]) for p in mine]
        assert abs(row["state_bytes"]["peak"] - data["target_bytes"]) == min(distance)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--strategies", "window,nosuchstrategy"], "'nosuchstrategy' is not a registered strategy"),
        (["--strategies", "window:budget=4"], "sets budget itself"),
        (["--strategies", "full"], "has no budget setting"),
        (["--strategies", "h2o:recent=9"], "fits none of the budgets"),
        (["--budgets", "4,zero"], "--budgets: 'zero' is not a positive integer"),
    ],
)
def test_sweep_refuses_bad_input_with_one_line(args, words, capsys):
    code = bench.main(["sweep", "--model", "tiny-llama", "--prompt", "Hi", "--budgets", "4,8", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and err.count("\n") == 1


def test_sweep_skips_unknown_names_only_when_allowed(capsys):
    code = bench.main(
        [
            "sweep",
            "--model",
            "tiny-llama",
            "--prompt",
            "Hi",
            "--strategies",
            "nosuchstrategy,window",
            "--budgets",
            "4",
            "--max-new-tokens",
            "2",
            "--threads",
            "1",
            "--allow-missing",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "note: skipping nosuchstrategy: 'nosuchstrategy' is not a registered strategy" in printed
