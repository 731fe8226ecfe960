"""The contract a strategy of one's own is held to, checked in a minute or two (`bench check-strategy SPEC`).

    python -m kvdirect_app.bench check-strategy examples/random_eviction.py:RandomEviction

The strategy runs beside the full cache and a plain window (the reference for what a well-behaved lane holds
outside torch) on the tiny families (llama; gemma3, whose sliding-window layers a strategy must leave as they are)
and on SmolLM2, through every kind of step: a prompt read in pieces, decode steps, later turns, a park and a
resume.  It runs twice with the fixed-order (invariant) kernels, the first run watched from inside its cache
layers (each `score()` call), the second measured by the ledger alone; once more with the model's own (native)
kernels, whose masks are built once per layer type.  Each rule gives one line per model as soon as it is judged,
``ok`` or ``FAIL`` with what broke and where; the kit judges what it watches from outside the strategy's code, so
nothing a subclass overrides (`limits`, `layer_budgets`, its formulas, `exact`) widens a rule:

* contract: every run ends, with the engine's own checks at every forward (scores of the right shape, no NaN, masks
  that fit: `strategies.base.ContractError`); whatever the strategy raises fails here in one line naming the step,
  and the kit goes on to the next model (a run that did not end leaves that model's later rules unjudged);
* time: each run within `RUN_SECONDS` and each `score()` call within `SCORE_SECONDS`; a slow strategy is stopped
  where it is with its measured time (a hang too: an alarm, where the kit runs on the main thread);
* scores: on the model's device, in float32, float64 or the model's own dtype, no -inf, and no more +inf
  (protected tokens) than the layer keeps;
* read-only step: `score()` leaves the step's keys and positions as it found them (a digest before and after);
* budget: the tokens each layer holds, read from its keys after every forward, and the bytes the allocator
  measures after every turn, at most what its family (`family`: the package's class it derives from, with its
  settings) keeps at that budget by the family's own methods; the plain window's bytes beside them;
* determinism: the two invariant runs give the same tokens and hold the same keys at every turn's end;
* sliding layers: every sliding-window layer is the full cache's own kind of layer (`SlidingLayer`);
* bytes: the allocator's measure of what it holds equals its formula at every step and between turns (a hidden
  copy, or a formula that is wrong, shows here), and what the tensors it lists say agrees too;
* nothing hidden: its bytes outside torch (numpy's data, Python's buffers) at most the plain window's beside it
  plus `OUTSIDE_ALLOWANCE` and `OUTSIDE_SHARE` of what its tensors hold, and nothing left unattributed by the run
  (measured on the second run: the first pays what a process pays once, lazy imports and caches);
* against the full cache: tokens and K/V; a strategy that claims exactness (`claims_exact`: an exact family's
  subclass) must keep both equal.

Each rule's verdict, and the bounds it allows, is `conformance_rules`'s.  A rule that fails exits 1 (`bench
check-strategy`); the engine's cheap checks (shape, NaN, the budget its own
limits give) also guard every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import signal
import threading
import time
from typing import Callable

import torch

from ..engine.runner import Engine
from ..models import compat
from ..models.loading import load_model
from ..plain.specs import settings_of
from ..strategies import parse_spec
from ..strategies.base import ContractError, Forward, StrategyError
from ..strategies.scored import Scored, ScoredLayer, per_layer
from . import conformance_rules as rules
from .conformance_rules import Finding

MODELS = ("tiny-llama", "tiny-gemma3", "smollm2-135m")
TURNS = (
    "Tell me about caches: what they keep, what they drop, and why the positions of the keys matter.",
    "And the values?",
    "One more sentence, please.",
)
PLAIN = "window"
# A run of the kit's three turns takes ~3 s on SmolLM2 and under 1 s on a tiny family (2 cores, measured); a built-in's
# score() takes milliseconds on the kit's prompts.
RUN_SECONDS = 30.0
SCORE_SECONDS = 0.5
PACKAGE = Scored.__module__.rpartition(".")[0] + "."  # the package's own strategies: their classes are the families


class _Stop(Exception):
    """A rule broken so that the run cannot go on (the strategy raised, took too long, or handed over scores the
    engine cannot use): the run ends where it broke, in one finding."""

    def __init__(self, rule: str, words: str):
        super().__init__(words)
        self.rule, self.words = rule, words


def family(strategy) -> Scored | None:
    """The bound an eviction strategy's budget is held to: the package's own class it derives from (itself for a
    built-in: `Scored` for a direct subclass), built with those of its settings the class has, and its own rows
    and per-token buffers (what a kept token costs).  None for a strategy that evicts nothing (the exact
    families, the full cache)."""
    if not isinstance(strategy, Scored):
        return None
    cls = next(c for c in type(strategy).__mro__ if c.__module__.startswith(PACKAGE) and issubclass(c, Scored))
    own = cls(**{f.name: getattr(strategy, f.name) for f in dataclasses.fields(cls) if f.init})
    own.per_head, own.token_buffers = strategy.per_head, tuple(strategy.token_buffers)
    return own


def _budget(spec: str, loaded) -> tuple[str, str]:
    """The candidate and the plain window at a budget that makes them evict on this model's prompts (unless the
    spec sets its own budget)."""
    settings = parse_spec(spec).settings()
    budget = 8 if loaded.max_context <= 2048 else 24
    given = any(pair.partition("=")[0] == "budget" for pair in settings_of(spec))
    candidate = spec if given or "budget" not in settings else f"{spec}:budget={budget}"
    return candidate, f"{PLAIN}:budget={getattr(parse_spec(candidate), 'budget', budget)}"


def _said(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _digest(t) -> bytes | None:
    """A digest of a tensor's bits (on the CPU: a view, no copy), None for anything else."""
    if not isinstance(t, torch.Tensor):
        return None
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy(), digest_size=16).digest() if t.numel() else b""


class Probe:
    """What the kit watches during one run, from outside the strategy's code: where the run is, its time, the tokens
    each layer holds after every forward, what it holds at each turn's end; with `scores`, every `score()` call
    (its time, its scores, the step before and after it)."""

    def __init__(self, strategy, loaded, scores: bool):
        self.strategy, self.scores, self.family = strategy, scores, family(strategy)
        self.specs = compat.layer_specs(loaded.config)
        self.lane = self.geometry = None
        self.where = "building its cache"  # what runs now
        self.at = "its start"  # the last event that finished
        self.turn = self.steps = self.calls = 0
        self.started = time.monotonic()
        self.slowest = 0.0
        self.calling: tuple[str, float] | None = None  # a score() call under way: where, and when it began
        self.forwards = 0  # after which the tokens its layers hold were read
        self.broken: dict[str, list[str]] = {}  # rule -> what broke, in order
        self.ends: list[tuple] = []  # per turn: (turn, forwards so far, tokens, digest of the keys and values held)

    def attach(self, engine: Engine, spec: str):
        self.lane = next(x for x in engine.all_lanes if x.strategy.spec() == spec)
        self.geometry = engine.geometry
        self.where = "its first forward"
        if self.scores:
            for layer in self.lane.cache.layers:
                if isinstance(layer, ScoredLayer):
                    layer.score = functools.partial(self._score, layer, layer.score)

    def _broke(self, rule: str, words: str):
        self.broken.setdefault(rule, []).append(words)

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def overtime(self) -> str:
        where = self.where
        if self.calling is not None:  # stopped inside a score() call that had not returned
            where, started = self.calling
            where = f"a score() call that had run {time.perf_counter() - started:.1f} s, at {where}"
        return (
            f"the run took more than {RUN_SECONDS:g} s: stopped {self.seconds():.1f} s in, at {where}; allowed: "
            f"{RUN_SECONDS:g} s a run of the kit's three turns"
        )

    def check_time(self):
        if self.seconds() > RUN_SECONDS:
            raise _Stop("time", self.overtime())

    # --- inside the layers -------------------------------------------------------------------------------------------
    def _score(self, layer: ScoredLayer, score: Callable, step):
        where = f"{layer._where(step)}, turn {self.turn}"
        keys, positions = step.keys, step.positions
        before = _digest(keys), _digest(positions)
        started = time.perf_counter()
        self.calling = where, started
        try:
            scores = score(step)
        except _Stop:
            raise
        except Exception as e:
            raise _Stop("contract", f"score() raised {_said(e)} at {where}") from None
        finally:
            self.calling = None
        spent = time.perf_counter() - started
        self.calls, self.slowest = self.calls + 1, max(self.slowest, spent)
        if spent > SCORE_SECONDS:
            raise _Stop("time", f"score() took {spent:.2f} s at {where}; allowed: {SCORE_SECONDS:g} s a call")
        changed = [
            name
            for name, now, was in zip(("keys", "positions"), (_digest(keys), _digest(positions)), before)
            if now != was
        ]
        if changed:
            self._broke(
                "read-only step",
                f"score() changed the step's {' and '.join(changed)} in place at {where}; "
                "allowed: read them (attention reads the same tensors), write step.buffers",
            )
        if isinstance(scores, torch.Tensor):
            self._check_scores(layer, step, scores, where)
        self.check_time()
        return scores

    def _check_scores(self, layer: ScoredLayer, step, scores: torch.Tensor, where: str):
        if scores.device != step.keys.device:
            raise _Stop(
                "scores",
                f"score() returned scores on {scores.device} at {where}; allowed: the model's "
                f"device ({step.keys.device})",
            )
        allowed = list(dict.fromkeys((torch.float32, torch.float64, step.keys.dtype)))
        if scores.dtype not in allowed:
            self._broke(
                "scores",
                f"score() returned {str(scores.dtype).removeprefix('torch.')} scores at {where}; "
                f"allowed: {', '.join(str(d).removeprefix('torch.') for d in allowed)} (the model's "
                "keys are " + str(step.keys.dtype).removeprefix("torch.") + ")",
            )
            return
        if bool(torch.isneginf(scores).any()):
            self._broke("scores", f"score() returned -inf at {where}; allowed: numbers, or +inf to protect a token")
        if not step.evicts:
            return
        limits = layer.strategy.limits(
            Forward(step.q, layer.prefill, layer.prompt_open, layer.keep_all), step.seen, layer.count
        )
        limit = None if limits is None else per_layer(limits, layer.rank)
        protected = int(torch.isposinf(scores).sum(dim=-1).max()) if scores.numel() else 0
        if limit is not None and protected > limit:
            self._broke(
                "scores",
                f"score() protected {protected} of {scores.shape[-1]} candidates with +inf at "
                f"{where}, more than the {limit} the layer keeps (an overflow?): the tie rule "
                "chose, not the scores; allowed: +inf only for tokens that must stay",
            )

    # --- between forwards --------------------------------------------------------------------------------------------
    def after(self, event: dict):
        """After each event of the run: where it is now, the tokens each layer holds, its time."""
        kind = event.get("type")
        if kind == "turn":
            self.turn, self.steps = event["turn"] + 1, 0
            self.where = f"turn {self.turn}'s prompt"
        elif kind == "prefill":
            done, total = event["done"], event["total"]
            self.at = f"turn {self.turn}'s prompt, {done} of {total} tokens read"
            self.where = (
                f"turn {self.turn}'s prompt, after {done} tokens"
                if done < total
                else f"turn {self.turn}, decode step 1"
            )
        elif kind == "step":
            self.steps += 1
            self.at, self.where = (
                f"turn {self.turn}, decode step {self.steps}",
                f"turn {self.turn}, decode step {self.steps + 1}",
            )
        elif kind == "turn_end":
            self.ends.append((self.turn, len(self.lane.forwards), list(self.lane.tokens[-1]), self._held_digest()))
            self.at = self.where = f"the end of turn {self.turn}"
        elif kind in ("park", "resume"):
            self.at = self.where = f"the park and resume after turn {self.turn}"
        self._held()
        self.check_time()

    def _held_digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for layer in self.lane.cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                h.update(_digest(t) or b"-")
        return h.hexdigest()

    def _held(self):
        """The tokens each global layer holds, read from its keys, against what the family keeps there."""
        fam = self.family
        if fam is None or self.lane is None:
            return
        forwards = self.lane.forwards
        seen = sum(f.q for f in forwards)
        self.forwards = len(forwards)
        slots = fam.slots(self.specs)
        allowed = fam.stored(seen, forwards, len(slots)) if slots else []
        for spec, layer in zip(self.specs, self.lane.cache.layers):
            if spec.is_sliding:
                continue
            keys = getattr(layer, "keys", None)
            held = keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() >= 2 else 0
            limit = per_layer(allowed, slots[spec.index][0]) if spec.index in slots else seen
            if held > limit:
                self._broke(
                    "budget",
                    f"layer {spec.index} holds {held} tokens after {self.at} ({seen} seen), more "
                    f"than the {limit} {type(fam).__name__} keeps there at budget={fam.budget}; "
                    "allowed: at most its family's (its own limits or layer_budgets do not widen "
                    "it)",
                )
                return


@contextlib.contextmanager
def _alarm(probe: Probe):
    """Stops a run that hangs inside one forward (a `score()` that never returns) after `RUN_SECONDS`: an alarm,
    where the kit runs on the main thread (elsewhere the probe's checks between forwards and calls stop it)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def ring(signum, frame):
        raise _Stop("time", probe.overtime())

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, RUN_SECONDS + 1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _run(loaded, candidate: str, plain: str, kernels: str, chunk: int, probe: Probe) -> tuple[Engine, dict]:
    strategies = {}  # by canonical spec: the window (or the full cache) checked is its own reference, once
    for text in ("full", plain, candidate):
        strategies.setdefault(parse_spec(text).spec(), parse_spec(text))
    with _alarm(probe):
        engine = Engine(
            loaded,
            list(strategies.values()),
            max_new_tokens=5,
            threads=1,
            twins=False,
            kernels=kernels,
            prefill_chunk=chunk,
        )
        probe.attach(engine, parse_spec(candidate).spec())
        for n, text in enumerate(TURNS):
            if n == 2:  # the last turn after a park: the resume rebuilds what the strategy promised
                probe.after(engine.park())
            for event in engine.turn(text):
                probe.after(event)
        return engine, engine.results()


def _attempt(name: str, loaded, candidate: str, plain: str, kernels: str, chunk: int, probe: Probe):
    """One run; where it cannot end, the finding that says why (the rule, the step, one line) instead."""
    how = f"{kernels} kernels, prompts in pieces of {chunk}"
    try:
        return _run(loaded, candidate, plain, kernels, chunk, probe), None
    except _Stop as e:
        return None, Finding(e.rule, name, False, f"{e.words} ({how})")
    except ContractError as e:
        return None, Finding("contract", name, False, f"{e} (at {probe.where}; {how})")
    except Exception as e:  # the strategy's own code, anywhere in the run: one line, and the kit goes on
        return None, Finding("contract", name, False, f"the run raised {_said(e)} at {probe.where} ({how})")


def check(spec: str, models: tuple[str, ...] = MODELS, say: Callable[[Finding], None] | None = None) -> list[Finding]:
    """Every rule on every model (`models`), each finding handed to `say` as soon as it is judged; a spec that
    cannot be built is one failing finding."""
    out: list[Finding] = []

    def add(*findings: Finding):
        for f in findings:
            out.append(f)
            if say is not None:
                say(f)

    try:
        parse_spec(spec)
    except StrategyError as e:
        add(Finding("spec", "-", False, str(e)))
        return out
    slow = None  # the model a run was stopped on for its time: the larger ones would only take longer
    for name in models:
        if slow is not None:
            add(Finding("time", name, False, f"not run: stopped for its time on {slow}"))
            continue
        try:
            loaded = load_model(name, progress=lambda msg: None)
        except Exception as e:  # noqa: BLE001  (a preset that cannot be loaded here: one line, the next model)
            add(Finding("model", name, False, f"cannot be loaded: {_said(e)}"))
            continue
        try:
            _check_model(spec, name, loaded, add)
        except Exception as e:  # noqa: BLE001  (the kit's own step that the strategy broke: one line, the next model)
            add(Finding("contract", name, False, f"the kit could not run it: {_said(e)}"))
        if any(f.rule == "time" and f.model == name and not f.ok for f in out):
            slow = name
    return out


def _check_model(spec: str, name: str, loaded, add: Callable[..., None]):
    """The rules on one model: two invariant runs (the first watched inside its layers, the second measured) and a
    native one.  A run that cannot end is one finding; the rules it leaves unjudged are not printed."""
    candidate, plain = _budget(spec, loaded)
    strategy = parse_spec(candidate)
    probes: list[Probe] = []

    def attempt(kernels: str, chunk: int, scores: bool = False):
        probes.append(Probe(strategy, loaded, scores))
        run, stopped = _attempt(name, loaded, candidate, plain, kernels, chunk, probes[-1])
        return probes[-1], run, stopped

    watched, _, stopped = attempt("invariant", 16, scores=True)  # a first run pays what a process pays once
    measured = second = None
    if stopped is None:
        measured, second, stopped = attempt("invariant", 16)
    skip = {stopped.rule} if stopped else set()
    add(*(f for f in rules.judged_inside(name, watched) if f.rule not in skip))
    if stopped is not None:
        if "budget" not in skip:
            add(rules.budget(name, watched, None, None, plain))
        add(stopped)
        return
    add(
        Finding(
            "contract", name, True, "every forward within the contract (invariant kernels, prompts in pieces of 16)"
        )
    )
    engine, result = second
    r, window = result["strategies"][measured.lane.label], result["strategies"][parse_spec(plain).label]
    add(rules.budget(name, watched, measured, window, plain), rules.determinism(name, watched, measured))
    add(*rules.stored_bytes(name, r, window, result))
    add(rules.sliding_layers(name, measured.lane.cache, loaded), rules.against_full(name, r, strategy.claims_exact))
    _, _, stopped = attempt("native", 1024)
    add(
        stopped
        or Finding(
            "contract", name, True, "every forward within the contract (native kernels, prompts in pieces of 1024)"
        )
    )
    if stopped is None or stopped.rule != "time":
        add(
            Finding(
                "time",
                name,
                True,
                f"each run within {RUN_SECONDS:g} s (the slowest "
                f"{max(p.seconds() for p in probes):.1f} s)"
                + (
                    f", each score() call within {SCORE_SECONDS:g} s (the slowest {1e3 * watched.slowest:.1f} ms)"
                    if watched.calls
                    else ""
                ),
            )
        )
