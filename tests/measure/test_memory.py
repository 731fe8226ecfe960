"""Bytes measured: the allocator's ledger (the default instrument) and the trace that audits it, mutations they
must catch, peaks they must bound; the ledger held to the trace on every strategy and family."""

import pytest
import torch

from kvdirect_app.engine.runner import Engine, run_to_end
from kvdirect_app.measure.memory import AllocationTracer, harness
from kvdirect_app.measure.observe import storage_sizes
from kvdirect_app.models import compat
from kvdirect_app.strategies import parse_specs
from kvdirect_app.strategies.anchorkv import AnchorCache
from kvdirect_app.strategies.kvdirect import ResidualLayer

from ..conftest import tiny
from ..runs import TINY_FAMILIES, tiny_union
from ..specs import every

TURNS = ["Tell me about caches.", "Why do keys need positions?"]


# --- the instrument ----------------------------------------------------------------------------------------------


def test_the_tracer_attributes_blocks_to_their_owner_and_follows_them_across_owners():
    tracer = AllocationTracer("cpu")
    held = {}
    with tracer.trace("a") as window:
        held["x"] = torch.zeros(1000, 100)  # 400,000 bytes kept
        y = torch.zeros(2000, 100)  # 800,000 bytes, freed inside the block
        del y
        with harness():
            scratch = torch.zeros(5000, 100)  # measurement work: nobody's
            del scratch
    assert tracer.live("a") == 400_000
    assert (window.start, window.end, window.peak) == (0, 400_000, 1_200_000)
    with tracer.trace("b") as other:
        del held["x"]  # a's block, freed while b runs
        held["z"] = torch.zeros(10)
    assert tracer.live("a") == 0 and tracer.live("b") == 40
    assert other.peak == 40  # a's free does not lower b's running total


def test_a_disabled_tracer_measures_nothing_and_says_so():
    tracer = AllocationTracer("cpu", enabled=False)
    with tracer.trace("a"):
        keep = torch.zeros(100)
    assert tracer.live("a") is None and keep.numel() == 100


# --- mutations: a hidden copy of K/V must show -------------------------------------------------------------------


def _stash_in_layer(layer, keys):
    layer.hidden_copy = keys.clone()


def _stash_in_model(layer, keys):
    compat.attention_module(compat.decoder_layers(MODEL[0])[0]).hidden_copy = keys.clone()


CLOSURE: list = []


def _stash_in_closure(layer, keys):
    CLOSURE[:] = [keys.clone()]


MODEL: list = []


@pytest.mark.parametrize("memory", ["auto", "trace"])
@pytest.mark.parametrize(
    "stash", [_stash_in_layer, _stash_in_model, _stash_in_closure], ids=["layer attribute", "model module", "closure"]
)
def test_a_hidden_copy_of_kv_changes_the_measurement_and_disagrees_with_the_formula(stash, memory, monkeypatch):
    """A copy of the handed keys kept wherever (the layer, a model module, a module-level list) is seen by the
    default instrument (the allocator's ledger: the copy was allocated in the lane's work) and by the trace, which
    agree with each other; the tensors the cache lists do not see it, which is why they are not the measurement.
    Mutation it catches: the default memory figure taken from the storages the cache lists (`--memory storage`):
    held bytes equal to the clean run's."""
    loaded = tiny("tiny-llama")
    MODEL[:] = [loaded.model]
    spec = "kvdirect:budget=4"
    clean = run_to_end(Engine(loaded, parse_specs(f"full,{spec}"), memory=memory, max_new_tokens=6), TURNS)[
        "strategies"
    ][spec]
    assert clean["state_bytes"]["formula_matches_measurement"] is True

    original = ResidualLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = original(self, key_states, value_states, *args, **kwargs)
        stash(self, keys)
        return keys, values

    monkeypatch.setattr(ResidualLayer, "update", update)
    engine = Engine(loaded, parse_specs(f"full,{spec}"), memory=memory, max_new_tokens=6)
    mutated = run_to_end(engine, TURNS)["strategies"][spec]
    CLOSURE.clear()
    for layer in compat.decoder_layers(loaded.model):
        compat.attention_module(layer).__dict__.pop("hidden_copy", None)
    sb = mutated["state_bytes"]
    assert mutated["token_ids"] == clean["token_ids"]
    assert sb["formula_matches_measurement"] is False and sb["mismatch_count"] > 0
    assert sb["persistent_peak"] > clean["state_bytes"]["persistent_peak"]
    assert sb["formula_persistent_peak"] == clean["state_bytes"]["formula_persistent_peak"]
    if memory == "trace":  # the trace and the ledger see the same copy
        assert clean["state_bytes"]["meter_audit"]["held_mismatches"] == 0
        assert sb["meter_audit"]["held_mismatches"] == 0 and sb["meter_audit"]["steps"] > 0
    # The cache's own list of what it holds does not see the copy: that is why it is not the measurement.
    lane = engine.lanes[0]
    assert sb["declared_mismatch_count"] == 0
    assert engine.observer.declared(lane.cache) == lane.strategy.formula_between_turns(
        engine.geometry, lane.cache.get_seq_length(), lane.forwards
    )


# --- peaks -------------------------------------------------------------------------------------------------------


def test_rebuild_step_bounds_the_peak_not_only_what_is_held_between_steps():
    # A 300-token prompt, then decode steps that each replay every old token through every layer.  Interleaved
    # with the forward, a step holds one layer's rebuilt K/V at a time beyond what running one layer over the
    # prompt chunk needs, which is at most what the prompt's own prefill needed (its activations include one
    # hidden state per token, as the carried hidden states are).  Holding a whole segment's K/V breaks the bound.
    loaded = tiny("tiny-llama")
    L = loaded.config.num_hidden_layers
    step, turn = f"anchorkv:spacing={L}:budget=4:rebuild=step", f"anchorkv:spacing={L}:budget=4"
    engine = Engine(loaded, parse_specs(f"full,{step},{turn}"), memory="trace", max_new_tokens=8, threads=1)
    rows = []
    for event in engine.run(["A long message about caches and residual streams. " * 6]):
        if event["type"] == "step":
            rows.append(
                {label: (lane["peak_bytes"], lane["persistent_bytes"]) for label, lane in event["lanes"].items()}
            )
    lanes = {lane.label: lane for lane in engine.all_lanes}
    full_turn = lanes["full"].book.turns[0]
    prefill_activations = full_turn.peak - len(engine.prompt_ids) * engine.geometry.kv_bytes_per_token
    layer = engine.geometry.global_layers[0]
    assert len(rows) >= 6
    for row in rows:
        full_peak, full_state = row["full"]
        step_peak, step_state = row[step]
        seen = full_state // engine.geometry.kv_bytes_per_token
        assert step_state < full_state / 10  # token ids and the hot window between steps
        assert row[turn][1] > full_state  # rebuild=turn holds full K/V (plus anchors) while the turn lasts
        bound = prefill_activations + seen * layer.kv_bytes_per_token
        assert step_peak - step_state <= bound, (step_peak - step_state, bound)
    assert lanes[step].book.turns[0].peak < full_turn.peak


def test_resume_rebuilds_once_not_twice():
    loaded = tiny("tiny-llama")
    L = loaded.config.num_hidden_layers
    specs = (
        f"full,anchorkv:spacing=2:budget=3,kvdirect:budget=3:rebuild=turn,anchorkv:spacing={L}:budget=3:rebuild=step"
    )
    engine = Engine(loaded, parse_specs(specs), memory="trace", max_new_tokens=4)
    for _ in engine.turn(TURNS[0]):
        pass
    engine.park()
    lanes = {lane.label: lane for lane in engine.lanes}
    anchored = [label for label, lane in lanes.items() if isinstance(lane.cache, AnchorCache)]
    passes = lambda: {label: engine.observer.tallies[label]["layer passes"] for label in anchored}  # noqa: E731
    before = passes()
    engine.resume()
    after_resume = passes()
    # The first step of the next turn: rebuild=turn uses what resume rebuilt; rebuild=step replays as every step.
    events = engine.turn(TURNS[1])
    for event in events:
        if event["type"] == "step":
            break
    events.close()
    turn_spec, step_spec = "anchorkv:spacing=2:budget=3", f"anchorkv:spacing={L}:budget=3:rebuild=step"
    assert after_resume[turn_spec] - before[turn_spec] == L  # one cascade through every layer
    assert passes()[turn_spec] == after_resume[turn_spec]  # and nothing replayed again in the turn
    assert after_resume[step_spec] == before[step_spec]  # rebuild=step: resume waits for the step
    assert passes()[step_spec] - after_resume[step_spec] >= L
    result = engine.results()["strategies"]
    for spec in (turn_spec, "kvdirect:budget=3:rebuild=turn", step_spec):
        assert result[spec]["kv_exact"] is True and result[spec]["rebuilt_token_layers"] > 0, spec
        park = result[spec]["parks"][0]
        assert park["bytes"] == park["formula_bytes"] and park["resume_ms"] is not None, spec


def test_the_first_run_in_a_process_measures_the_same_bytes_as_the_next():
    # One-time work (the start-up check of the row kernels, lazy buffers) must not land in the first run's lanes.
    from kvdirect_app.kernels import replay

    loaded = tiny("tiny-llama")
    specs = "full,kvdirect:budget=4,anchorkv:budget=4:rebuild=step,h2o:budget=4"
    replay._KERNELS.clear()

    def peaks():
        result = run_to_end(Engine(loaded, parse_specs(specs), memory="trace", max_new_tokens=4), TURNS[:1])
        return {
            label: (r["state_bytes"]["peak"], r["state_bytes"]["persistent_peak"])
            for label, r in result["strategies"].items()
        }

    first = peaks()
    assert first == peaks()


# --- CUDA: the caching allocator reports blocks --------------------------------------------------------------------
def test_cuda_blocks_are_compared_like_for_like():
    """On CUDA the measurement is the allocator's blocks (512-byte rounding, an unsplit remainder below 1 MiB on
    large blocks): the book accepts exactly that range around the cache's own tensors, and nothing else."""
    from kvdirect_app.engine.lanes import ByteBook
    from kvdirect_app.measure.memory import cuda_block_range

    sizes = [1000, 4096, 3 << 20]
    assert cuda_block_range(sizes) == (1024 + 4096 + (3 << 20), 1024 + 4096 + (3 << 20) + (1 << 20))
    book = ByteBook(measured=True, held_sizes=lambda: sizes)
    exact = sum(sizes)
    low, high = cuda_block_range(sizes)
    assert book.agrees(low, exact) and book.agrees(high, exact)
    assert not book.agrees(high + 512, exact)  # a hidden copy of a block more than the rounding allows
    assert not book.agrees(low - 512, exact)
    assert not book.agrees(low, exact + 8)  # a formula that misses the cache's own bytes
    assert ByteBook(measured=True).agrees(exact, exact) and not ByteBook(measured=True).agrees(low, exact)


def test_the_cache_lists_every_tensor_it_holds_as_the_formula_counts_them():
    """What the CUDA comparison rounds: the cache's own storages add up to the formula (CPU, every family)."""
    for family in ("tiny-llama", "tiny-gemma2"):
        loaded = tiny(family)
        specs = (
            "full,kvdirect:budget=4,anchorkv:spacing=2:budget=3,h2o:budget=6,snapkv:budget=8:window=4,"
            "knorm:budget=6,pyramidkv:budget=8:window=2"
        )
        engine = Engine(loaded, parse_specs(specs), memory="trace", max_new_tokens=5, threads=1)
        run_to_end(engine, TURNS)
        for lane in engine.all_lanes:
            seen = lane.cache.get_seq_length()
            assert sum(storage_sizes(*lane.cache.state_tensors()).values()) == lane.strategy.formula_between_turns(
                engine.geometry, seen, lane.forwards
            ), (family, lane.label)


# --- the allocator's ledger (the default instrument) against the trace --------------------------------------------


@pytest.mark.check
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_the_allocators_ledger_agrees_with_the_trace_on_every_strategy(family, dtype):
    """The union run is traced and keeps the ledger beside the trace: after every forward and between turns the two
    give the same held bytes for every lane (every strategy, exact and lossy), and the ledger's peak (the lane's
    own allocations) is never above the trace's, which also charges the lane its share of the activations.
    Mutation it catches: a lane's work outside its region (e.g. the cache update run before `owned`) leaves the
    ledger's held bytes short of the trace's."""
    strategies = tiny_union(family, dtype).result["strategies"]
    for spec, r in strategies.items():
        audit = r["state_bytes"]["meter_audit"]
        assert audit["steps"] > 0, spec
        assert audit["held_mismatches"] == 0, (spec, audit["first_mismatches"])
        assert audit["meter_peak_above_trace_steps"] == 0, spec


@pytest.mark.check
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_the_default_instrument_matches_the_formula_and_its_peak_bounds_the_formulas(family):
    """The default run (the allocator's ledger) on its own: held bytes equal the formula at every step and between
    turns, what each strategy lists agrees too, and each step's measured peak (the lane's own allocations at their
    highest) is at least the formula's (held + the strategy's buffers: a lower bound), for every strategy."""
    loaded = tiny(family)
    specs = ",".join(
        every(
            (
                "full",
                "kvdirect:budget=4",
                "kvdirect:budget=3:rebuild=turn",  # every strategy (specs.py)
                "anchorkv:spacing=2:budget=3:rebuild=step",
                "anchorkv:spacing=2:budget=3",
                "window:budget=6",
                "streaming_llm:budget=8",
                "h2o:budget=8",
                "snapkv:budget=16",
                "tova:budget=6",
                "knorm:budget=6",
                "pyramidkv:budget=8:window=2",
            ),
            budget=6,
        )
    )
    result = run_to_end(Engine(loaded, parse_specs(specs), max_new_tokens=6, threads=1), TURNS)
    assert result["memory_instrument"] == "allocator ledger (cpu)"
    for spec, r in result["strategies"].items():
        sb = r["state_bytes"]
        assert sb["instrument"] == "allocator ledger (cpu)" and sb["peak_source"] == "measured", spec
        assert sb["formula_matches_measurement"] is True, (spec, sb["mismatches"])
        assert sb["declared_mismatch_count"] == 0, spec
        assert sb["peak_below_formula_steps"] == 0 and sb["peak"] >= sb["formula_peak"], spec
        assert sb["meter_audit"] is None, spec  # no trace ran to audit it


def test_the_storage_count_is_declared_never_measured():
    """`--memory storage` counts what each strategy lists: the run and every lane say "declared", and its peak is
    the held bytes plus the formula's buffers, labelled "formula" (no peak was read)."""
    result = run_to_end(
        Engine(tiny("tiny-llama"), parse_specs("full,window:budget=4"), memory="storage", max_new_tokens=4, threads=1),
        TURNS[:1],
    )
    assert "declared, not measured" in result["memory_instrument"]
    for spec, r in result["strategies"].items():
        sb = r["state_bytes"]
        assert sb["peak_source"] == "formula" and sb["peak"] == sb["formula_peak"], spec
