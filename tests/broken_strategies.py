"""Strategies that each break one rule of the conformance kit (`kvdirect_app/benchmarks/conformance.py`), as a careless
author would: tests/benchmarks/test_kit_rules.py runs `bench check-strategy tests/broken_strategies.py:Name` on each and
expects that rule's FAIL line, exit 1 and no traceback.  Each passed the kit before issue 54."""

import time
from dataclasses import dataclass

import torch

from kvdirect_app.strategies.kvdirect import KVDirect, ResidualLayer
from kvdirect_app.strategies.scored import Scored, ScoredLayer
from kvdirect_app.strategies.window import Window


class _InflatedLayer(ResidualLayer):
    def rebuild_old(self, end, capacity):
        keys, values = super().rebuild_old(end, capacity)
        return keys * 1.5, values


@dataclass
class Inflated(KVDirect):
    """An exact family's subclass whose rebuilt keys are x1.5: not exact, and must say so."""

    def build_cache(self, model):
        cache = super().build_cache(model)
        for layer in cache.layers:
            if isinstance(layer, ResidualLayer):
                layer.__class__ = _InflatedLayer
        return cache


@dataclass
class NeverEvicts(Window):
    """Its own limits say: keep everything, always."""

    def limits(self, forward, seen, count=1):
        return None


@dataclass
class FourTimes(Window):
    """Keeps four times its budget, and its formula says so (so the bytes rule agrees)."""

    def layer_budgets(self, count, seen):
        return (4 * self.budget,)


class _Hoarding(ScoredLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        hoard = getattr(self, "hoard", None)
        self.hoard = key_states if hoard is None else torch.cat([hoard, key_states], dim=-2)
        return out

    def state_tensors(self):
        return (*super().state_tensors(), getattr(self, "hoard", None))


@dataclass
class Hoards(Window):
    """Holds its budget of tokens, and beside them every key it was shown, listed and counted in its formula (so the
    bytes rule agrees): only its family's bytes catch it."""

    def global_layer(self, projector=None, rank=0, count=1):
        return _Hoarding(self, None, rank, count)

    def formula_persistent(self, geom, seen, forwards=None):
        keys = sum(seen * layer.kv_bytes_per_token // 2 for layer in geom.layers if not layer.is_sliding)
        return super().formula_persistent(geom, seen, forwards) + keys


@dataclass
class Unseeded(Scored):
    """Random eviction with no seed: two runs of the same spec keep different tokens."""

    def score(self, step):
        return torch.rand(step.positions.shape) if step.evicts else None


@dataclass
class EditsKeys(Window):
    """Writes into the keys it is shown (the ones attention is about to read)."""

    def score(self, step):
        step.keys.mul_(0.5)
        return super().score(step)


@dataclass
class HalfScores(Window):
    """Scores in float16 that overflow to +inf on every token after the first."""

    def score(self, step):
        return step.positions.half() * 1e5


@dataclass
class Overflows(Window):
    """The same overflow computed in float16, handed over as float32: +inf on every token after the first."""

    def score(self, step):
        return (step.positions.half() * 1e5).float()


@dataclass
class Slow(Window):
    """A second per score() call."""

    def score(self, step):
        time.sleep(1.0)
        return super().score(step)


@dataclass
class RaisesLater(Window):
    """Fine on the first turn, raises at the end of the second turn's prompt."""

    def score(self, step):
        if step.prefill and step.evicts:
            step.state["prompts"] = step.state.get("prompts", 0) + 1
            if step.state["prompts"] == 2:
                raise ValueError("no scores for a second prompt")
        return super().score(step)


@dataclass
class BadFormula(Window):
    """A formula that divides by zero: the engine calls it after every forward, outside score()."""

    def formula_persistent(self, geom, seen, forwards=None):
        return seen // 0


@dataclass
class MetaScores(Window):
    """Scores on the meta device (no data at all)."""

    def score(self, step):
        return torch.zeros(step.positions.shape, device="meta")


@dataclass
class Hangs(Window):
    """A score() that does not return for a minute once it must evict (stopped by the kit's alarm)."""

    def score(self, step):
        if step.evicts:
            time.sleep(60)
        return super().score(step)
