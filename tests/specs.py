"""Every registered strategy's spec, in one table that the per-strategy tests share.

The idea of NVIDIA kvpress's `tests/default_presses.py` (one list of every press for the tests to run), without
its four edits per new press: the table is read from the registry, so a strategy the package registers (a class
that names itself in a module of `kvdirect_app/strategies/`) joins every list below with no edit here.  A test
that means "every strategy" takes `every(...)`: the settings it picks for the strategies it names, then each
strategy it does not name at `spec(name, budget)`.  `tests/strategies/test_spec_table.py` fails where a
registered strategy is missing from the table or a spec of it does not parse to it.
"""

from __future__ import annotations

from kvdirect_app.strategies import Strategy, registry

PACKAGE = "kvdirect_app.strategies."  # the package's own strategies; a test's or a file's own class is not one


def built_in(registered: dict[str, type[Strategy]]) -> dict[str, type[Strategy]]:
    """name -> class, by name: the strategies of `registered` that the package defines (none a test defines)."""
    return dict(sorted((name, cls) for name, cls in registered.items() if cls.__module__.startswith(PACKAGE)))


STRATEGIES: dict[str, type[Strategy]] = built_in(registry())  # every strategy the package registers


def spec(name: str, budget: int | None = None) -> str:
    """The table's spec of a strategy: its name (its default settings), with `budget=B` where it has a budget
    setting and a budget is given."""
    return f"{name}:budget={budget}" if budget is not None and "budget" in STRATEGIES[name].settings() else name


# name -> its spec at its default settings: the table.
SPECS: dict[str, str] = {name: spec(name) for name in STRATEGIES}

# The strategies that hand attention fewer tokens than the full cache's (eviction: their K/V are not compared).
EVICTION: tuple[str, ...] = tuple(name for name, cls in STRATEGIES.items() if not cls.kv_comparable)


def every(picks: tuple[str, ...] = (), budget: int | None = None) -> tuple[str, ...]:
    """Every strategy of the table: `picks` first (a test's own settings for the strategies it names, several
    of one allowed), then each strategy no pick names at `spec(name, budget)`."""
    named = {pick.split(":", 1)[0] for pick in picks}
    return tuple(picks) + tuple(spec(name, budget) for name in STRATEGIES if name not in named)
