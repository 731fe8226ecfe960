"""The strategies inside transformers' own `generate` (`kvdirect_app.strategy_cache`).

Greedy `generate` with `full`, exact `kvdirect` and exact `anchorkv` gives the same tokens as with
transformers' `DynamicCache`, on every tiny family and on SmolLM2, over two turns; a lossy strategy runs and
reports its evictions; leaving the block leaves the model as it was; a second cache on the same model is
refused, caches on two models work independently.
"""

import threading

import pytest
import torch

from kvdirect_app import compat, strategy_cache
from kvdirect_app.generate import CacheInUse
from kvdirect_app.strategies import StrategyError

from .conftest import TINY_FAMILIES, all_sliding, tiny

EXACT = ("full", "kvdirect:budget=4", "anchorkv:spacing=2:budget=3", "kvdirect:budget=4:rebuild=step",
         "anchorkv:spacing=2:budget=3:rebuild=step")


def _ids(loaded, text: str) -> torch.Tensor:
    return torch.tensor([loaded.tokenizer.encode(text)])


def _two_turns(loaded, cache=None, tokens=8):
    """Two greedy generate calls, the second continuing the first's conversation; the new tokens of each."""
    model = loaded.model
    if cache is None:
        cache = compat.DynamicCache(config=model.config)
    first = _ids(loaded, "Tell me about caches.")
    out = model.generate(first, **{compat.GENERATE_CACHE: cache}, max_new_tokens=tokens, do_sample=False,
                         min_new_tokens=tokens, pad_token_id=0)
    second = torch.cat([out, _ids(loaded, " Why do keys need positions?")], dim=1)
    out2 = model.generate(second, **{compat.GENERATE_CACHE: cache}, max_new_tokens=tokens, do_sample=False,
                          min_new_tokens=tokens, pad_token_id=0)
    _two_turns.fed = out2.shape[1] - 1  # every token but the last generated one went through the model
    return out[0, first.shape[1]:].tolist(), out2[0, second.shape[1]:].tolist()


def _handed(cache) -> list:
    """Records every K/V the cache hands attention (`Cache.update`'s return), per call, as bytes."""
    seen, update = [], cache.update

    def recording(key_states, value_states, layer_idx, *args, **kwargs):
        k, v = update(key_states, value_states, layer_idx, *args, **kwargs)
        seen.append((layer_idx, tuple(k.shape), k.float().numpy().tobytes(), v.float().numpy().tobytes()))
        return k, v

    cache.update = recording
    return seen


def _hooks(model) -> list:
    return [(name, len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_exact_strategies_generate_the_dynamic_caches_tokens(family):
    """Tokens, and every K/V handed to attention in every forward of both turns bit for bit (the native kernels:
    a rebuild repeats the original GEMM shapes)."""
    loaded = tiny(family)
    dynamic = compat.DynamicCache(config=loaded.model.config)
    handed = _handed(dynamic)
    reference = _two_turns(loaded, dynamic)
    hooks, config = _hooks(loaded.model), loaded.model.config.to_dict()
    for spec in EXACT:
        with strategy_cache(loaded.model, spec) as cache:
            seen = _handed(cache)
            assert _two_turns(loaded, cache) == reference, (family, spec)
        assert len(seen) == len(handed) and seen == handed, (family, spec)
        report = cache.report()
        assert report["exact"] and report["turns"] == 2 and report["forwards"] == 2 * 8, report
        assert report["tokens_seen"] == _two_turns.fed
        assert report["bytes"]["formula_matches_held"], (spec, report["bytes"])
        if spec != "full" and not all_sliding(loaded):
            assert report["rebuilt_token_layers"] > 0, (spec, report)
        assert _hooks(loaded.model) == hooks and loaded.model.config.to_dict() == config, spec


def test_on_smollm2_exact_strategies_generate_the_same_tokens(smollm2):
    reference = _two_turns(smollm2, tokens=12)
    for spec in ("kvdirect:budget=8", "anchorkv:spacing=10:budget=8"):
        with strategy_cache(smollm2.model, spec) as cache:
            assert _two_turns(smollm2, cache, tokens=12) == reference, spec
        assert cache.report()["rebuilt_token_layers"] > 0


def test_a_lossy_strategy_reports_its_evictions():
    loaded = tiny("tiny-llama")
    with strategy_cache(loaded.model, "h2o:budget=6") as cache:
        _two_turns(loaded, cache)
    report = cache.report()
    assert not report["exact"] and report["evicted_token_layers"] > 0
    # Each layer keeps at most 6 tokens per KV head (a token some head keeps is not evicted), so at least one
    # head's 6 and at most 6 per head of the seen ones.
    layers, heads = loaded.model.config.num_hidden_layers, loaded.model.config.num_key_value_heads
    seen = report["tokens_seen"]
    assert layers * max(0, seen - 6 * heads) <= report["evicted_token_layers"] <= layers * (seen - 6)
    assert report["bytes"]["formula_matches_held"], report["bytes"]
    with strategy_cache(loaded.model, "full") as full:
        _two_turns(loaded, full)
    assert report["bytes"]["held_last"] < full.report()["bytes"]["held_last"]


def test_a_second_cache_on_one_model_is_refused_and_two_models_work_independently():
    loaded, other = tiny("tiny-llama"), tiny("tiny-qwen2")
    with strategy_cache(loaded.model, "kvdirect:budget=4"):
        with pytest.raises(CacheInUse, match="already has a strategy cache"):
            with strategy_cache(loaded.model, "full"):
                pass
        refused = []
        thread = threading.Thread(target=lambda: _try(loaded, refused))
        thread.start()
        thread.join()
        assert refused == ["refused"]  # from another thread too
        reference = _two_turns(other)
        with strategy_cache(other.model, "anchorkv:spacing=2:budget=3") as cache:
            assert _two_turns(other, cache) == reference
    with strategy_cache(loaded.model, "full"):  # free again after the block
        pass


def _try(loaded, out):
    try:
        with strategy_cache(loaded.model, "full"):
            out.append("entered")
    except CacheInUse:
        out.append("refused")


def test_a_bad_spec_says_what_is_allowed_and_installs_nothing():
    loaded = tiny("tiny-llama")
    hooks = _hooks(loaded.model)
    with pytest.raises(StrategyError, match="allowed"):
        with strategy_cache(loaded.model, "kvdirect:mode=fastest"):
            pass
    assert _hooks(loaded.model) == hooks
    with strategy_cache(loaded.model, "full"):  # the lock was not left taken
        pass


def test_the_readme_snippet_runs_as_written(smollm2, capsys):
    """The README's "Use the strategies in your own code" block, executed as it stands."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```python\n(from kvdirect_app import strategy_cache\n.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    report = scope["cache"].report()
    assert report["strategy"] == "anchorkv:spacing=8" and report["exact"] and report["forwards"] > 1
    assert report["bytes"]["formula_matches_held"]
    assert "'strategy': 'anchorkv:spacing=8'" in capsys.readouterr().out


def test_every_registered_strategy_runs_inside_generate():
    """Each strategy of the registry as a generate cache: its tokens (the exact ones: DynamicCache's), its bytes
    by formula equal to what it held after every forward, and the model left as it was."""
    from kvdirect_app.strategies.base import Strategy
    from kvdirect_app.strategies import available  # noqa: F401  (fills the registry)

    loaded = tiny("tiny-qwen3")
    reference = _two_turns(loaded)
    hooks = _hooks(loaded.model)
    for name, cls in sorted(Strategy.registry.items()):
        spec = name if "budget" not in cls.settings() else f"{name}:budget=6"
        with strategy_cache(loaded.model, spec) as cache:
            tokens = _two_turns(loaded, cache)
        report = cache.report()
        assert report["forwards"] == 16 and report["tokens_seen"] == _two_turns.fed, (spec, report)
        assert report["bytes"]["formula_matches_held"], (spec, report["bytes"])
        assert (tokens == reference) if report["exact"] else report["evicted_token_layers"] > 0, spec
        assert _hooks(loaded.model) == hooks, spec
