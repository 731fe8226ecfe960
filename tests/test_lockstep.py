"""Lanes in one batched pass per step give the same bits as lanes one after another.

Every lane's and every teacher-forced twin's logits are compared with
`torch.equal` after every step; tokens, K/V reports and measured state bytes
must be identical too.  Then: prompts fed in pieces, incremental reply text,
and runs without teacher-forced twins.
"""

import pytest
import torch

from kvdirect_app.engine import Engine, run_to_end
from kvdirect_app.strategies import parse_specs
from kvdirect_app.text import ReplyText

from .conftest import TINY_FAMILIES, all_sliding, tiny

TURNS = ["Tell me about caches.", "Why do keys need positions?"]
SPECS = ("full,kvdirect:budget=4,kvdirect:budget=3:mode=fast,anchorkv:spacing=2:budget=3:rebuild=step,"
         "anchorkv:spacing=2:budget=3,h2o:budget=8,snapkv:budget=16,tova:budget=6,streaming_llm:budget=8,window:budget=6")
SAME = ("token_ids", "kv_exact", "max_abs_dk", "max_abs_dv", "max_abs_dlogit", "kl_mean", "teacher_forced_agreement",
        "rebuilt_token_layers")


def _trace(loaded, specs, batch, turns=TURNS, **options):
    """Results, per-step logits of every lane and twin, and the events' types."""
    engine = Engine(loaded, parse_specs(specs), max_new_tokens=8, batch=batch, threads=1, **options)
    steps, kinds = [], []
    for event in engine.run(turns):
        kinds.append(event["type"])
        if event["type"] == "step":
            steps.append([(lane.label, lane.logits.clone(), None if lane.tf_logits is None else lane.tf_logits.clone())
                          for lane in engine.all_lanes])
    return engine.results(), steps, kinds


def assert_same_bits(loaded, specs=SPECS, turns=TURNS, **options):
    (one, steps_one, kinds_one), (batched, steps_batched, kinds_batched) = (
        _trace(loaded, specs, False, turns, **options), _trace(loaded, specs, True, turns, **options))
    assert batched["batched"] and not one["batched"]
    assert kinds_one == kinds_batched and len(steps_one) == len(steps_batched) > 4
    for a, b in zip(steps_one, steps_batched):
        for (label, logits, twin), (_, logits_b, twin_b) in zip(a, b):
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
    loaded = tiny(family)
    one, batched = assert_same_bits(loaded)
    # Some lanes diverged, so twins ran in the batch too (not on a model whose every layer slides: its window
    # holds what every strategy's budget does).
    assert any(r["first_divergence"] is not None for r in batched["strategies"].values()) != all_sliding(loaded)
    assert batched["shared_pass_ms_mean"] is not None and batched["strategies"]["full"]["latency_ms"]["decode_shared_ms_mean"]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_batched_lanes_in_bf16(family):
    assert_same_bits(tiny(family, "bfloat16"))


def test_batched_lanes_on_smollm2(smollm2):
    specs = "full,kvdirect:budget=16,anchorkv:spacing=30:budget=16,h2o:budget=16,snapkv:budget=16,tova:budget=16"
    one, batched = assert_same_bits(smollm2, specs, ["What is the capital of France?"])
    assert batched["strategies"]["kvdirect:budget=16"]["kv_exact"] is True


def test_a_long_prompt_is_fed_in_pieces_the_same_for_every_lane():
    loaded = tiny("tiny-llama")
    prompt = "A long message about caches and residual streams. " * 3
    one, batched = assert_same_bits(loaded, turns=[prompt, "Summarise."], prefill_chunk=40)
    engine = Engine(loaded, parse_specs("full,kvdirect:budget=4"), max_new_tokens=3, prefill_chunk=40)
    events = list(engine.run([prompt]))
    progress = [e for e in events if e["type"] == "prefill"]
    assert [e["done"] for e in progress] == [min(40 * (i + 1), progress[0]["total"]) for i in range(len(progress))]
    assert progress[-1]["done"] == progress[-1]["total"] == len(engine.prompt_ids) > 80
    r = events[-1]["result"]["strategies"]["kvdirect:budget=4"]
    assert r["kv_exact"] and r["rebuilt_token_layers"] > 0 and r["latency_ms"]["ttft_ms"] > 0


def test_without_twins_agreement_stops_at_the_first_divergence():
    loaded = tiny("tiny-llama")
    result = run_to_end(Engine(loaded, parse_specs("full,window:budget=4"), max_new_tokens=8, twins=False), TURNS)
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
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))  # only ever grows
    assert seen[-1] == text == reply.final()
