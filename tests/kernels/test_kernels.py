"""Batch-invariant kernels (`--kernels invariant`): the probe, the block attention, and exactness that no longer
depends on how rows were grouped or on the thread count.

Each equality below can fail: the mutation tests raise rows to a count the probe rejected, or hand the
block attention one key more, and the same checks then see other bits."""

import json
import math
import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvdirect_app.engine.runner import Engine, InputError, run_to_end
from kvdirect_app.kernels import invariant as K
from kvdirect_app.kernels import probes
from kvdirect_app.models import probe_verdicts
from kvdirect_app.models.threads import threads_set
from kvdirect_app.plain.errors import UserError
from kvdirect_app.strategies import parse_specs

from ..runs import ANCHORKV_EXTRA, KVDIRECT_LANES, TINY_FAMILIES, all_sliding, run_once, tiny, tiny_union
from ..runs import TINY_TURNS as TURNS
from ..strategies.test_smollm2 import SMOL_EXACT, SMOL_TURNS, smollm2_run

# Lanes of the union run (tests/runs.py): its one-thread half of the comparisons below.
EXACT = "full,kvdirect:budget=4,anchorkv:spacing=2:budget=3:rebuild=step"


def _run(loaded, specs=EXACT, max_new=8, turns=TURNS, **kw):
    return run_to_end(Engine(loaded, parse_specs(specs), max_new_tokens=max_new, **kw), turns)


def _shared(loaded, **kw) -> dict:
    """EXACT over the tiny conversation, made once per process (tests/runs.py)."""
    return run_once(loaded, EXACT, **kw).result


def _exact(result, specs=EXACT):
    ref = result["strategies"]["full"]
    for spec in specs.split(",")[1:]:
        r = result["strategies"][spec]
        assert r["token_ids"] == ref["token_ids"], spec
        assert r["kv_exact"] is True and r["rebuilt_token_layers"] > 0, spec
        assert r["max_abs_dk"] == 0.0 and r["max_abs_dv"] == 0.0, spec  # every K/V handed attention, every step


# --- the probe -------------------------------------------------------------------------------------------
def test_probe_counts_are_what_it_says_on_fresh_data():
    """(The probed GEMMs, the linears off the CPU, run here on the CPU's `F.linear`.)  Every count the probe proved
    gives a large call's rows on other weights and inputs than its own, at other offsets; a count above the
    largest proven one is refused, never used unproven."""
    torch.manual_seed(7)
    weight, bias = torch.randn(192, 96), torch.randn(192)
    verdict = probes.probe_linear(weight, bias, torch.get_num_threads())
    assert verdict.counts and set(verdict.counts) | set(verdict.failed) == set(probes.candidates_of(verdict.key))
    x = torch.randn(probes.ROWS[-1] + 20, 96)
    ref = F.linear(x, weight, bias)
    for m in verdict.counts:
        assert torch.equal(F.linear(x[3 : 3 + m], weight, bias), ref[3 : 3 + m]), m
    for m in range(1, verdict.largest + 1):
        padded = verdict.pad(m)
        assert padded >= m and padded in verdict.counts
    with pytest.raises(ValueError, match="no proven count holds it"):
        verdict.pad(verdict.largest + 1)


def test_kernels_linear_is_row_invariant_whatever_the_row_count_and_thread_count():
    """`Kernels.linear` (the fixed-order linears on the CPU) gives every row the same bits in a call of 1, 2, 3, 7,
    100 or 700 rows, at 1, 2 or 3 threads.  The probed GEMMs (the path off the CPU, built here by hand on the CPU's
    `F.linear`) refuse a thread count their verdicts were not proven for, and a shape never probed."""
    loaded = tiny("tiny-llama")
    kernels = K.Kernels.for_model(loaded, "invariant", torch.get_num_threads())
    assert kernels.invariant and kernels.dots is not None, kernels.reason
    lin = next(m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear))
    x = torch.randn(700, lin.in_features)
    with torch.inference_mode():
        ref = kernels.linear(x, lin.weight, lin.bias)
        for threads in (1, 2, 3):
            with threads_set(threads):
                for m in (1, 2, 3, 7, 100, 700):
                    assert torch.equal(kernels.linear(x[5 : 5 + m], lin.weight, lin.bias), ref[5 : 5 + m]), (threads, m)
        probed = K.Kernels("invariant", torch.get_num_threads(), store=loaded.probes)
        verdict = probes.probe_linear(lin.weight, lin.bias, probed.threads)
        probed.linears[(tuple(lin.weight.shape), lin.bias is not None)] = verdict
        assert torch.equal(probed.linear(x[:3], lin.weight, lin.bias), F.linear(x, lin.weight, lin.bias)[:3])
        with threads_set(torch.get_num_threads() + 1), pytest.raises(RuntimeError, match="pin the threads"):
            probed.linear(x[:3], lin.weight, lin.bias)
        with pytest.raises(RuntimeError, match="not probed"):
            probed.linear(x[:3], torch.randn(5, lin.in_features), None)


def test_the_probe_checks_every_rmsnorm_and_a_row_wise_reduction_that_is_not_fails():
    """The model's norms are probed (a row alone against the same row among 300); a module whose reduction
    depends on the call (here: a mean over the whole call's rows mixed into each row) fails the probe."""
    loaded = tiny("tiny-qwen3")  # input norms and per-head q/k norms
    K.Kernels.for_model(loaded, "invariant", 1)
    probed = {k[1:3] for k in loaded.probes.verdicts if k[0] == "rows"}
    norms = {
        (type(m).__name__, tuple(m.weight.shape))
        for m in loaded.model.modules()
        if type(m).__name__.endswith("RMSNorm")
    }
    assert norms and probed == norms

    class CallMean(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(dim=-2, keepdim=True)

    ok, why = probes.probe_rows(CallMean(), 16, torch.float32, "cpu", 1)
    assert not ok and "row 0 alone differs" in why


def test_the_fixed_order_kernels_are_checked_at_every_start_and_nothing_is_kept_on_disk(tmp_path, monkeypatch):
    """On the CPU the linears and the attention are the fixed-order kernels: their checks run at every start (each
    input width, each attention geometry, each norm) and nothing is written to the probe store, which keeps only the
    probed GEMMs' verdicts of the kernels off the CPU (its file is tested in tests/kernels/test_probes.py).
    Mutation that fails it: the dots checks stored with keep=True (a file appears, and a later start would trust it)."""
    monkeypatch.setenv(probe_verdicts.CACHE_ENV, str(tmp_path))
    loaded = tiny("tiny-llama")
    for _ in range(2):
        store = probe_verdicts.Store(loaded.name, loaded.dtype, loaded.device)
        kernels = K.Kernels.for_model(
            SimpleNamespace(model=loaded.model, device=loaded.device, dtype=loaded.dtype, probes=store), "invariant", 1
        )
        report = kernels.report()
        assert kernels.invariant and report["dots_path"] and report["dots_checks"], report["reason"]
        assert all(c["same_bits"] for c in report["dots_checks"]) and store.confirmed == 0
        assert not any(tmp_path.rglob("*.json")), list(tmp_path.rglob("*"))


def test_unknown_kernels_get_their_message():
    with pytest.raises(UserError, match="kernels: 'turbo' is not allowed; allowed: invariant, native"):
        Engine(tiny("tiny-llama"), parse_specs("full"), kernels="turbo")


# --- the block attention ---------------------------------------------------------------------------------
def _qkv(heads=4, kv_heads=2, t=200, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(heads, t, d, generator=g),
        torch.randn(kv_heads, t, d, generator=g),
        torch.randn(kv_heads, t, d, generator=g),
    )


@pytest.mark.parametrize("window", [None, 50])
def test_block_attention_is_causal_attention(window):
    q, k, v = _qkv()
    t, d = q.shape[1], q.shape[2]
    got = K.block_attention(q, k, v, t, d**-0.5, window=window)  # (t, H, d)
    pos = torch.arange(t)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), attn_mask=allowed)
    assert torch.allclose(got.transpose(0, 1), ref, atol=1e-5, rtol=1e-5)


def test_block_attention_softcap_is_the_capped_scores():
    q, k, v = _qkv(t=70)
    t, d = q.shape[1], q.shape[2]
    got = K.block_attention(q, k, v, t, d**-0.5, softcap=5.0)
    scores = torch.matmul(q, k.repeat_interleave(2, 0).transpose(1, 2)) * d**-0.5
    scores = torch.tanh(scores / 5.0) * 5.0
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    ref = torch.softmax(scores, -1) @ v.repeat_interleave(2, 0)
    assert torch.allclose(got.transpose(0, 1), ref, atol=1e-5, rtol=1e-5)


def test_a_query_has_the_same_bits_alone_and_in_a_prompt():
    """Each lane's decode query is its own block-attention call: its bits are those of the same query inside a
    prompt's call, whatever the key count and block offset."""
    q, k, v = _qkv()
    t, scale = q.shape[1], q.shape[2] ** -0.5
    rows = probes.probe_attention_rows(q.shape[2], q.dtype, q.device)
    whole = K.block_attention(q, k, v, t, scale, rows=rows)
    for e in [1, 63, 64, 65, 129, 200]:
        alone = K.block_attention(q[:, e - 1 : e], k[:, :e], v[:, :e], e, scale, rows=rows)
        assert torch.equal(alone[0], whole[e - 1]), e
    # The check can fail: the same query over one key more (a dropped mask) has other bits.
    more = K.block_attention(q[:, 99:100], k[:, :101], v[:, :101], 101, scale, rows=rows)
    assert not torch.equal(more[0], whole[99])


def _probe_cases(threads: int, rounds: int) -> list[str]:
    """The attention probe's cases (SmolLM2's geometry), `rounds` times over, in this process; what differed."""
    attention = K.Kernels("invariant", threads)
    attention.store = probe_verdicts.Store("cases", torch.float32, "cpu")
    failures = []
    for _ in range(rounds):
        ok, why = probes.probe_attention(attention.attention, 9, 3, 64, torch.float32, "cpu", threads)
        if not ok:
            failures.append(why)
    return failures


def test_the_attention_probe_repeated_200_times_at_two_threads_under_load_never_varies(monkeypatch):
    """The block attention's reductions run on one thread in an order fixed by the shapes: its probe's cases,
    200 times at 2 threads with twice as many busy processes as cores, see no variation (on a CPU where a
    reduction's split followed the scheduling, some of these would differ)."""
    monkeypatch.setenv(probe_verdicts.CACHE_ENV, "off")
    stop = multiprocessing.Event()
    busy = [multiprocessing.Process(target=_busy, args=(stop,), daemon=True) for _ in range(2 * (os.cpu_count() or 2))]
    for b in busy:
        b.start()
    try:
        failures = _probe_cases(2, 200)
    finally:
        stop.set()
        for b in busy:
            b.join(timeout=10)
    assert not failures, failures[:3]


def _busy(stop):
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def test_sdpa_would_not_pass_the_same_check():
    """Why the block attention exists: here the model's own attention gives a query other bits alone than in a
    causal call over all positions (if a CPU ever made them equal, this test says so and can be dropped)."""
    q, k, v = _qkv(heads=2, kv_heads=2, t=300, d=64)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    differ = sum(
        not torch.equal(
            F.scaled_dot_product_attention(q[:, p : p + 1], k[:, : p + 1], v[:, : p + 1])[:, 0], whole[:, p]
        )
        for p in range(0, 300, 7)
    )
    assert differ > 0


# --- exactness in runs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_digests_are_the_same_at_one_and_two_threads(family):
    one, two = tiny_union(family).result, _shared(tiny(family), threads=2, kernels="invariant")
    for result in (one, two):
        assert result["kernels"]["mode"] == "invariant", result["kernels"]["reason"]
        _exact(result)
    assert one["threads"] == 1 and two["threads"] == 2
    for spec in EXACT.split(","):
        assert one["strategies"][spec]["kv_digest"] == two["strategies"][spec]["kv_digest"], spec
        assert one["strategies"][spec]["token_ids"] == two["strategies"][spec]["token_ids"], spec


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rebuilt_at_one_thread_what_two_threads_computed(dtype):
    """Turn 1 runs at 2 threads; then every rebuild and replay (KV-Direct's recompute, AnchorKV's replay, a
    parked session's resume) runs at 1 thread over K/V that 2 threads computed: still bit-equal."""
    loaded = tiny("tiny-llama", dtype)
    specs = EXACT + ",anchorkv:spacing=3:budget=2:rebuild=turn"
    engine = Engine(loaded, parse_specs(specs), max_new_tokens=8, threads=2)
    for _ in engine.turn(TURNS[0]):
        pass
    engine.park()
    engine.set_threads(1)
    for _ in engine.turn(TURNS[1]):
        pass
    result = engine.results()
    assert result["threads"] == 1 and result["kernels"]["mode"] == "invariant"
    _exact(result, specs)


def test_set_threads_runs_on_verdicts_proven_at_the_new_count():
    """After `set_threads(1)` the kernels are checked at 1 thread and are the ones used everywhere, in the forwards,
    the rebuilds and the replays (one `Kernels`, the new one).  Mutation (the code before): the thread count
    overwritten on the old kernels, whose checks ran at 2 threads."""
    engine = Engine(tiny("tiny-llama"), parse_specs(EXACT), max_new_tokens=2, threads=2)
    assert {c["threads"] for c in engine.kernels.report()["dots_checks"]} == {2}
    for _ in engine.turn(TURNS[0]):
        pass
    engine.set_threads(1)
    assert engine.kernels.threads == 1 and {c["threads"] for c in engine.kernels.report()["dots_checks"]} == {1}
    assert engine.forwards.kernels is engine.kernels
    assert all(lane.cache.kernels is engine.kernels for lane in engine.all_lanes)
    for _ in engine.turn(TURNS[1]):
        pass
    _exact(engine.results(), EXACT)


def test_set_threads_refuses_bad_counts():
    engine = Engine(tiny("tiny-llama"), parse_specs("full"), max_new_tokens=2, threads=1)
    with pytest.raises(InputError, match="threads: 0 must be >= 1"):
        engine.set_threads(0)


@pytest.mark.parametrize("kernels", ["invariant", "native"])
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma2"])
def test_both_modes_are_exact_where_they_claim_it(family, kernels):
    result = _shared(tiny(family), threads=2, kernels=kernels)
    assert result["kernels"]["mode"] == kernels
    _exact(result)


# The native kernels (the fallback wherever the probe fails, and `--kernels native`): every exact lane, prompts fed
# in pieces of 3 tokens (each piece its own GEMM shape, repeated by the rebuild).
NATIVE_LANES = (
    ("full",)
    + KVDIRECT_LANES
    + ("anchorkv:spacing=2:budget=2:rebuild=step", "anchorkv:spacing=3:budget=3")
    + ANCHORKV_EXTRA
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_native_kernels_are_exact_on_every_family_with_prompts_in_pieces(family, dtype):
    loaded = tiny(family, dtype)
    run = run_once(loaded, NATIVE_LANES, threads=1, kernels="native", prefill_chunk=3)
    result = run.result
    assert result["kernels"]["mode"] == "native" and result["kernels"]["requested"] == "native"
    assert run.kinds.count("prefill") > 2 * run.kinds.count("turn")  # each prompt in several pieces
    ref = result["strategies"]["full"]
    slides = all_sliding(loaded)
    for spec in NATIVE_LANES[1:]:
        r = result["strategies"][spec]
        assert r["kernels"] == {"forward": "native", "rebuild": "native"}, spec
        assert r["token_ids"] == ref["token_ids"], spec
        assert r["kv_exact"] is True and r["max_abs_dk"] == 0.0 and r["max_abs_dv"] == 0.0, spec
        assert r["max_abs_dlogit"] == 0.0, spec
        assert (r["rebuilt_token_layers"] > 0) == ("budget=500" not in spec and not slides), spec


def test_native_falls_back_loudly_never_silently(monkeypatch, tmp_path):
    """A probe that fails means native kernels, with the reason in the run's JSON (the CLI and the page print
    `kernels.describe` of it); the failed verdict is not kept for the next start.  The probe file is this test's own
    (a machine whose cache holds none, or another's, must give the same answer)."""
    loaded = tiny("tiny-olmo2")
    monkeypatch.setattr(probes, "probe_attention", lambda *a, **k: (False, "one query differs (simulated)"))
    monkeypatch.setattr(loaded.probes, "path", tmp_path / "probes.json")
    loaded.probes.clear()
    try:
        result = _run(loaded, max_new=4, turns=TURNS[:1])
    finally:
        loaded.probes.clear()
    report = result["kernels"]
    assert report["requested"] == "invariant" and report["mode"] == "native"
    assert "simulated" in report["reason"]
    assert K.describe(report).startswith("kernels: NATIVE: the invariance probe failed here")
    path = loaded.probes.path
    stored = json.loads(path.read_text())["verdicts"] if path.is_file() else []
    assert not [e for e in stored if e["key"][0] == "block attention"]


def test_a_fixed_order_linear_that_breaks_its_order_fails_the_check_and_the_run_says_so(monkeypatch):
    """The check is what catches a broken build: fixed-order linears whose one-row calls round another way (here:
    torch's one-row GEMV for a single row) fail it, and the run uses the native kernels, with the reason.  A dtype
    the fixed-order kernels do not take (float16) is native too, said aloud."""
    from kvdirect_app.kernels import dots

    real = dots.linear

    def one_row_differs(x, weight, bias=None, name=None, threads=None):
        if x.reshape(-1, x.shape[-1]).shape[0] == 1:
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(weight.dtype)
        return real(x, weight, bias, name=name, threads=threads)

    monkeypatch.setattr(dots, "linear", one_row_differs)
    loaded = tiny("tiny-llama")
    loaded.probes.clear()
    try:
        kernels = K.Kernels.for_model(loaded, "invariant", 2)
    finally:
        loaded.probes.clear()
    assert kernels.mode == "native" and kernels.reason.startswith("fixed-order linears: 1 row(s) at row 0 differ")
    assert K.describe(kernels.report()).startswith("kernels: NATIVE: the invariance probe failed here: fixed-order")
    monkeypatch.undo()
    half = K.Kernels.for_model(tiny("tiny-llama", "float16"), "invariant", 1)
    assert half.mode == "native" and "float32 and bfloat16 weights, not float16" in half.reason


# --- the embedded model ----------------------------------------------------------------------------------
def test_smollm2_invariant_exact_and_an_unproven_row_count_breaks_it(smollm2, monkeypatch):
    """On SmolLM2 (the shared two-turn run of tests/strategies/test_smollm2.py): every exact lane bit-equal in
    invariant mode.
    Mutation: a decode step's rows computed by torch's one-row GEMV (another order than the fixed one) instead
    of the fixed-order linears, and the same run's rebuilt K/V (one call over all old tokens, in the fixed order)
    differ from what the forward handed attention."""
    result = smollm2_run(smollm2).result
    assert result["kernels"]["mode"] == "invariant"
    _exact(result, SMOL_EXACT)
    proven = K.Kernels.linear

    def one_row_calls(self, x, weight, bias):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > probes.ROWS[0]:  # a prompt or a rebuild: as proven
            return proven(self, x, weight, bias)
        out = torch.cat([F.linear(row, weight, bias) for row in rows.split(1)])
        return out.view(*x.shape[:-1], weight.shape[0])

    monkeypatch.setattr(K.Kernels, "linear", one_row_calls)
    broken = _run(smollm2, SMOL_EXACT, max_new=10, turns=SMOL_TURNS)
    assert broken["kernels"]["mode"] == "invariant"
    assert any(broken["strategies"][s]["kv_exact"] is False for s in SMOL_EXACT.split(",")[1:])


def test_smollm2_native_and_invariant_reference_say_the_same(smollm2):
    """The reference's kernels change its bits, not its reply: both modes give the same tokens here (the runs
    tests/strategies/test_smollm2.py compares with `generate`)."""
    a, b = (
        run_once(smollm2, "full", SMOL_TURNS[:1], 24, kernels=kernels).result for kernels in ("native", "invariant")
    )
    assert a["strategies"]["full"]["token_ids"] == b["strategies"]["full"]["token_ids"]
    assert a["strategies"]["full"]["kv_digest"] != b["strategies"]["full"]["kv_digest"]  # other bits, same answer


def test_a_replay_longer_than_one_call_is_exact():
    """Invariant replays take old tokens `REPLAY_ROWS` at a time (a bounded transient): a conversation longer
    than that is replayed in several calls per layer, with the bits of one."""
    from kvdirect_app.strategies.rebuild import REPLAY_ROWS, chunks_of

    assert chunks_of([], 150, rows=64) == [(0, 64), (64, 64), (128, 22)]
    result = _run(tiny("tiny-llama"), max_new=40)
    context = sum(map(len, result["turn_chunk_ids"])) + len(result["strategies"]["full"]["token_ids"])
    assert context > 2 * REPLAY_ROWS, context
    _exact(result)
