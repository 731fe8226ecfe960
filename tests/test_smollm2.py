"""End to end on the embedded real model, SmolLM2-135M-Instruct (fp32, CPU).

`smollm2_run` is the shared two-turn run of the exact strategies (and KV-Direct's fast mode) that this module
and test_kernels.py assert on; the full cache's first turn in both kernel modes is compared with `generate`
here and between the modes in test_kernels.py.
"""

import pytest
import torch

from .runs import run_once
from .test_exactness_tiny import fast_mode_reports_its_error

SMOL_TURNS = ["What is the capital of France? Answer in one sentence.", "And of Italy?"]
SMOL_EXACT = "full,kvdirect:budget=16,anchorkv:spacing=7:budget=16:rebuild=step"
SMOL_SPECS = "full,kvdirect:budget=16,kvdirect:budget=16:mode=fast,anchorkv:spacing=7:budget=16:rebuild=step"


def smollm2_run(smollm2):
    return run_once(smollm2, SMOL_SPECS, SMOL_TURNS, 20)


@pytest.mark.parametrize("kernels", ["invariant", "native"])
def test_full_matches_generate_on_smollm2(smollm2, kernels):
    """Native kernels give transformers' own bits; invariant ones other bits, but the same tokens here."""
    result = run_once(smollm2, "full", SMOL_TURNS[:1], 24, kernels=kernels).result
    assert result["kernels"]["mode"] == kernels
    ids = torch.tensor([result["prompt_ids"]])
    with torch.inference_mode():
        out = smollm2.model.generate(ids, max_new_tokens=24, do_sample=False)
    generated = out[0, ids.shape[1]:].tolist()
    assert result["strategies"]["full"]["token_ids"] == generated
    assert "Paris" in result["strategies"]["full"]["text"]


@pytest.mark.check
def test_kvdirect_exact_on_smollm2_two_turns(smollm2):
    result = smollm2_run(smollm2).result
    ref = result["strategies"]["full"]
    exact = result["strategies"]["kvdirect:budget=16"]
    fast = result["strategies"]["kvdirect:budget=16:mode=fast"]
    assert len(result["prompt_ids"]) > 16  # the budget is smaller than the prompt
    assert exact["token_ids"] == ref["token_ids"] and exact["token_match"] == 1.0
    assert exact["kv_exact"] is True and exact["layers_compared"] == 30 and exact["rebuilt_token_layers"] > 0
    assert exact["state_bytes"]["formula_matches_measurement"]
    fast_mode_reports_its_error(fast)
    assert fast["state_bytes"]["formula_matches_measurement"]
