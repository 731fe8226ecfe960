"""The table of every strategy's spec (tests/specs.py) holds every strategy the package registers, each spec parses
to its strategy, and the lists that mean "every strategy" name each one.

Mutations that fail it (each applied, then undone): the table written out by hand without one strategy; the filter
on the package's module name dropped (a test's own strategy joins the table); `every` leaving out a strategy that a
pick does not name; `EVICTION` taking the exact families too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdirect_app.strategies import Strategy, parse_spec, registry

from ..runs import LARGE_BUDGET, LOCKSTEP
from ..specs import EVICTION, SPECS, STRATEGIES, built_in, every, spec

pytestmark = pytest.mark.check  # the inner loop (`make check`)
ROOT = Path(__file__).resolve().parents[2]


def _names(specs) -> set[str]:
    return {s.split(":", 1)[0] for s in specs}


def test_every_strategy_the_package_registers_is_in_the_table():
    """The registry of a fresh interpreter (no test has registered a strategy of its own there) is the table's;
    and every package strategy registered in this process by now is in it too."""
    code = "from kvdirect_app.strategies import registry; print(' '.join(sorted(registry())))"
    fresh = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.split() == list(STRATEGIES) == list(SPECS)
    missing = set(built_in(registry())) - set(STRATEGIES)
    assert not missing, f"registered but missing from tests/specs.py: {sorted(missing)}"
    assert {"full", "kvdirect", "anchorkv", "window"} <= set(STRATEGIES)


def test_a_strategy_a_test_registers_is_not_in_the_table():
    class Mine(STRATEGIES["window"]):
        name = "test_spec_table_mine"

    try:
        assert registry()["test_spec_table_mine"] is Mine
        assert built_in(registry()) == STRATEGIES and Mine.__module__ == __name__
    finally:
        Strategy.registry.pop(Mine.name, None)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_spec_of_the_table_parses_to_its_strategy(name):
    for budget in (None, 6):
        strategy = parse_spec(spec(name, budget))
        assert type(strategy) is STRATEGIES[name] and strategy.name == name
        if budget is not None and "budget" in STRATEGIES[name].settings():
            assert strategy.budget == budget
    assert SPECS[name] == spec(name) and parse_spec(SPECS[name]).spec() == name  # the default settings


def test_every_keeps_the_picks_and_adds_each_strategy_they_leave_out():
    picks = ("anchorkv:spacing=2", "anchorkv:rebuild=step", "window:budget=4")
    out = every(picks, budget=6)
    assert out[:3] == picks and len(out) == len(set(out))
    assert _names(out) == set(STRATEGIES)
    assert out[3:] == tuple(spec(name, 6) for name in STRATEGIES if name not in ("anchorkv", "window"))
    assert every() == tuple(SPECS.values())


def test_eviction_is_every_strategy_that_does_not_hand_attention_every_token():
    assert set(EVICTION) == {name for name, cls in STRATEGIES.items() if not cls.kv_comparable}
    assert {"full", "kvdirect", "anchorkv"}.isdisjoint(EVICTION) and {"window", "h2o", "snapkv"} <= set(EVICTION)
    assert _names(LARGE_BUDGET) == set(EVICTION)  # the union run's eviction lanes at a budget above the conversation


def test_the_lists_that_mean_every_strategy_name_each_one():
    """The tiny families' union run (tests/runs.py) batches every strategy against one by one."""
    assert _names(LOCKSTEP) == set(STRATEGIES)
