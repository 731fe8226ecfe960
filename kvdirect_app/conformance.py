"""The contract a strategy of one's own is held to, checked in a minute or two (`bench check-strategy SPEC`).

    python -m kvdirect_app.bench check-strategy examples/random_eviction.py:RandomEviction

The strategy runs beside the full cache and a plain window (the reference for what a well-behaved lane holds
outside torch) on the tiny families (llama; gemma3, whose sliding-window layers a strategy must leave as they are)
and on SmolLM2, through every kind of step: a prompt read in pieces, decode steps, later turns, a park and a
resume; once more with the model's own (native) kernels, whose masks are built once per layer type.  Each rule
gives one line, ``ok`` or ``FAIL`` with what broke and where:

* contract: the engine's own checks at every forward (scores of the right shape, no NaN, no layer over its budget,
  masks that fit: `strategies.base.ContractError`);
* sliding layers: every sliding-window layer is the full cache's own kind of layer (`SlidingLayer`);
* bytes: the allocator's measure of what it holds equals its formula at every step and between turns (a hidden
  copy, or a formula that is wrong, shows here), and what the tensors it lists say agrees too;
* nothing hidden: its bytes outside torch (numpy's data, Python's buffers) at most the plain window's beside it
  plus `OUTSIDE_ALLOWANCE` and `OUTSIDE_SHARE` of what its tensors hold, and nothing left unattributed by the run (measured on a second run: the first pays
  what a process pays once, lazy imports and caches, and is not counted);
* against the full cache: tokens and K/V; an exact family's subclass must keep both equal.

A rule that fails exits 1 (`bench check-strategy`); the same checks that are cheap (shape, finiteness, budget) also
guard every run.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import compat
from .engine import Engine
from .models import load_model
from .specs import settings_of
from .strategies import parse_spec
from .strategies.base import ContractError, SlidingLayer, StrategyError

MODELS = ("tiny-llama", "tiny-gemma3", "smollm2-135m")
TURNS = ("Tell me about caches: what they keep, what they drop, and why the positions of the keys matter.",
         "And the values?", "One more sentence, please.")
# What a lane may hold outside torch beyond a plain window's: its own bookkeeping in Python (lists of chunk bounds, a
# few numbers per layer) up to this plus this share of what its tensors hold; a copy of its keys kept outside torch
# is as large as the keys themselves, and grows with every step that keeps one.
OUTSIDE_ALLOWANCE = 4096
OUTSIDE_SHARE = 0.25
PLAIN = "window"


@dataclass
class Finding:
    rule: str
    model: str
    ok: bool
    words: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.rule} on {self.model}: {self.words}"


def _budget(spec: str, loaded) -> tuple[str, str]:
    """The candidate and the plain window at a budget that makes them evict on this model's prompts (unless the
    spec sets its own budget)."""
    settings = parse_spec(spec).settings()
    budget = 8 if loaded.max_context <= 2048 else 24
    given = any(pair.partition("=")[0] == "budget" for pair in settings_of(spec))
    candidate = spec if given or "budget" not in settings else f"{spec}:budget={budget}"
    return candidate, f"{PLAIN}:budget={getattr(parse_spec(candidate), 'budget', budget)}"


def _run(loaded, candidate: str, plain: str, kernels: str, chunk: int) -> tuple[Engine, dict]:
    strategies = {}  # by canonical spec: the window (or the full cache) checked is its own reference, once
    for text in ("full", plain, candidate):
        strategies.setdefault(parse_spec(text).spec(), parse_spec(text))
    engine = Engine(loaded, list(strategies.values()), max_new_tokens=5, threads=1, twins=False, kernels=kernels,
                    prefill_chunk=chunk)
    for n, text in enumerate(TURNS):
        if n == 2:
            engine.park()  # the last turn after a park: the resume rebuilds what the strategy promised
        for _ in engine.turn(text):
            pass
    return engine, engine.results()


def check(spec: str, models: tuple[str, ...] = MODELS) -> list[Finding]:
    """Every rule on every model (`models`); a spec that cannot be built is one failing finding."""
    out = []
    try:
        cls = type(parse_spec(spec))
    except StrategyError as e:
        return [Finding("spec", "-", False, str(e))]
    exact = cls.exact
    for name in models:
        loaded = load_model(name, progress=lambda msg: None)
        candidate, plain = _budget(spec, loaded)
        label = parse_spec(candidate).label
        for kernels, chunk in (("invariant", 16), ("native", 1024)):
            where = f"{kernels} kernels, prompts in pieces of {chunk}"
            try:
                if kernels == "invariant":  # a first run pays what a process pays once (lazy imports, caches)
                    _run(loaded, candidate, plain, kernels, chunk)
                engine, result = _run(loaded, candidate, plain, kernels, chunk)
            except ContractError as e:
                out.append(Finding("contract", name, False, f"{e} ({where})"))
                break
            out.append(Finding("contract", name, True, f"every forward within the contract ({where})"))
            if kernels == "native":
                break
            lane = next(x for x in engine.all_lanes if x.strategy.spec() == parse_spec(candidate).spec())
            label = lane.label
            r, window = result["strategies"][label], result["strategies"][parse_spec(plain).label]
            out += _bytes(name, r, window, result)
            out.append(_sliding(name, lane.cache, loaded))
            out.append(_against_full(name, r, exact))
    return out


def _bytes(name: str, r: dict, window: dict, result: dict) -> list[Finding]:
    sb = r["state_bytes"]
    out = []
    if sb["formula_matches_measurement"] is None:
        out.append(Finding("bytes", name, True, "not measured here (no allocator could be read): formula only"))
    elif sb["formula_matches_measurement"]:
        out.append(Finding("bytes", name, True, f"measured = formula at every step and between turns "
                                                f"({sb['between_turns_peak']:,} B held between turns at most)"))
    else:
        where, seen, measured, formula = sb["mismatches"][0]
        out.append(Finding("bytes", name, False, f"measured differs from its formula at {sb['mismatch_count']} "
                                                 f"points, first at {where} with {seen} tokens seen: {measured:,} B "
                                                 f"measured, {formula:,} B by its formula"))
    if sb["declared_mismatch_count"]:
        out.append(Finding("bytes", name, False, f"the tensors it lists (state_tensors) differ from its formula at "
                                                 f"{sb['declared_mismatch_count']} forwards"))
    mine, plain = sb["outside_torch"]["held"], window["state_bytes"]["outside_torch"]["held"]
    unattributed = (result.get("unattributed_bytes") or {}).get("bytes", 0)
    allowed = None if plain is None else plain + OUTSIDE_ALLOWANCE + OUTSIDE_SHARE * (sb["final_persistent"] or 0)
    if mine is not None and allowed is not None and mine > allowed:
        out.append(Finding("nothing hidden", name, False, f"holds {mine:,} B outside torch (numpy's data, Python's "
                                                          f"buffers) against the plain window's {plain:,} B (allowed: "
                                                          f"{allowed:,.0f} B): state belongs in tensors its formula "
                                                          "counts"))
    elif unattributed:
        out.append(Finding("nothing hidden", name, False, f"the run left {unattributed:,} B no lane holds (a "
                                                          "thread of its own, shared memory, owner 0)"))
    else:
        out.append(Finding("nothing hidden", name, True, "nothing outside torch beyond a plain window's, nothing "
                                                         "unattributed"))
    return out


def _sliding(name: str, cache, loaded) -> Finding:
    specs = compat.layer_specs(loaded.config)
    sliding = [s.index for s in specs if s.is_sliding]
    wrong = [i for i in sliding if type(cache.layers[i]) is not SlidingLayer]
    if not sliding:
        return Finding("sliding layers", name, True, "none in this model")
    if wrong:
        return Finding("sliding layers", name, False, f"layers {wrong} are sliding-window layers the strategy "
                                                      "replaced; allowed: leave them as the full cache keeps them")
    return Finding("sliding layers", name, True, f"{len(sliding)} sliding-window layers left as the full cache's")


def _against_full(name: str, r: dict, exact: bool) -> Finding:
    match, kv = r["token_match"], r["kv_exact"]
    words = f"token match {match:.3f}, first divergence {r['first_divergence']}, K/V exact {kv}"
    if exact and (match != 1.0 or kv is not True):
        return Finding("against the full cache", name, False, f"an exact family's subclass must keep every token "
                                                              f"and bit-equal K/V: {words}")
    return Finding("against the full cache", name, True, words)
