"""A strategy's contract, checked by the engine where it is cheap: scores of the right shape, no NaN, no layer over
its budget, masks that fit.  Each broken strategy is refused in one line naming it, the rule and the step; the run
stops rather than report figures of a strategy that does not do what it says."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvdirect_app.engine.runner import Engine
from kvdirect_app.strategies import Strategy, parse_spec
from kvdirect_app.strategies.base import ContractError
from kvdirect_app.strategies.pyramidkv import PyramidKV
from kvdirect_app.strategies.scored import ScoredLayer
from kvdirect_app.strategies.window import Window

from ..conftest import tiny

pytestmark = pytest.mark.check
PROMPT = "Tell me about caches and why keys need positions."


def _strategy(base: type, name: str, **members) -> type:
    return dataclass(type(f"Broken_{name}", (base,), {"name": name, **members}))


@pytest.fixture
def broken():
    made = []

    def make(base, name, **members):
        made.append(_strategy(base, f"test_broken_{name}", **members))
        return made[-1]

    yield make
    for cls in made:
        Strategy.registry.pop(cls.name, None)


def _refused(strategy, kernels: str = "invariant") -> str:
    engine = Engine(
        tiny("tiny-llama"), [parse_spec("full"), strategy], max_new_tokens=4, threads=1, twins=False, kernels=kernels
    )
    with pytest.raises(ContractError) as info:
        for text in (PROMPT, "And the values?"):  # a later prompt: masked over what the first turn kept
            for _ in engine.turn(text):
                pass
    message = str(info.value)
    assert "\n" not in message and message.startswith(strategy.label), message
    return message


def test_scores_one_short_are_refused_not_shifted(broken):
    """The reviewer's subclass: score() returns `positions[..., 1:]`, one value too few (its selections would be
    silently shifted).  Mutation: the shape check removed (the run then goes on)."""
    cls = broken(Window, "short", score=lambda self, step: step.positions.float()[..., 1:])
    message = _refused(cls(budget=4))
    assert "score() returned (1, 1," in message and "allowed: shape (1, 1," in message
    assert "a prompt piece" in message and "ending at token" in message


def test_nan_scores_are_refused(broken):
    """Mutation: the finiteness check removed (keep_top then sorts NaN as it happens to)."""

    def score(self, step):
        out = step.positions.float()
        out[..., 0] = float("nan")
        return out

    message = _refused(broken(Window, "nan", score=score)(budget=4))
    assert "score() returned NaN" in message and "+inf to protect" in message


def test_a_layer_that_keeps_more_than_its_budget_is_refused(broken):
    """A layer that keeps one token more than it evicted down to (its tensors, not its formula): the engine counts
    what each layer holds after every forward against what the budget allows.  Mutation: the engine's check
    removed from `Forwards._record` (the run then reports a window of 5 as a window of 4)."""

    class Greedy(ScoredLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            out = super().update(key_states, value_states, *args, **kwargs)
            if self.keys.shape[-2] >= 4:  # one more than kept: the oldest candidate again
                self.keys = torch.cat([self.keys[..., :1, :], self.keys], dim=-2)
                self.values = torch.cat([self.values[..., :1, :], self.values], dim=-2)
                self.positions = torch.cat([self.positions[..., :1], self.positions], dim=-1)
            return out

    def global_layer(self, projector=None, rank=0, count=1):
        return Greedy(self, None, rank, count)

    message = _refused(broken(Window, "greedy", global_layer=global_layer)(budget=4))
    assert "holds 5 tokens" in message and "more than the 4 its budget allows" in message


def test_budgets_that_grow_with_depth_are_refused_where_the_mask_is_built_once_per_layer_type(broken):
    """Native kernels build one mask per layer type, sized by its first layer: a deeper layer holding more keys
    than that cannot be masked right (the second turn's prompt attends over what the first kept).  Mutation: `fit_mask`
    cutting a mask it cannot fit (attention then fails with a shape error, or attends wrongly)."""
    cls = broken(PyramidKV, "growing", layer_budgets=lambda self, count, seen: tuple(4 + 2 * r for r in range(count)))
    message = _refused(cls(budget=4), kernels="native")
    assert "never grow with depth" in message and "keys, more than the" in message
