"""Rows of measurements: strategies (each at a setting) run in lockstep with the full cache on one conversation.

Shared by `bench sweep` and the app's Frontier tab.  A row is the engine's
per-strategy summary (the `bench run` JSON) plus the strategy's sweep name
and budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine import Engine, run_to_end
from .models import LoadedModel
from .strategies import Strategy, parse_spec


@dataclass
class Sweep:
    loaded: LoadedModel
    turns: list[str]
    raw: bool = False
    options: dict = field(default_factory=dict)  # Engine keywords (max_new_tokens, threads, memory, batch...)
    reference: dict | None = None  # the full cache's summary, from the first run
    head: dict | None = None  # the first run's model, device, dtype...
    rows: list[dict] = field(default_factory=list)

    def run(self, entries: list[tuple[str, Strategy, int | None]]) -> list[dict]:
        """entries: (name, strategy, budget); one lockstep run of all of them; their rows."""
        engine = Engine(self.loaded, [parse_spec("full")] + [s for _, s, _ in entries], raw=self.raw, **self.options)
        result = run_to_end(engine, self.turns)
        if self.reference is None:
            self.reference = result["strategies"]["full"]
            self.head = {k: v for k, v in result.items() if k != "strategies"}
        rows = [{"strategy": name, "budget": budget, "spec": strategy.label, **result["strategies"][strategy.label]}
                for name, strategy, budget in entries]
        self.rows += rows
        return rows
