"""Lanes in one batched pass per step give the same bits as lanes one after another.

Every lane's and every teacher-forced twin's logits are compared with
`torch.equal` after every step; tokens, K/V reports and measured state bytes
must be identical too.  Then: prompts fed in pieces, incremental reply text,
and runs without teacher-forced twins.
"""

import pytest
import torch

from kvdirect_app.engine.runner import Engine
from kvdirect_app.kernels.invariant import Kernels
from kvdirect_app.plain.text import ReplyText
from kvdirect_app.strategies import parse_specs
from kvdirect_app.strategies.scored import ScoredLayer
from kvdirect_app.strategies.scored_attention import QueryProjector

from ..runs import LOCKSTEP, TINY_FAMILIES, TINY_TURNS, _run, all_sliding, one_by_one, run_once, tiny, tiny_union

SAME = (
    "token_ids",
    "kv_exact",
    "max_abs_dk",
    "max_abs_dv",
    "max_abs_dlogit",
    "kl_mean",
    "teacher_forced_agreement",
    "rebuilt_token_layers",
)


def assert_same_bits(batched_run, specs=LOCKSTEP):
    """Lanes one after another (a run of `specs` alone, `batch=False`) against the same lanes in a batched run
    (which may hold more lanes: a lane's bits do not depend on who else is in the batch)."""
    one_run = one_by_one(batched_run, specs)
    one, batched = one_run.result, batched_run.result
    assert batched["batched"] and not one["batched"]
    assert one_run.kinds == batched_run.kinds and len(one_run.steps) == len(batched_run.steps) > 4
    for a, b in zip(one_run.steps, batched_run.steps):
        assert set(a) <= set(b)
        for label, (logits, twin) in a.items():
            logits_b, twin_b = b[label]
            assert torch.equal(logits, logits_b), label
            assert (twin is None) == (twin_b is None) and (twin is None or torch.equal(twin, twin_b)), label
    for label, r in one["strategies"].items():
        rb = batched["strategies"][label]
        assert {k: r[k] for k in SAME} == {k: rb[k] for k in SAME}, label
        for key in ("persistent_peak", "between_turns_peak", "final_persistent", "formula_matches_measurement"):
            assert r["state_bytes"][key] == rb["state_bytes"][key], (label, key)
        assert rb["state_bytes"]["formula_matches_measurement"], label
    return one, batched


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_batched_lanes_give_the_same_bits_as_lanes_one_after_another(family):
    run = tiny_union(family)
    loaded = run.engine.loaded
    one, batched = assert_same_bits(run)
    # Some lanes diverged, so twins ran in the batch too (not on a model whose every layer slides: its window
    # holds what every strategy's budget does).
    assert any(r["first_divergence"] is not None for r in batched["strategies"].values()) != all_sliding(loaded)
    assert (
        batched["shared_pass_ms_mean"] is not None
        and batched["strategies"]["full"]["latency_ms"]["decode_shared_ms_mean"]
    )


@pytest.mark.parametrize("dtype", ["bfloat16"])
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_batched_lanes_in_bf16(family, dtype):
    assert_same_bits(tiny_union(family, dtype))


def test_batched_lanes_on_smollm2(smollm2):
    specs = "full,kvdirect:budget=16,anchorkv:spacing=30:budget=16,h2o:budget=16,snapkv:budget=16,tova:budget=16"
    batched_run = run_once(smollm2, specs, ["What is the capital of France?"], 8, steps=True, threads=1)
    one, batched = assert_same_bits(batched_run, specs)
    assert batched["strategies"]["kvdirect:budget=16"]["kv_exact"] is True


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma2"])
def test_a_decode_layers_attention_in_one_call_gives_each_lane_the_bits_of_its_own_call(family, monkeypatch):
    """Every built-in strategy and one from a file: a decode step's attention at a layer in one call for every lane
    and twin (`lockstep._decode_in_one_call`) against each lane's own call (the path prompts take), the same
    logits at every step, tokens, K/V and bytes; and each lane's attention is still its own part of the time."""
    specs = ",".join((*LOCKSTEP, "examples/random_eviction.py:RandomEviction:budget=6"))
    calls = []
    in_one_call = Kernels.attention_lanes

    def counted(self, query, *args, **kwargs):
        calls.append(query.shape[0])
        return in_one_call(self, query, *args, **kwargs)

    def run():
        return _run(tiny(family), specs, list(TINY_TURNS), 8, False, True, True, {"memory": "trace", "threads": 1})

    monkeypatch.setattr(Kernels, "attention_lanes", counted)
    batched = run()
    assert max(calls) >= len(LOCKSTEP) + 1  # every lane's decode attention at a layer went through one call
    monkeypatch.setattr(Kernels, "lanes_in_one_call", property(lambda self: False))
    calls.clear()
    alone = run()
    assert not calls
    assert len(alone.steps) == len(batched.steps) > 4
    for a, b in zip(alone.steps, batched.steps):
        assert a.keys() == b.keys()
        for label, (logits, twin) in a.items():
            assert torch.equal(logits, b[label][0]), label
            assert (twin is None) == (b[label][1] is None) and (twin is None or torch.equal(twin, b[label][1])), label
    for label, r in alone.result["strategies"].items():
        rb = batched.result["strategies"][label]
        assert {k: r[k] for k in SAME} == {k: rb[k] for k in SAME}, label
        # Every figure of the bytes but Python's buffers (`outside_torch`): those a process's first run holds more
        # of (caches filled once per process inside a lane's work), whichever path runs first.
        assert {**r["state_bytes"], "outside_torch": None} == {**rb["state_bytes"], "outside_torch": None}, label
        assert rb["latency_ms"]["decode_attention_ms_mean"] > 0, label


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_scorer_in_a_pass_is_handed_the_queries_it_would_rebuild(family, monkeypatch):
    """H2O, TOVA and SnapKV and their twins, in a batched pass with rows at different positions (lanes that evict
    hold fewer tokens, twins follow other tokens): each is handed its row's queries as the pass computed them
    (`lockstep._settle`), at every prompt and decode step, bit-equal to rebuilding them from its attention input
    (q_proj, the family's norm, RoPE at the row's positions), and no scorer rebuilds one.  Mutation: a row handed
    its neighbour's queries fails."""
    checked, rebuilt = [], []
    settle, queries = ScoredLayer.settle, QueryProjector.queries

    def checked_settle(self, given=None):
        if given is not None:
            q = self.adding[-1]
            want = queries(self.projector, self.pending[:, -q:], self.seen - q)
            assert torch.equal(given, want), (self.strategy.label, self.seen, q)
            checked.append((self.strategy.name, q))
        return settle(self, given)

    monkeypatch.setattr(ScoredLayer, "settle", checked_settle)
    monkeypatch.setattr(QueryProjector, "queries", lambda self, *a: rebuilt.append(a) or queries(self, *a))
    loaded = tiny(family)
    specs = "full,h2o:budget=4,tova:budget=4,snapkv:budget=4"
    result = _run(loaded, specs, list(TINY_TURNS), 6, False, True, True, {"threads": 1}).result
    assert not rebuilt
    if all_sliding(loaded):  # no layer evicts
        assert not checked
        return
    assert result["strategies"]["h2o:budget=4"]["first_divergence"] is not None  # twins were in the passes
    assert {name for name, _ in checked} == {"h2o", "tova", "snapkv"}
    assert {q for _, q in checked if q == 1} and {q for _, q in checked if q > 1}


def test_a_long_prompt_is_fed_in_pieces_the_same_for_every_lane():
    loaded = tiny("tiny-llama")
    prompt = "A long message about caches and residual streams. " * 3
    batched_run = run_once(loaded, LOCKSTEP, [prompt, "Summarise."], 8, steps=True, threads=1, prefill_chunk=40)
    one, batched = assert_same_bits(batched_run)
    engine = Engine(loaded, parse_specs("full,kvdirect:budget=4"), max_new_tokens=3, prefill_chunk=40)
    events = list(engine.run([prompt]))
    progress = [e for e in events if e["type"] == "prefill"]
    assert [e["done"] for e in progress] == [min(40 * (i + 1), progress[0]["total"]) for i in range(len(progress))]
    assert progress[-1]["done"] == progress[-1]["total"] == len(engine.prompt_ids) > 80
    r = events[-1]["result"]["strategies"]["kvdirect:budget=4"]
    assert r["kv_exact"] and r["rebuilt_token_layers"] > 0 and r["latency_ms"]["ttft_ms"] > 0


def test_without_twins_agreement_stops_at_the_first_divergence():
    result = run_once(tiny("tiny-llama"), "full,window:budget=4", TINY_TURNS[:2], 8, twins=False).result
    r = result["strategies"]["window:budget=4"]
    assert result["teacher_forced_twins"] is False
    assert r["first_divergence"] is not None
    assert r["teacher_forced_steps"] <= r["first_divergence"] + 1


class _Bytes:
    """A byte-level tokenizer: decoding a prefix of a multi-byte character gives U+FFFD."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["plain words", "é à ü", "数字 and 🙂 mixed", "ǅ🙂🙂é"])
def test_reply_text_streams_without_broken_characters_and_ends_as_the_full_decode(text):
    reply = ReplyText(_Bytes())
    seen = []
    for b in text.encode("utf-8"):
        seen.append(reply.add(b))
    assert all("\ufffd" not in s for s in seen)
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))  # only ever grows
    assert seen[-1] == text == reply.final()
