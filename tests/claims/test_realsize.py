"""Exactness at a real size: Qwen2.5-0.5B's public config with seeded random weights (`claims/realsize.py`).

One run of the studio's engine on the full-size model (24 layers, d 896, 14 query and 2 key/value heads, a
151,936-token vocabulary, 494M parameters), fp32, a prompt of 128 random token ids and 8 new tokens, with the
lanes full, KV-Direct and AnchorKV at the break-even spacing s* = 4 and at one anchor (spacing 24), each keeping
the last 112 tokens' K/V, so that every decode step rebuilds the K/V of the 16-22 older tokens on every layer
(AnchorKV by replaying the layers above its anchors).  Every lane: K/V bit-equal to the full cache's where it
handed them to attention, token-layers rebuilt (else exactness was not exercised), the same tokens, and the
allocator's held bytes equal to the formula at every step and after the turn.  (The prompt is short of the
few hundred tokens `measure` defaults to: replaying every older token at every step on two cores costs about
0.1 s per token and lane.)

A mutation that makes it fail: drop the oldest token from KV-Direct's rebuild (in
`strategies/kvdirect.py` `ResidualLayer.rebuild_old`, return the rebuilt K/V shifted by one token,
``keys[..., :end - 1, :] = keys[..., 1:end, :]``, the same for values): the KV-Direct lane's `kv_exact` turns
False (max |dK| 3.2, max |dV| 3.2) while its bytes still match; `test_every_lane_is_exact_at_the_real_size` fails.

Time: one thread (as each of `make test`'s two workers has): the run took 43-50 s on the two cores shared
with other work (build 9 s, probes 7 s, the turn 26 s), the module 60 s.  At two threads the same run took
80-220 s there: the two OpenMP threads wait on each other whenever other work holds a core.
"""

import json

import pytest
import torch

from kvdirect_app.claims import realsize
from kvdirect_app.models.geometry import ModelGeometry, load_config

CONFIG = "qwen2.5-0.5b"
PROMPT, NEW, BUDGET, THREADS = 128, 8, 112, 1


def lanes() -> list[str]:
    geom = ModelGeometry.from_config(load_config(str(realsize.config_path(CONFIG))))
    return realsize.lanes(geom.num_layers, geom.break_even_spacing(token_id_anchor=True), BUDGET)


@pytest.fixture(scope="module")
def measured():
    return realsize.measure(CONFIG, "float32", prompt_tokens=PROMPT, new_tokens=NEW, budget=BUDGET, threads=THREADS)


@pytest.mark.parametrize("spec", lanes())
def test_every_lane_is_exact_at_the_real_size(measured, spec):
    lane = measured["lanes"][spec]
    assert lane["kv_exact"] is True and lane["max_abs_dk"] == 0.0 and lane["max_abs_dv"] == 0.0, lane
    assert lane["layers_compared"] == 24
    assert lane["tokens_equal"] is True and lane["first_divergence"] is None
    assert lane["bytes_match"] is True and lane["byte_mismatches"] == 0
    assert lane["held_bytes"] == lane["formula_bytes"] > 0
    assert lane["meter_audit_mismatches"] == 0
    if spec != "full":
        assert lane["claims_exact"] is True
        assert lane["rebuilt_token_layers"] > 0  # old K/V were rebuilt at every step: exactness was exercised
    assert lane["exact"] is True


def test_the_run_is_the_real_config_with_random_weights(measured):
    assert measured["label"] == realsize.LABEL == "random weights at the real config"
    assert measured["model"] == CONFIG and measured["model_type"] == "qwen2" and measured["dtype"] == "float32"
    assert measured["parameters"] == 494_032_768  # Qwen2.5-0.5B's count (tied embedding counted once)
    assert measured["layers"] == 24 and measured["break_even_spacing"] == 4
    assert list(measured["lanes"]) == lanes()
    assert (
        measured["kernels_mode"] in ("invariant", "native") and measured["kernels"]["mode"] == measured["kernels_mode"]
    )
    assert measured["device"] == "cpu" and measured["threads"] == THREADS
    # The random weights give a model whose logits are finite and whose greedy tokens vary.
    assert measured["logits_finite"] is True and measured["distinct_new_tokens"] > 1
    assert measured["exact"] is True
    assert measured["seconds"]["total"] > 0 and measured["process_rss_peak_bytes"] > 0


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.2-1b", "qwen3-4b", "gemma-3-4b"])
def test_random_model_builds_what_transformers_builds(name, tmp_path):
    """The builder at a cut-down copy of each config (2 layers, a small vocabulary and MLP): the same buffers
    (RoPE frequencies, Gemma's embedding scale) and norm weights as transformers' own initialisation, normal(0,
    0.02) elsewhere (Gemma's embedding divided by its sqrt(d) scale), the head tied where the config ties it,
    and the same weights from the same seed."""
    from transformers import AutoModelForCausalLM

    data = json.loads(realsize.config_path(name).read_text())
    data.update(num_hidden_layers=2, vocab_size=512, intermediate_size=64)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    loaded = realsize.random_model(str(path), "float32", seed=7)
    model = loaded.model
    own = AutoModelForCausalLM.from_config(realsize.text_config(path), dtype=torch.float32)
    own_buffers = dict(own.named_buffers())
    for key, buffer in model.named_buffers():
        assert torch.equal(buffer, own_buffers[key]), key
    own_params = dict(own.named_parameters())
    scale = realsize.embedding_scale(model)
    assert scale == pytest.approx(data["hidden_size"] ** 0.5 if name.startswith("gemma") else 1.0, rel=0.01)
    for key, p in model.named_parameters():
        if "norm" in key:
            assert torch.equal(p, own_params[key]), key  # ones, or zeros for Gemma's (1 + w)
        else:  # normal(0, 0.02); the embedding divided by the family's scale of it
            want = 0.02 / scale if p is model.get_input_embeddings().weight else 0.02
            assert 0.75 < float(p.detach().float().std()) / want < 1.25, key
    assert model.lm_head.weight is model.get_input_embeddings().weight
    again = realsize.random_model(str(path), "float32", seed=7).model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert loaded.eos_ids == set() and loaded.tokenizer.decode([511]) == "<511>"


def test_llama_3_2_1b_config_is_the_public_one():
    """The bundled config parses with transformers, and geometry reads Llama 3.2-1B's public figures."""
    cfg = load_config(str(realsize.config_path("llama-3.2-1b")))
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings is True
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["rope_theta"] == 500000.0
    geom = ModelGeometry.from_config(cfg, torch.bfloat16)
    assert (geom.num_layers, geom.hidden_size, geom.layers[0].num_kv_heads, geom.layers[0].head_dim) == (
        16,
        2048,
        8,
        64,
    )
    assert geom.kv_bytes_per_token == 32 * 1024 and geom.break_even_spacing(token_id_anchor=True) == 2
