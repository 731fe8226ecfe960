"""The strategies inside transformers' own `generate` and forward (`kvdirect_app.strategy_cache`).

Greedy `generate` with `full`, exact `kvdirect` and exact `anchorkv` gives the same tokens as with
transformers' `DynamicCache`, on every tiny family and on SmolLM2, over two turns, and `verify=True` finds every
K/V handed to attention bit-equal to a full cache's; direct forwards (`model(ids, cache=...)`,
`past_key_values=`, the cache as a positional argument) over two turns rebuild what they should and give
DynamicCache's logits bit for bit; a rebuilt row swapped is reported by `verify`; a lossy strategy runs, reports
its evictions, and `verify` says what it could check; every way in that cannot be served exactly raises one
`UnsupportedCall` line and leaves the cache as it was; leaving the block leaves the model as it was; a second
cache on the same model is refused, caches on two models work independently.  A prompt `generate` feeds in pieces
(`prefill_chunk_size`) is served as one prompt: every strategy keeps the unchunked run's tokens and bytes (tiny
models, and SnapKV on SmolLM2 in the reviewer's case), turns fall where the whole prompt puts them, and a prefill
that feeds other than its prompt is refused; assisted decoding and `cache_implementation="paged"` are refused
before the cache changes.
"""

import threading

import pytest
import torch

from kvdirect_app import strategy_cache
from kvdirect_app.engine import Engine
from kvdirect_app.engine.integration import CacheInUse, UnsupportedCall
from kvdirect_app.models import compat
from kvdirect_app.strategies import StrategyError, parse_spec

from ..conftest import TINY_FAMILIES, all_sliding, tiny
from ..specs import every

EXACT = (
    "full",
    "kvdirect:budget=4",
    "anchorkv:spacing=2:budget=3",
    "kvdirect:budget=4:rebuild=step",
    "anchorkv:spacing=2:budget=3:rebuild=step",
)


def _ids(loaded, text: str) -> torch.Tensor:
    return torch.tensor([loaded.tokenizer.encode(text)])


def _two_turns(loaded, cache=None, tokens=8):
    """Two greedy generate calls, the second continuing the first's conversation; the new tokens of each."""
    model = loaded.model
    if cache is None:
        cache = compat.DynamicCache(config=model.config)
    first = _ids(loaded, "Tell me about caches.")
    out = model.generate(
        first,
        **{compat.GENERATE_CACHE: cache},
        max_new_tokens=tokens,
        do_sample=False,
        min_new_tokens=tokens,
        pad_token_id=0,
    )
    second = torch.cat([out, _ids(loaded, " Why do keys need positions?")], dim=1)
    out2 = model.generate(
        second,
        **{compat.GENERATE_CACHE: cache},
        max_new_tokens=tokens,
        do_sample=False,
        min_new_tokens=tokens,
        pad_token_id=0,
    )
    _two_turns.fed = out2.shape[1] - 1  # every token but the last generated one went through the model
    return out[0, first.shape[1] :].tolist(), out2[0, second.shape[1] :].tolist()


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
    a rebuild repeats the original GEMM shapes); `verify` finds the same, its rebuilt rows the report's.

    Mutation (applied, fails): `Verifier.check` does not count the rebuilt rows it checked -> verified
    `rebuilt_token_layers` 0 beside the report's."""
    loaded = tiny(family)
    dynamic = compat.DynamicCache(config=loaded.model.config)
    handed = _handed(dynamic)
    reference = _two_turns(loaded, dynamic)
    hooks, config = _hooks(loaded.model), loaded.model.config.to_dict()
    for spec in EXACT:
        with strategy_cache(loaded.model, spec, verify=True) as cache:
            seen = _handed(cache)
            assert _two_turns(loaded, cache) == reference, (family, spec)
        assert len(seen) == len(handed) and seen == handed, (family, spec)
        report = cache.report()
        assert report["claims_exact"] and report["turns"] == 2 and report["forwards"] == 2 * 8, report
        verified = report["verified"]
        assert verified["exact"] and verified["checked_token_layers"] > 0, (family, spec, verified)
        assert verified["rebuilt_token_layers"] == report["rebuilt_token_layers"], (family, spec, verified)
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
    assert not report["claims_exact"] and report["evicted_token_layers"] > 0
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

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```python\n(from kvdirect_app import strategy_cache\n.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    report = scope["cache"].report()
    assert report["strategy"] == "anchorkv:spacing=8" and report["claims_exact"] and report["forwards"] > 1
    assert report["verified"]["exact"] and report["verified"]["checked_token_layers"] > 0
    assert report["bytes"]["formula_matches_held"]
    assert "'strategy': 'anchorkv:spacing=8'" in capsys.readouterr().out


def test_the_readmes_question_after_snippet_runs_as_written(smollm2):
    """The README's kvpress-setting block, executed after its first library block: one turn, the context
    compressed (evictions), nothing evicted after it."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = re.search(r"```python\n(from kvdirect_app import strategy_cache\n.*?)```", readme, re.S).group(1)
    block = re.search(r"```python\n(import torch\n\ncontext = .*?question_after=True.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(first.replace('"anchorkv:spacing=8:budget=64", verify=True', '"full"'), "README.md", "exec"), scope)
    exec(compile(block, "README.md", "exec"), scope)
    report = scope["cache"].report()
    assert report["strategy"] == "snapkv:budget=32" and report["turns"] == 1, report
    assert report["evicted_token_layers"] > 0 and scope["out"].shape[1] > len(scope["context"]), report


def test_every_registered_strategy_runs_inside_generate():
    """Each strategy of the registry as a generate cache: its tokens (the exact ones: DynamicCache's), its bytes
    by formula equal to what it held after every forward, what its class claims confirmed by `verify` (no row
    differs; the lossy ones miss rows), and the model left as it was.

    Mutation (applied, fails): `Verifier.report`'s `exact` ignores missing rows -> H2O verified exact."""
    loaded = tiny("tiny-qwen3")
    reference = _two_turns(loaded)
    hooks = _hooks(loaded.model)
    for spec in every(budget=6):  # every registered strategy (tests/specs.py)
        with strategy_cache(loaded.model, spec, verify=True) as cache:
            tokens = _two_turns(loaded, cache)
        report = cache.report()
        assert report["forwards"] == 16 and report["tokens_seen"] == _two_turns.fed, (spec, report)
        assert report["bytes"]["formula_matches_held"], (spec, report["bytes"])
        assert (tokens == reference) if report["claims_exact"] else report["evicted_token_layers"] > 0, spec
        # What each class claims, checked: no row it handed differs, and only the lossy ones miss rows.
        verified = report["verified"]
        assert not verified["mismatched_token_layers"] and verified["exact"] == report["claims_exact"], (spec, verified)
        assert _hooks(loaded.model) == hooks, spec


# --- direct forwards, verify, and the ways in that are refused ----------------------------------------------------
DIRECT = ("anchorkv:spacing=2:budget=3", "anchorkv:spacing=2:budget=3:rebuild=step", "kvdirect:budget=4")
STEPS = 4


def _forward(model, ids, cache, name):
    """One forward of `ids` on `cache`, handed over as `name` (a keyword, or None: the forward's 4th positional
    argument, after input_ids, attention_mask and position_ids)."""
    if name is None:
        return model(ids, None, None, cache)
    return model(ids, **{name: cache})


def _direct(loaded, cache, name="cache", prompts=None, steps=STEPS) -> list[torch.Tensor]:
    """Two turns of direct forwards, as a chat loop without `generate`: each prompt, then `steps` one-token steps
    feeding the argmax; the last position's logits of every forward."""
    model = loaded.model
    prompts = prompts or (_ids(loaded, "Tell me about caches."), _ids(loaded, " Why do keys need positions?"))
    logits = []
    with torch.no_grad():
        for ids in prompts:
            for _ in range(steps + 1):
                last = _forward(model, ids, cache, name).logits[0, -1]
                logits.append(last)
                ids = last.argmax().view(1, 1)
    return logits


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _rebuilt(spec: str, globals_: int, sizes: list[int]) -> int:
    """Token-layers a rebuilding strategy must rebuild over forwards of `sizes` tokens (two turns, the second
    starting at the forward after the first turn's `STEPS` steps): `rebuild=step` every forward's old tokens,
    `rebuild=turn` once, at the second turn's prompt."""
    budget = int(spec.split("budget=")[1].split(":")[0])
    before = [sum(sizes[:i]) for i in range(len(sizes))]
    if "rebuild=step" in spec or spec.startswith("kvdirect"):  # kvdirect's default is rebuild=step
        return globals_ * sum(max(0, s - budget) for s in before)
    return globals_ * max(0, before[STEPS + 1] - budget)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_direct_forwards_over_two_turns_rebuild_and_give_the_dynamic_caches_logits(family):
    """Every name a forward takes the cache by (`cache=`, `past_key_values=`, positional), two turns of direct
    forwards: logits bit-equal to DynamicCache's, and exactly the token-layers each strategy must rebuild.

    Mutations (each applied, each fails): the hooks recognise the cache only under `compat.CACHE_KWARG` (the
    reviewer's finding) -> `past_key_values=` raises UnsupportedCall from the guard in `GenerateCache.update`;
    with that guard removed as well (the code as reviewed) -> AnchorKV rebuild=turn rebuilds 0 token-layers (it
    held full K/V); a `Verifier` built whatever `verify` says -> `verified` is not None.
    """
    loaded = tiny(family)
    reference = _direct(loaded, compat.DynamicCache(config=loaded.model.config))
    sizes = [_ids(loaded, "Tell me about caches.").shape[1]] + [1] * STEPS
    sizes += [_ids(loaded, " Why do keys need positions?").shape[1]] + [1] * STEPS
    globals_ = sum(not s.is_sliding for s in compat.layer_specs(loaded.model.config))
    for spec in DIRECT:
        for name in ("cache", "past_key_values", None):
            with strategy_cache(loaded.model, spec) as cache:
                logits = _direct(loaded, cache, name)
            assert _same(logits, reference), (family, spec, name)
            report = cache.report()
            assert report["forwards"] == 2 * (STEPS + 1) and report["turns"] == 2, (spec, name, report)
            assert report["tokens_seen"] == sum(sizes) and report["bytes"]["formula_matches_held"], (spec, name)
            assert report["rebuilt_token_layers"] == _rebuilt(spec, globals_, sizes), (family, spec, name, report)
            assert report["verified"] is None and cache.verifier is None and "verify" not in report["ms"]
    assert globals_ == 0 or _rebuilt(DIRECT[0], globals_, sizes) > 0  # the counts above are not all zero


def test_generate_takes_the_cache_under_either_name():
    """`generate(..., past_key_values=cache)` (the deprecated name) does what `cache=` does: DynamicCache's tokens,
    the rebuilds done, verified exact.

    Mutation (applied, fails): the hooks recognise the cache only under `past_key_values` (not `compat.CACHE_KWARG`,
    the name `generate` hands the forward) -> the guard in `update` raises UnsupportedCall."""
    loaded = tiny("tiny-gemma3")
    reference = _two_turns(loaded)
    for spec in DIRECT:
        with strategy_cache(loaded.model, spec, verify=True) as cache:
            model, first = loaded.model, _ids(loaded, "Tell me about caches.")
            greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            out = model.generate(first, past_key_values=cache, **greedy)
            second = torch.cat([out, _ids(loaded, " Why do keys need positions?")], dim=1)
            out2 = model.generate(second, past_key_values=cache, **greedy)
        assert (out[0, first.shape[1] :].tolist(), out2[0, second.shape[1] :].tolist()) == reference, spec
        report = cache.report()
        assert report["rebuilt_token_layers"] > 0 and report["verified"]["exact"], (spec, report)


def test_on_smollm2_direct_forwards_rebuild_and_verify_exact(smollm2):
    """SmolLM2, `model(ids, past_key_values=cache)` (the reviewer's calls): a 60-token prompt, 4 steps, a 12-token
    prompt, 4 steps; AnchorKV (turn and step) and KV-Direct rebuild what they must (30 global layers), give
    DynamicCache's logits bit for bit, and `verify` finds every handed row the full cache's.

    Mutations (each applied, each fails): the hooks recognise the cache only under `compat.CACHE_KWARG` ->
    UnsupportedCall; with the guard in `GenerateCache.update` removed too -> AnchorKV rebuilds 0 token-layers."""
    words = (
        "The locker code is 4127. Keys and values of a layer are projections of its input, so a cache may keep "
        "the input and rebuild them when attention needs them again, at their original positions. "
    ) * 3
    tokens = smollm2.tokenizer.encode(words)
    second = smollm2.tokenizer.encode(" Why do keys need positions in attention layers of a transformer?")[:12]
    prompts = (torch.tensor([tokens[:60]]), torch.tensor([second]))
    assert prompts[1].shape[1] == 12
    reference = _direct(smollm2, compat.DynamicCache(config=smollm2.model.config), "past_key_values", prompts)
    sizes = [60] + [1] * STEPS + [12] + [1] * STEPS
    for spec in ("anchorkv:spacing=8:budget=8", "anchorkv:spacing=8:budget=8:rebuild=step", "kvdirect:budget=8"):
        with strategy_cache(smollm2.model, spec, verify=True) as cache:
            logits = _direct(smollm2, cache, "past_key_values", prompts)
        assert _same(logits, reference), spec
        report = cache.report()
        assert report["rebuilt_token_layers"] == _rebuilt(spec, 30, sizes) > 0, (spec, report)
        verified = report["verified"]
        assert verified["exact"] and verified["rebuilt_token_layers"] == report["rebuilt_token_layers"], verified
        assert verified["checked_token_layers"] == 30 * sum(sum(sizes[: i + 1]) for i in range(len(sizes)))


def _swapping(rebuild_old):
    """A rebuild that hands back the keys of tokens 0 and 1 swapped (one wrong row pair per rebuild)."""

    def swapped(self, end, capacity):
        keys, values = rebuild_old(self, end, capacity)
        keys[..., [0, 1], :] = keys[..., [1, 0], :]
        return keys, values

    return swapped


@pytest.mark.parametrize("spec", DIRECT)
def test_verify_reports_a_swapped_rebuilt_row(spec, monkeypatch):
    """The strategy's rebuild monkeypatched to swap tokens 0 and 1: `verify` counts exactly those two rows at every
    global layer of every forward that hands them, and names the first (forward, layer, token 0, rebuilt); the
    class's claim alone still says exact.

    Mutation (applied, fails): `Verifier.check` compares with `torch.equal` on the handed K/V against themselves
    (not the shadow's) -> no mismatch reported."""
    from kvdirect_app.strategies.anchorkv import AnchoredLayer
    from kvdirect_app.strategies.kvdirect import ResidualLayer

    for cls in (AnchoredLayer, ResidualLayer):
        monkeypatch.setattr(cls, "rebuild_old", _swapping(cls.rebuild_old))
    loaded = tiny("tiny-llama")
    with strategy_cache(loaded.model, spec, verify=True) as cache:
        _direct(loaded, cache)
    report = cache.report()
    verified = report["verified"]
    layers = loaded.model.config.num_hidden_layers
    # rebuild=step: every forward after the prompt rebuilds (and swaps); rebuild=turn: the second turn's prompt
    # rebuilds once and its K/V (the swapped rows among them) are handed in each of that turn's forwards.
    handing = 2 * STEPS + 1 if "anchorkv" not in spec or "rebuild=step" in spec else STEPS + 1
    swapped = 2 * layers * handing
    if spec == "anchorkv:spacing=2:budget=3:rebuild=step":
        # More: a later replay runs the layers from an anchor with the right keys, where the forward that first
        # computed those tokens had attended to swapped ones; what it rebuilds then differs from what was computed.
        assert verified["mismatched_token_layers"] > swapped, verified
    else:
        assert verified["mismatched_token_layers"] == swapped, verified
    assert not verified["exact"] and report["claims_exact"]
    first = verified["first_mismatch"]
    assert (first["forward"], first["layer"], first["token"], first["rebuilt"]) == (
        1 if handing == 2 * STEPS + 1 else STEPS + 1,
        0,
        0,
        True,
    ), first


def test_a_lossy_strategy_under_verify_says_what_it_could_check():
    """H2O under `verify`: the prompt's forward hands every token (checked, equal); once it evicts, a layer hands
    fewer rows than the full cache, which cannot be lined up row by row: they count as missing, never as checked,
    and `exact` is False.  Nothing is rebuilt.

    Mutation (applied, fails): shape mismatches counted as neither missing nor mismatched (skipped) -> `exact`
    True for H2O."""
    loaded = tiny("tiny-llama")
    with strategy_cache(loaded.model, "h2o:budget=6", verify=True) as cache:
        _direct(loaded, cache)
    verified = cache.report()["verified"]
    layers = loaded.model.config.num_hidden_layers
    assert verified["checked_token_layers"] == layers * _ids(loaded, "Tell me about caches.").shape[1], verified
    assert verified["rebuilt_token_layers"] == 0 and verified["mismatched_token_layers"] == 0, verified
    assert verified["missing_token_layers"] > 0 and not verified["exact"], verified
    with strategy_cache(loaded.model, "h2o:budget=400", verify=True) as large:  # evicts nothing: the full cache's
        _direct(loaded, large)
    assert large.report()["verified"]["exact"]


def _one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message and message.startswith("strategy_cache: "), message
    return message


def test_every_unsupported_way_in_raises_one_clear_error_and_leaves_the_cache_as_it_was():
    """Each refused call raises UnsupportedCall (one line) before the cache changes: the conversation then goes on
    on the same cache and gives DynamicCache's logits bit for bit.  After the block the cache refuses forwards.

    Mutations (each applied, each fails): in `_check_call`, drop the input_ids check (inputs_embeds then fails
    inside with an AttributeError, not the clear error), the batch-size check (a RuntimeError from inside the
    forward), the position_ids, attention_mask or use_cache check (the shifted, padded or use_cache=False forward
    runs on the cache); drop the outside-a-forward guard in `GenerateCache.update` (the inner model's forward runs
    on the cache); drop `crop`'s refusal (an AttributeError from the strategy's layer)."""
    loaded = tiny("tiny-llama")
    model = loaded.model
    first, second = _ids(loaded, "Tell me about caches."), _ids(loaded, " Why do keys need positions?")
    reference = _direct(loaded, compat.DynamicCache(config=model.config))
    embed = model.get_input_embeddings()
    ones = torch.ones(1, first.shape[1] + 1, dtype=torch.long)
    greedy = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    with torch.no_grad(), strategy_cache(model, "anchorkv:spacing=2:budget=3:rebuild=step", verify=True) as cache:
        logits = [model(first, cache=cache).logits[0, -1]]
        token = logits[-1].argmax().view(1, 1)
        refused = {
            "inputs_embeds": lambda: model(inputs_embeds=embed(token), cache=cache),
            "a batch of two": lambda: model(torch.cat([token, token]), cache=cache),
            "no tokens": lambda: model(token[:, :0], cache=cache),
            "padding": lambda: model(token, attention_mask=torch.cat([ones[:, :1] * 0, ones[:, 1:]], 1), cache=cache),
            "a 4-D mask": lambda: model(token, attention_mask=ones.view(1, 1, 1, -1), cache=cache),
            "shifted positions": lambda: model(token, position_ids=torch.tensor([[0]]), cache=cache),
            "use_cache=False": lambda: model(token, cache=cache, use_cache=False),
            "generate, use_cache=False": lambda: model.generate(first, cache=cache, use_cache=False, **greedy),
            "beam search": lambda: model.generate(first, cache=cache, num_beams=2, **greedy),
            "two sequences": lambda: model.generate(
                first, cache=cache, num_return_sequences=2, do_sample=True, max_new_tokens=2, pad_token_id=0
            ),
            "the inner model": lambda: model.model(token, cache=cache),
            ".forward": lambda: model.forward(token, cache=cache),
            "a layer": lambda: cache.update(*[torch.zeros(1, 2, 1, 16)] * 2, 0),
            "crop": lambda: cache.crop(1),
            "reset": lambda: cache.reset(),
            "batch_repeat_interleave": lambda: cache.batch_repeat_interleave(2),
            "batch_select_indices": lambda: cache.batch_select_indices(torch.tensor([0])),
            "reorder_cache": lambda: cache.reorder_cache(torch.tensor([0])),
        }
        for what, call in refused.items():
            with pytest.raises(UnsupportedCall) as info:
                call()
            _one_line(info)
            report = cache.report()
            assert report["forwards"] == 1 and report["tokens_seen"] == first.shape[1], (what, report)
        assert not cache.is_croppable  # assisted decoding: transformers refuses a cache that cannot be cropped
        # The conversation goes on as if nothing had been tried.
        ids = token
        for _ in range(STEPS):
            logits.append(model(ids, cache=cache).logits[0, -1])
            ids = logits[-1].argmax().view(1, 1)
        ids = second
        for _ in range(STEPS + 1):
            logits.append(model(ids, cache=cache).logits[0, -1])
            ids = logits[-1].argmax().view(1, 1)
    assert _same(logits, reference) and cache.report()["verified"]["exact"]
    with pytest.raises(UnsupportedCall, match="after the block") as info:
        model(ids, cache=cache)
    _one_line(info)


def test_a_forward_that_does_not_finish_leaves_the_cache_refusing_every_later_forward():
    """A forward that raises part-way (some layers updated, some not), or a second update of a layer within one
    forward (a second forward without a new step), or a forward of the cache inside its own forward: one clear
    error, and the cache refuses every later forward (its layers are out of step).

    Mutations (each applied, each fails): drop the `led.broken or led.step is not None` check in `before` (the next
    forward runs on layers out of step); drop the twice-in-one-forward check in `GenerateCache.update` (the second
    update of layer 0 goes through)."""
    loaded = tiny("tiny-llama")
    model, first = loaded.model, _ids(loaded, "Tell me about caches.")
    layer1 = compat.decoder_layers(model)[1]

    def fails(module, args):
        raise RuntimeError("boom")

    def updates_layer0_again(module, args):
        cache.update(*[torch.zeros(1, model.config.num_key_value_heads, 1, 16)] * 2, 0)

    def nests(module, args):
        model(first[:, :1], cache=cache)

    for hook, error, says in (
        (fails, RuntimeError, "boom"),
        (updates_layer0_again, UnsupportedCall, "twice"),
        (nests, UnsupportedCall, "runs inside it"),
    ):
        with torch.no_grad(), strategy_cache(model, "anchorkv:spacing=2:budget=3:rebuild=step") as cache:
            model(first, cache=cache)
            handle = layer1.register_forward_pre_hook(hook)
            try:
                with pytest.raises(error, match=says):
                    model(first[:, :1], cache=cache)
            finally:
                handle.remove()
            with pytest.raises(UnsupportedCall, match="out of step") as info:
                model(first[:, 1:2], cache=cache)
            _one_line(info)


def test_a_forward_with_another_cache_inside_the_block_leaves_the_strategy_cache_alone():
    """Forwards of the same model with a DynamicCache, or with no cache, between the strategy cache's own: its
    logits are still DynamicCache's bit for bit and `verify` finds nothing amiss.

    Mutation (applied, fails): no `tap.clear()` in `after` (the input tap stays targeted between this cache's
    forwards) -> the other forwards' residuals join AnchorKV's anchors, and the logits differ."""
    loaded = tiny("tiny-qwen3")
    model = loaded.model
    reference = _direct(loaded, compat.DynamicCache(config=model.config))
    other = compat.DynamicCache(config=model.config)
    probe = _ids(loaded, "Another conversation.")

    def interleaved(ids, cache):
        """The strategy cache's forward, after a forward with another cache and one with none."""
        model(probe[:, :1] if other.get_seq_length() else probe, cache=other)
        model(probe)
        return model(ids, cache=cache)

    logits = []
    with torch.no_grad(), strategy_cache(model, "anchorkv:spacing=2:budget=3:rebuild=step", verify=True) as cache:
        for ids in (_ids(loaded, "Tell me about caches."), _ids(loaded, " Why do keys need positions?")):
            for _ in range(STEPS + 1):
                logits.append(interleaved(ids, cache).logits[0, -1])
                ids = logits[-1].argmax().view(1, 1)
    assert _same(logits, reference) and cache.report()["verified"]["exact"]
    assert other.get_seq_length() == probe.shape[1] + 2 * (STEPS + 1) - 1


# --- a prompt fed in pieces (`prefill_chunk_size`), and generate's options that would change what the cache sees ---
def _pieces_turns(loaded, spec, chunk, prompts, tokens=8):
    """Two greedy generate turns on a strategy cache, each prompt fed in pieces of `chunk` tokens (None: whole);
    the new tokens of each turn, and the cache."""
    model = loaded.model
    greedy = dict(
        max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk
    )
    with strategy_cache(model, spec, verify=True) as cache:
        out = model.generate(prompts[0], cache=cache, **greedy)
        second = torch.cat([out, prompts[1]], dim=1)
        out2 = model.generate(second, cache=cache, **greedy)
    return (out[0, prompts[0].shape[1] :].tolist(), out2[0, second.shape[1] :].tolist()), cache


def _held(cache) -> tuple:
    """What the cache holds: its bytes, and per layer what it keeps of each token."""
    return cache.report()["bytes"]["held_last"], [layer.token_states() for layer in cache.layers]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma2"])
def test_every_registered_strategy_serves_a_prompt_fed_in_pieces_as_one_prompt(family):
    """`generate(..., prefill_chunk_size=8)` over two turns (prompts of 33 and 13 new tokens: pieces 8, 8, 8, 8, 1
    and 8, 5), every strategy of the registry: the tokens of the unchunked run, the same bytes held and the same
    tokens kept per layer; the exact ones verified exact, the lossy ones evicted before the end.  Families without
    a key norm (Llama; Gemma 2: sliding layers, soft-capping): where one normalises every key (Qwen 3, Gemma 3,
    OLMo 2), KNorm's key norms tie and rounding picks its tokens, and a piece's K/V differ from the whole prompt's
    in their last bits (DynamicCache's too).

    Mutations (each applied, each fails): `begin_step(..., more)` always passed False (the reviewer's finding:
    H2O and the others evict at every piece) -> H2O's tokens differ; the `_prefill` wrapper not installed -> the
    same; every piece counted as a turn's start (`starts` without `first and`) -> `end_turn` between pieces, 7
    turns reported, not 2; a piece recorded as `Forward(q, prompt=...)` without `open`, or the pieces after the
    first as no prompt's (`prompt = starts`) -> the formula no longer matches what is held."""
    loaded = tiny(family)
    text = (
        "Keys and values of a layer are projections of its input, so a cache may keep the input. "
        "Why do keys need positions?"
    )
    tokens = loaded.tokenizer.encode(text)
    prompts = (torch.tensor([tokens[:33]]), torch.tensor([tokens[40:52]]))
    assert [p.shape[1] for p in prompts] == [33, 12]
    hooks = _hooks(loaded.model)
    for spec in every(budget=6):  # every registered strategy (tests/specs.py)
        whole, whole_cache = _pieces_turns(loaded, spec, None, prompts)
        pieces, cache = _pieces_turns(loaded, spec, 8, prompts)
        assert pieces == whole, spec
        assert _held(cache) == _held(whole_cache), spec
        report, whole_report = cache.report(), whole_cache.report()
        assert report["forwards"] == 5 + 7 + 2 + 7 and whole_report["forwards"] == 16, (spec, report)
        assert report["turns"] == whole_report["turns"] == 2, (spec, report)
        assert report["tokens_seen"] == whole_report["tokens_seen"] == 33 + 8 + 12 + 7, (spec, report)
        assert report["bytes"].get("formula_matches_held", True), (spec, report["bytes"])
        verified = report["verified"]
        assert verified["exact"] == report["claims_exact"] and not verified["mismatched_token_layers"], (spec, verified)
        assert report["claims_exact"] or report["evicted_token_layers"] > 0, spec
        assert _hooks(loaded.model) == hooks and "_prefill" not in vars(loaded.model), spec


def test_on_smollm2_snapkv_serves_the_reviewers_chunked_prompt_as_one_prompt(smollm2):
    """The reviewer's case: an 87-token prompt, `prefill_chunk_size=16` (pieces 16 x 5 and 7), SnapKV budget 16
    window 4, 16 new tokens: the unchunked run's tokens, bytes and 31 tokens kept per layer (16 chosen at the
    prompt's end, then 15 decode steps), not the 102 every token held without the fix.

    Mutation (applied, fails): `begin_step(..., more)` always passed False -> each layer keeps 102 tokens, and
    the tokens differ."""
    words = (
        "The locker code is 4127. Keys and values of a layer are projections of its input, so a cache may keep "
        "the input and rebuild them when attention needs them again, at their original positions. "
    ) * 3
    ids = torch.tensor([smollm2.tokenizer.encode(words)[:87]])
    assert ids.shape[1] == 87
    runs = []
    for chunk in (None, 16):
        with strategy_cache(smollm2.model, "snapkv:budget=16:window=4") as cache:
            out = smollm2.model.generate(
                ids,
                cache=cache,
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
                prefill_chunk_size=chunk,
            )
        kept = [layer.keys.shape[-2] for layer in cache.layers]
        runs.append((out[0, 87:].tolist(), cache.report()["bytes"]["held_last"], kept))
    assert runs[1] == runs[0]
    assert runs[0][2] == [31] * smollm2.model.config.num_hidden_layers


def test_a_prompt_fed_in_pieces_leaves_the_turns_as_the_whole_prompt_does():
    """A 33-token prompt in pieces of 8 (the last one a single token) with no decode step (`max_new_tokens=1`),
    then a direct forward of several tokens, then a generate call whose prompt has several new tokens: as with the
    whole prompt, the direct forward continues the turn and the generate call starts the second; SnapKV (which
    compresses a turn's prompt and grows after it) gives the same tokens and holds the same bytes either way.

    Mutations (each applied, each fails): after the last piece, `led.decoding = q == 1` (that piece's size, not
    the prompt's) -> the direct forward starts a turn of its own (turns 1, 2, 3); a generate call's prompt a turn
    only after one-token steps (`starts = first and (not led.forwards or (led.prompt_total > 1 and
    led.decoding))`, the direct forwards' rule) -> the last prompt continues the first turn, so SnapKV compresses
    it when fed in pieces (its last piece) and not when whole: the tokens differ."""
    loaded = tiny("tiny-llama")
    model = loaded.model
    tokens = loaded.tokenizer.encode(
        "Keys and values of a layer are projections of its input, so a cache may keep "
        "the input. Why do keys need positions?"
    )
    first, more, second = (torch.tensor([tokens[a:b]]) for a, b in ((0, 33), (33, 40), (40, 52)))
    runs = []
    for chunk in (None, 8):
        greedy = dict(do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)
        with torch.no_grad(), strategy_cache(model, "snapkv:budget=6") as cache:
            out = model.generate(first, cache=cache, max_new_tokens=1, **greedy)
            turns = [cache.report()["turns"]]
            token = model(torch.cat([out[:, -1:], more], dim=1), cache=cache).logits[0, -1].argmax().view(1, 1)
            turns.append(cache.report()["turns"])
            conversation = torch.cat([out, more, token, second], dim=1)
            out2 = model.generate(conversation, cache=cache, max_new_tokens=4, min_new_tokens=4, **greedy)
            turns.append(cache.report()["turns"])
        runs.append((turns, out2[0, conversation.shape[1] :].tolist(), _held(cache)))
    assert runs[1] == runs[0]
    assert runs[0][0] == [1, 1, 2]


def test_a_padded_prompt_fed_in_pieces_is_refused_before_its_first_piece():
    """`generate(..., attention_mask=<a 0 at token 20>, prefill_chunk_size=8)`: refused with the padding line before
    any piece reaches the cache, as the whole prompt is; the conversation then goes on, DynamicCache's tokens.

    Mutation (applied, fails): no `_check_mask` of the whole prompt in the `_prefill` wrapper -> pieces 0-7 and 8-15
    go through before the third is refused, and the cache is out of step."""
    loaded = tiny("tiny-llama")
    model = loaded.model
    tokens = loaded.tokenizer.encode("Keys and values of a layer are projections of its input, so a cache may keep.")
    ids = torch.tensor([tokens[:33]])
    mask = torch.ones_like(ids)
    mask[0, 20] = 0
    greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, prefill_chunk_size=8)
    reference = model.generate(ids, cache=compat.DynamicCache(config=model.config), **greedy)
    with strategy_cache(model, "full") as cache:
        with pytest.raises(UnsupportedCall, match="attention_mask must be all ones") as info:
            model.generate(ids, attention_mask=mask, cache=cache, **greedy)
        _one_line(info)
        assert cache.report()["forwards"] == 0
        assert torch.equal(model.generate(ids, cache=cache, **greedy), reference)


@pytest.mark.parametrize("off", [1, -1])
def test_a_prefill_that_feeds_other_than_its_prompt_is_refused(off, monkeypatch):
    """Should transformers' prefill feed other than the prompt tokens `_prompt_tokens` counts (a later release slicing
    its prompt otherwise; here the count made one too many, or one too few): one line, and the cache, whose layers
    still wait for a last piece, refuses every later forward.

    Mutations (each applied, each fails): no `if left:` check after the prefill -> one too many: generate returns
    with the prompt left open; no `q > led.prompt_left` check in `before` -> one too few: the last piece runs on
    the cache (and the check after the prefill says so instead)."""
    from kvdirect_app.engine import cache_hooks as module

    counted = module._prompt_tokens
    monkeypatch.setattr(module, "_prompt_tokens", lambda *args: counted(*args) + off)
    loaded = tiny("tiny-llama")
    model = loaded.model
    tokens = loaded.tokenizer.encode("Keys and values of a layer are projections of its input, so a cache may keep.")
    ids = torch.tensor([tokens[:33]])
    says = "fed 33 of its prompt's 34 tokens" if off > 0 else "fed a forward of 1 tokens where its prompt had 0 of 32"
    with torch.no_grad(), strategy_cache(model, "h2o:budget=6") as cache:
        with pytest.raises(UnsupportedCall, match=says) as info:
            model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0, prefill_chunk_size=8)
        _one_line(info)
        assert cache.report()["forwards"] == (5 if off > 0 else 4)
        with pytest.raises(UnsupportedCall, match="out of step") as info:
            model(ids[:, :1], cache=cache)
        _one_line(info)


@pytest.mark.parametrize("option", ["prompt_lookup_num_tokens", "assistant_model", "assistant_early_exit"])
def test_assisted_decoding_is_refused_before_the_cache_changes(option):
    """Assisted decoding (an assistant model, prompt lookup, early exit) would feed the draft tokens into the cache
    and crop the rejected ones: refused with one line before the first forward, and the conversation goes on on the
    same cache with DynamicCache's tokens.

    Mutation (applied, fails): `GenerateCache.activate_past_recording` not overridden -> the prompt and the draft
    tokens go through the cache, then transformers raises its own ValueError (not croppable) after the forward."""
    loaded = tiny("tiny-llama")
    model = loaded.model
    first = _ids(loaded, "Tell me about caches. Tell me about caches.")
    value = {"prompt_lookup_num_tokens": 3, "assistant_model": model, "assistant_early_exit": 1}[option]
    greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    reference = model.generate(first, **greedy)
    with strategy_cache(model, "full") as cache:
        with pytest.raises(UnsupportedCall, match="assisted decoding") as info:
            model.generate(first, cache=cache, **greedy, **{option: value})
        _one_line(info)
        assert cache.report()["forwards"] == 0 and cache.get_seq_length() == 0
        assert torch.equal(model.generate(first, cache=cache, **greedy), reference)


def test_paged_generation_is_refused_instead_of_ignoring_the_cache():
    """`generate(..., cache=cache, cache_implementation="paged")` switches to continuous batching, which runs a
    paged cache of its own and would ignore the strategy cache (0 forwards, the full cache's tokens): refused with
    one line, the cache untouched.

    Mutation (applied, fails): no `generate_batch` wrapper -> generate returns the paged run's tokens and the cache
    saw nothing."""
    loaded = tiny("tiny-llama")
    model = loaded.model
    with strategy_cache(model, "h2o:budget=6") as cache:
        with pytest.raises(UnsupportedCall, match="paged") as info:
            model.generate(
                _ids(loaded, "Tell me about caches."),
                cache=cache,
                cache_implementation="paged",
                max_new_tokens=2,
                do_sample=False,
                pad_token_id=0,
            )
        _one_line(info)
        assert cache.report()["forwards"] == 0
    assert "generate_batch" not in vars(model)


QUESTION_AFTER = ("snapkv:budget=12", "tova:budget=12", "knorm:budget=12", "streaming_llm:budget=12", "h2o:budget=12")


def _kept(cache) -> list:
    return [None if getattr(layer, "positions", None) is None else layer.positions.tolist() for layer in cache.layers]


@pytest.mark.parametrize("spec", QUESTION_AFTER)
def test_question_after_through_generate_keeps_what_the_engines_question_after_keeps(spec):
    """kvpress's setting in the library: the context (one forward) compressed, then `generate` with the context and
    the question reads the question and the answer with nothing evicted.  The engine's `turn(ids=context,
    question=...)` (what `bench tasks --question after` runs) on the same ids, native kernels, one lane: the same
    answer tokens and the same positions kept in every layer and KV head.  Without `question_after` the question
    is evicted from too (the kept positions differ).  Mutation that fails it: `keep` never set in the hooks."""
    loaded = tiny("tiny-llama")
    g = torch.Generator().manual_seed(55)
    vocab = loaded.model.config.vocab_size
    context = torch.randint(4, vocab, (40,), generator=g).tolist()
    question = torch.randint(4, vocab, (6,), generator=g).tolist()
    new = 5
    engine = Engine(loaded, [parse_spec("full"), parse_spec(spec)], max_new_tokens=new, kernels="native", twins=False)
    for _ in engine.turn("(context)", ids=context, question=question):
        pass
    lane = next(lane for lane in engine.lanes if lane.label == parse_spec(spec).label)
    want_tokens, want_kept = engine.results()["strategies"][lane.label]["turn_token_ids"][0], _kept(lane.cache)
    runs = {}
    for after in (True, False):
        with strategy_cache(loaded.model, spec, question_after=after) as cache:
            loaded.model(torch.tensor([context]), cache=cache)
            ids = torch.tensor([context + question])
            out = loaded.model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False, min_new_tokens=new)
        runs[after] = (out[0, ids.shape[1] :].tolist(), _kept(cache), cache.report())
    tokens, kept, report = runs[True]
    assert tokens == want_tokens[: len(tokens)] and len(tokens) == new, (spec, tokens, want_tokens)
    assert kept == want_kept, spec
    assert report["turns"] == 1 and report["bytes"]["declared_matches_formula"], report
    assert runs[False][1] != want_kept, spec
