"""Numbers the engine reports that must not depend on how the run was fed or who else ran beside a lane.

* every latency row of every lane has the same ops, batched or alone (a lane decoding on alone after the
  reference's reply ended used to have rows without `shared`: the Recall demo's KeyError);
* the shared pass is charged by rows (1/N to each lane's or twin's row); teacher-forced twins ride in the
  lanes' pass and their rows are the measurement's; a step's wall time is the lanes' own time, the
  instruments' time and the unattributed rest;
* a prompt fed in pieces keeps the same tokens and bytes whatever the piece size, for every strategy;
* a teacher-forced twin copies the cache's state, never the model.
"""

import pytest
import torch

from kvdirect_app.engine import guard
from kvdirect_app.engine.runner import Engine, run_to_end
from kvdirect_app.measure.observe import Owner
from kvdirect_app.measure.timing import OPS
from kvdirect_app.plain import rss
from kvdirect_app.strategies import parse_spec, parse_specs
from kvdirect_app.strategies.anchorkv import AnchorCache

from ..conftest import tiny
from ..specs import every

TURNS = ["Tell me about caches.", "Why do keys need positions?"]
# Every strategy (tests/specs.py: one not named here joins at budget 6).
EVERY = ",".join(
    every(
        (
            "full",
            "kvdirect:budget=4",
            "anchorkv:spacing=2:budget=4:rebuild=step",
            "anchorkv:spacing=3:budget=4",
            "window:budget=6",
            "streaming_llm:budget=8",
            "h2o:budget=8",
            "snapkv:budget=16:window=4",
            "tova:budget=6",
            "knorm:budget=6",
            "pyramidkv:budget=16:window=4",
        ),
        budget=6,
    )
)


def _events(loaded, specs, **options):
    engine = Engine(loaded, parse_specs(specs), threads=1, **options)
    return engine, list(engine.run(TURNS))


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "sequential"])
def test_every_latency_row_of_every_lane_has_the_same_ops(batch):
    """In turn 2 a diverged lane's prompt (its own earlier reply) has another length than the reference's: it is
    fed in a pass of its own, alone.  Its rows must carry the same ops as the batched ones."""
    engine, events = _events(
        tiny("tiny-llama"), "full,window:budget=4,kvdirect:budget=4", max_new_tokens=6, batch=batch
    )
    rows = [ev["latency_ms"] for e in events if e["type"] == "step" for ev in e["lanes"].values()]
    assert rows and all(set(row) == {*OPS, "total"} for row in rows)
    assert all(row["total"] == pytest.approx(sum(row[op] for op in OPS)) for row in rows)
    result = events[-1]["result"]
    for label, r in result["strategies"].items():
        assert {f"decode_{op}_ms_mean" for op in (*OPS, "total")} <= set(r["latency_ms"]), label
    # The lossy lane's second prompt differs from the reference's: it went through a pass of its own.
    window = next(lane for lane in engine.lanes if lane.label == "window:budget=4")
    full_chunks = engine.turn_chunks
    assert window.diverged and len(full_chunks) == 2


def test_a_step_adds_up_lanes_charged_by_rows_twins_and_instruments_apart():
    """Checked against what the model was actually called with, timed by the test's own hooks, not by restating
    forwards.py's arithmetic: hooks on the model count the rows of every pass (`input_ids`' batch dimension) and
    time the call from outside; the test's own clock times each advance of the run.

    * every decode step is one pass of the model, whose rows are the fed lanes plus one teacher-forced twin per
      lane that has diverged from the reference (counted from the tokens the events show): twins ride in the
      lanes' pass;
    * each fed lane is charged the pass's shared rest divided by the rows the model actually ran (twins
      included);
    * the unattributed rest is not negative: the parts are disjoint stretches of one clock (where each part's
      own figure lands is `tests/measure/test_instruments.py`'s delay injection).

    Mutations that fail it: the shared pass charged to its rows twice (`obs.charge` called twice per row) leaves
    a negative rest; the shared pass divided among the lanes only (`shared / len(lanes)`) breaks the per-row
    charge."""
    loaded = tiny("tiny-llama")
    engine = Engine(
        loaded, parse_specs("full,window:budget=4,tova:budget=4,kvdirect:budget=4"), max_new_tokens=8, threads=1
    )
    calls = []  # every call of the model: rows and tokens per row

    def before(module, args, kwargs):
        calls.append({"rows": kwargs["input_ids"].shape[0], "q": kwargs["input_ids"].shape[1]})

    hook = loaded.model.register_forward_pre_hook(before, with_kwargs=True)
    steps = []
    try:
        run = engine.run(TURNS[:1])
        while True:
            first_call, first_pass = len(calls), len(engine.forwards.shared_ms)
            event = next(run, None)
            if event is None:
                break
            if event["type"] == "step":
                steps.append((event, calls[first_call:], engine.forwards.shared_ms[first_pass:]))
    finally:
        hook.remove()
    result = engine.results()
    assert result["steps"]["measurement_by_instrument_ms_mean"]["twins"] > 0
    ref_tokens, diverged, checked = [], set(), 0
    for event, step_calls, shared_ms in steps:
        lanes = event["lanes"]
        ref_tokens.append(lanes["full"]["token_id"])
        # A lane whose token differs from the reference's at this index or before has left its history: a twin.
        diverged |= {label for label, ev in lanes.items() if ev["token_id"] != ref_tokens[event["index"]]}
        fed = [label for label, ev in lanes.items() if ev["fed"]]
        assert event["unattributed_ms"] >= -1e-6, (event["index"], event["unattributed_ms"])
        decode = [c for c in step_calls if c["q"] == 1]
        if not fed:  # every lane's reply ended: nothing fed, no pass
            assert not decode and not shared_ms
            continue
        assert len(decode) == 1 and len(shared_ms) == 1, event["index"]  # one pass, twins in it
        call, shared = decode[0], shared_ms[0]
        twins = len(diverged) if lanes["full"]["fed"] else 0
        assert call["rows"] == len(fed) + twins, (event["index"], fed, diverged)
        assert shared > 0, event["index"]
        for label in fed:
            assert lanes[label]["latency_ms"]["shared"] == pytest.approx(shared / call["rows"]), (event["index"], label)
        checked += bool(twins)
    assert checked >= 3, "fewer than three steps with a twin in the pass"


def _kept(engine):
    """Per lane: every layer's token states (what each layer keeps of each token)."""
    return {lane.label: [layer.token_states() for layer in lane.cache.layers] for lane in engine.all_lanes}


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma2"])
def test_a_prompt_fed_in_pieces_keeps_the_same_tokens_and_bytes_whatever_the_piece_size(family):
    """SnapKV used to compress only the first piece of a long prompt (the rest counted as decoding); every
    eviction strategy trimmed after each piece.  A prompt is one prefill: kept tokens, bytes and replies are the
    same for pieces of 7 tokens and for one piece."""
    loaded = tiny(family)
    prompt = "A long message about caches, residual streams and anchors, read in pieces. " * 2
    runs = {}
    for chunk in (7, 1024):
        engine = Engine(loaded, parse_specs(EVERY), max_new_tokens=5, threads=1, prefill_chunk=chunk)
        result = run_to_end(engine, [prompt, "Summarise that."])
        runs[chunk] = (result, _kept(engine))
    (small, kept_small), (whole, kept_whole) = runs[7], runs[1024]
    assert len(small["prompt_ids"]) > 100
    for label, r in whole["strategies"].items():
        s = small["strategies"][label]
        assert s["token_ids"] == r["token_ids"], label
        assert [t["between_turns"] for t in s["turns"]] == [t["between_turns"] for t in r["turns"]], label
        assert [t["formula_between_turns"] for t in s["turns"]] == [t["formula_between_turns"] for t in r["turns"]]
        assert s["state_bytes"]["formula_matches_measurement"] and r["state_bytes"]["formula_matches_measurement"]
        assert kept_small[label] == kept_whole[label], label
    snap = whole["strategies"]["snapkv:budget=16:window=4"]
    assert snap["turns"][0]["between_turns"] < whole["strategies"]["full"]["turns"][0]["between_turns"] / 3


def test_the_guard_bounds_a_prompt_fed_in_pieces():
    """The memory guard's estimate for every strategy with small pieces is at least what the allocator measured
    (a prompt's pieces are held until its last one: the estimate must know it)."""
    loaded = tiny("tiny-llama")
    prompt = "A long message about caches, residual streams and anchors, read in pieces. " * 2
    engine = Engine(loaded, parse_specs(EVERY), max_new_tokens=5, threads=1, prefill_chunk=16, twins=False)
    result = run_to_end(engine, [prompt])
    est = guard.estimate(
        loaded.config,
        loaded.dtype,
        parse_specs(EVERY),
        len(result["prompt_ids"]),
        len(result["prompt_ids"]) + 5,
        16,
        twins=False,
    )
    for label, r in result["strategies"].items():
        assert est.lanes[label] >= r["state_bytes"]["peak"], label


def _anchor_cache_after_a_turn(loaded, spec, **options):
    engine = Engine(loaded, parse_specs(f"full,{spec}"), max_new_tokens=4, threads=1, **options)
    run_to_end(engine, ["Tell me about caches."])
    return engine, engine.lanes[0]


def test_a_twin_shares_every_model_side_object_and_copies_the_state():
    loaded = tiny("tiny-llama")
    engine, lane = _anchor_cache_after_a_turn(loaded, "anchorkv:spacing=2:budget=3:mode=fast")
    cache = lane.cache
    assert isinstance(cache, AnchorCache)
    owner = Owner("twin under test", "twin")
    engine.observer.register(owner)
    with engine.observer.region(owner, "fork"):
        twin = cache.fork()
    assert twin.store.replayer.model is loaded.model and twin.store.replayer.layers is cache.store.replayer.layers
    assert twin.store is not cache.store and twin.store.token_ids is not cache.store.token_ids
    assert torch.equal(twin.store.token_ids, cache.store.token_ids)
    model_tensors = {id(p) for p in loaded.model.parameters()}
    assert not model_tensors - {id(p) for p in twin.store.replayer.model.parameters()}
    # What the allocator saw the fork allocate is the twin's state, nothing more (no weight was copied).
    assert engine.observer.held(owner) == engine.observer.declared(twin) > 0


def test_a_twin_on_smollm2_does_not_grow_rss_by_the_model(smollm2):
    engine, lane = _anchor_cache_after_a_turn(smollm2, "anchorkv:spacing=30:budget=4:mode=fast")
    weights = sum(p.numel() * p.element_size() for p in smollm2.model.parameters())
    rss.trim()
    before = rss.rss()
    twins = [lane.cache.fork() for _ in range(3)]
    grown = rss.rss() - before
    assert grown < weights / 4, (grown, weights)
    assert all(t.store.replayer.model is smollm2.model for t in twins)


def test_model_side_finds_the_model_however_deep_and_nothing_of_the_cache():
    """`model_side` finds the model's modules however deep and leaves the cache's own tensors to be copied."""
    from kvdirect_app.strategies.base import model_side

    loaded = tiny("tiny-llama")
    cache = parse_spec("anchorkv:spacing=2:budget=3").build_cache(loaded.model)
    found = model_side(cache, loaded.model)
    assert id(loaded.model) in found and id(loaded.model.config) in found
    assert all(id(p) in found for p in loaded.model.parameters())
    assert id(cache.store) not in found


class _Counter(torch.nn.Module):
    """A strategy's own module, its state in a buffer (what `fork` must copy, never share)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(1))


def test_a_twin_copies_a_strategys_own_module_and_shares_only_the_models():
    """`fork()` promises the copy its own state: a module the strategy made (a buffer it updates) is the twin's own,
    while the model's modules stay shared.  (Sharing every module the cache reaches, as before, fails it.)"""
    loaded = tiny("tiny-llama")
    engine, lane = _anchor_cache_after_a_turn(loaded, "window:budget=4")
    cache = lane.cache
    cache.counter = _Counter()
    cache.layer0 = loaded.model.model.layers[0]  # a model module held by the cache: shared, not copied
    twin = cache.fork()
    assert twin.counter is not cache.counter and twin.counter.seen is not cache.counter.seen
    cache.counter.seen += 3
    assert twin.counter.seen.item() == 0
    assert twin.layer0 is cache.layer0


@pytest.mark.parametrize("kernels", ["invariant", "native"])
def test_an_engine_leaves_the_process_thread_count_as_it_found_it(kernels):
    """torch's thread count is the process's: an engine at another count pins it for its own work only (building
    it, a turn), and gives it back, so a run beside it (the page's compare endpoint and a test's own engine, a
    process pool's cells and the run in this process) starts from what the process had."""
    before = torch.get_num_threads()
    other = 2 if before != 2 else 1
    engine = Engine(
        tiny("tiny-llama"), parse_specs("full,kvdirect:budget=2"), max_new_tokens=3, threads=other, kernels=kernels
    )
    assert torch.get_num_threads() == before
    result = run_to_end(engine, TURNS[:1])
    assert torch.get_num_threads() == before and result["threads"] == other
