"""End to end on the embedded real model, SmolLM2-135M-Instruct (fp32, CPU)."""

import pytest
import torch

from kvdirect_app.engine import Engine, run_to_end
from kvdirect_app.strategies import parse_specs

from .test_exactness_tiny import fast_mode_reports_its_error

TURNS = ["What is the capital of France? Answer in one sentence.", "And of Italy?"]


@pytest.mark.parametrize("kernels", ["invariant", "native"])
def test_full_matches_generate_on_smollm2(smollm2, kernels):
    """Native kernels give transformers' own bits; invariant ones other bits, but the same tokens here."""
    result = run_to_end(Engine(smollm2, parse_specs("full"), max_new_tokens=24, kernels=kernels), TURNS[:1])
    assert result["kernels"]["mode"] == kernels
    ids = torch.tensor([result["prompt_ids"]])
    with torch.inference_mode():
        out = smollm2.model.generate(ids, max_new_tokens=24, do_sample=False)
    generated = out[0, ids.shape[1]:].tolist()
    assert result["strategies"]["full"]["token_ids"] == generated
    assert "Paris" in result["strategies"]["full"]["text"]


def test_kvdirect_exact_on_smollm2_two_turns(smollm2):
    specs = "full,kvdirect:budget=16:mode=exact,kvdirect:budget=16:mode=fast"
    result = run_to_end(Engine(smollm2, parse_specs(specs), max_new_tokens=20), TURNS)
    ref = result["strategies"]["full"]
    exact = result["strategies"]["kvdirect:budget=16:mode=exact"]
    fast = result["strategies"]["kvdirect:budget=16:mode=fast"]
    assert len(result["prompt_ids"]) > 16  # the budget is smaller than the prompt
    assert exact["token_ids"] == ref["token_ids"] and exact["token_match"] == 1.0
    assert exact["kv_exact"] is True and exact["layers_compared"] == 30 and exact["rebuilt_token_layers"] > 0
    assert exact["state_bytes"]["formula_matches_measurement"]
    fast_mode_reports_its_error(fast)
    assert fast["state_bytes"]["formula_matches_measurement"]
