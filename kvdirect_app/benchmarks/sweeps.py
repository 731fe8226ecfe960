"""Rows of measurements: strategies (each at a setting) run in lockstep with the full cache on one conversation.

Shared by `bench sweep` (through `benchmarks.sweep`, whose work is `run_sweep` here) and the app's Frontier
tab.  A row is the engine's per-strategy summary (the `bench run` JSON) plus the strategy's sweep name and
budget.

* Fixed budgets: one lockstep run per budget with `:budget=B` appended to every strategy spec; with an
  executor (`local`, `ray`) each budget's run is a cell (`sweep_cell`) run through `executors.run_cells`.
* Equal memory: each strategy gets the budget whose *measured* peak is closest to a target (the measured peak
  of the first strategy that promises exact K/V at the first budget, or a given spec or byte count), found by
  bisection on `GRID`, all strategies probed together in one lockstep run per round; every probe is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine import validate
from ..engine.runner import Engine, run_to_end
from ..models.loading import LoadedModel, load_model
from ..models.prompts import InputError
from ..plain.errors import UserError
from ..plain.specs import external, settings_of
from ..strategies import Strategy, StrategyError, parse_spec, registry
from .executors import check_executor, run_cells

GRID = [1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512, 724, 1024, 1448, 2048, 2896, 4096]


class SweepError(UserError):
    """A sweep setting out of range or in conflict with another."""


@dataclass
class Sweep:
    loaded: LoadedModel
    turns: list[str]
    raw: bool = False
    options: dict = field(default_factory=dict)  # Engine keywords (max_new_tokens, threads, memory, batch...)
    reference: dict | None = None  # the full cache's summary, from the first run
    head: dict | None = None  # the first run's model, device, dtype...
    rows: list[dict] = field(default_factory=list)

    def run(
        self, entries: list[tuple[str, Strategy, int | None]], should_stop: Callable[[], bool] | None = None
    ) -> list[dict] | None:
        """entries: (name, strategy, budget); one lockstep run of all of them; their rows.  `should_stop`, asked
        after every event: True ends the run there (its turn closed cleanly) and returns None."""
        engine = Engine(self.loaded, [parse_spec("full")] + [s for _, s, _ in entries], raw=self.raw, **self.options)
        if should_stop is None:
            result = run_to_end(engine, self.turns)
        else:
            events = engine.run(self.turns)
            result = None
            for event in events:
                if should_stop():
                    events.close()
                    return None
                if event["type"] == "done":
                    result = event["result"]
        if self.reference is None:
            self.reference = result["strategies"]["full"]
            self.head = {k: v for k, v in result.items() if k != "strategies"}
        rows = [
            {"strategy": name, "budget": budget, "spec": strategy.label, **result["strategies"][strategy.label]}
            for name, strategy, budget in entries
        ]
        self.rows += rows
        return rows


class Runner(Sweep):
    """The sweep, saying what each run holds (`say`: a line to the user)."""

    say: Callable[[str], None] = staticmethod(lambda line: None)

    def run(self, entries, note: str = "") -> list[dict]:
        self.say(f"{note}: {', '.join(s.label for _, s, _ in entries)}")
        return super().run(entries)


def parse_budgets(text: str) -> list[int]:
    budgets = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise InputError(f"--budgets: {part!r} is not a positive integer; give e.g. 16,32,64,128")
        if int(part) in budgets:
            raise InputError(f"--budgets: {part} is listed twice")
        budgets.append(int(part))
    return budgets


def check_names(names: list[str], allow_missing: bool) -> tuple[list[str], list[dict]]:
    """The names that can be swept, and notes for those skipped."""
    known = registry()
    keep, skipped = [], []
    for name in names:
        outside = external(name)  # a file's or module's class: loaded (an error where it cannot be)
        base = ":".join(outside) if outside else name.split(":")[0]
        cls = type(parse_spec(base)) if outside else known.get(base)
        if cls is None:
            if not allow_missing:
                raise StrategyError(
                    f"--strategies: {base!r} is not a registered strategy (known: "
                    f"{', '.join(sorted(known))}); pass --allow-missing to skip it"
                )
            skipped.append({"strategy": name, "budget": None, "reason": f"{base!r} is not a registered strategy"})
            continue
        if "budget" not in cls.settings():
            raise StrategyError(
                f"--strategies: {base!r} has no budget setting to sweep (the full cache is always the reference)"
            )
        if any(pair.partition("=")[0] == "budget" for pair in settings_of(name)):
            raise StrategyError(f"--strategies: {name!r} sets budget itself; the sweep sets it, remove budget=")
        keep.append(name)
    return keep, skipped


def plan(names: list[str], budgets: list[int], allow_missing: bool) -> tuple[dict, list[dict]]:
    """{budget: [(name, Strategy)]} to run, and the notes of what is skipped."""
    names, skipped = check_names(names, allow_missing)
    runs: dict[int, list] = {b: [] for b in budgets}
    for name in names:
        errors = []
        for budget in budgets:
            try:
                runs[budget].append((name, parse_spec(f"{name}:budget={budget}")))
            except StrategyError as e:
                errors.append((budget, str(e)))
        if len(errors) == len(budgets):
            raise StrategyError(f"--strategies: {name!r} fits none of the budgets: {errors[0][1]}")
        skipped += [{"strategy": name, "budget": b, "reason": reason} for b, reason in errors]
    return runs, skipped


def sweep_cell(cell: dict) -> dict:
    """One budget's lockstep run in a worker: the model loaded by name, every strategy at `cell["budget"]` against
    the full cache.  Returns {"rows", "head", "reference"} (the last two as `Sweep` keeps them)."""
    loaded = load_model(cell["model"], dtype=cell["dtype"], device=cell["device"], progress=lambda msg: None)
    sweep = Sweep(loaded, list(cell["turns"]), cell["raw"], dict(cell["options"]))
    budget = cell["budget"]
    rows = sweep.run([(name, parse_spec(f"{name}:budget={budget}"), budget) for name in cell["strategies"]])
    return {"rows": rows, "head": sweep.head, "reference": sweep.reference}


def budget_cells(runs: dict, req, loaded, turns: list[str], raw: bool, options: dict) -> list[dict]:
    """The cells of a fixed-budget sweep, one per budget that has strategies, in the budgets' order.  The thread
    count is resolved here (torch's count in this process when --threads is not given), so a worker runs with the
    count an in-process run would have used."""
    threads = validate.threads(options.get("threads"))
    threads = torch.get_num_threads() if threads is None else threads
    return [
        {
            "name": f"{req.model} budget={budget}",
            "model": req.model,
            "dtype": req.dtype,
            "device": loaded.device.type,
            "threads": threads,
            "turns": list(turns),
            "raw": raw,
            "options": {**options, "threads": threads},
            "budget": budget,
            "strategies": [n for n, _ in entries],
        }
        for budget, entries in runs.items()
        if entries
    ]


def target_spec(names: list[str], budgets: list[int], given: str | None) -> tuple[str | None, int | None]:
    """(spec to run and measure, or None) and (bytes, or None)."""
    if given is not None:
        if given.isdigit():
            return None, int(given)
        parse_spec(given)
        return given, None
    for name in names:
        strategy = parse_spec(f"{name}:budget={budgets[0]}")
        if strategy.claims_exact:
            return strategy.label, None
    raise SweepError(
        "--equal-memory: no strategy in --strategies promises exact K/V to take the target from; "
        "give --target SPEC or --target BYTES"
    )


def equal_memory(runner: Runner, names: list[str], budgets: list[int], given: str | None) -> tuple[int, list, list]:
    """Bisection on GRID per strategy for the measured peak closest to the target; returns (target, chosen, probes)."""
    spec, target = target_spec(names, budgets, given)
    probes = []
    if spec is not None:
        row = runner.run([(spec, parse_spec(spec), None)], "target")[0]
        target = row["state_bytes"]["peak"]
        if target is None:
            raise SweepError("--equal-memory needs measured peaks: use --memory storage or trace")
        probes.append(row)
    grid = [b for b in GRID if b < runner.loaded.max_context]
    bounds = {name: [0, len(grid) - 1] for name in names}
    seen: dict[str, dict[int, dict]] = {name: {} for name in names}

    def narrow(name: str, row: dict):
        lo, hi = bounds[name]
        mid = grid.index(row["budget"])
        bounds[name] = [mid + 1, hi] if row["state_bytes"]["peak"] < target else [lo, mid - 1]

    while any(lo <= hi for lo, hi in bounds.values()):
        entries = []
        for name, (lo, hi) in bounds.items():
            if lo > hi:
                continue
            budget = grid[(lo + hi) // 2]
            try:
                entries.append((name, parse_spec(f"{name}:budget={budget}"), budget))
            except StrategyError:  # this budget does not fit the spec: search above it
                bounds[name][0] = (lo + hi) // 2 + 1
        if entries:
            for row in runner.run(entries, f"equal memory, probing {len(entries)} strategies"):
                probes.append(row)
                seen[row["strategy"]][row["budget"]] = row
                narrow(row["strategy"], row)
    chosen = []
    for name in names:
        if seen[name]:
            chosen.append(min(seen[name].values(), key=lambda r: abs(r["state_bytes"]["peak"] - target)))
    return target, chosen, probes


def run_sweep(config, say: Callable[[str], None]) -> dict:
    """`benchmarks.sweep`'s work: `config` is a `benchmarks.SweepConfig`."""
    names = [n.strip() for n in config.strategies.split(",") if n.strip()]
    if not names:
        raise StrategyError("--strategies: empty list")
    if len(set(names)) != len(names):
        raise StrategyError("--strategies: a name is listed twice")
    budgets = parse_budgets(config.budgets)
    if config.target is not None and not config.equal_memory:
        raise SweepError("--target: only with --equal-memory")
    if config.equal_memory and (config.memory == "none" or config.no_instruments):
        raise SweepError(
            "--equal-memory compares measured peaks: it needs --memory storage (the default) or trace, "
            "and the instruments on"
        )
    if config.context is not None:
        raise SweepError("--context: not for sweep; give --prompt, --prompt-file or --scenario")
    if config.executor is not None:
        check_executor(config.executor)
        if config.equal_memory:
            raise SweepError(
                "--executor: not with --equal-memory (its bisection rounds depend on each other; it "
                "runs in this process)"
            )
    if config.workers is not None:
        if config.executor != "local":
            raise SweepError("--workers: only with --executor local (Ray places cells by their resources)")
        validate.integer("workers", config.workers, 1, 4096)
    turns, raw = config.turns()
    if config.equal_memory:
        names, skipped = check_names(names, config.allow_missing)
        runs = {}
    else:
        runs, skipped = plan(names, budgets, config.allow_missing)
        if not any(runs.values()):
            raise StrategyError("--strategies: nothing left to run")
    known = [n for n in names if external(n) or n.split(":")[0] in registry()]  # the rest were skipped or refused
    req = validate.request(
        config.model, config.device, config.dtype, ",".join(known) or "full", config.max_new_tokens, turns, raw
    )
    loaded = load_model(req.model, dtype=req.dtype, device=req.device)
    validate.against_model(req, loaded)
    for budget in budgets:
        validate.integer("budgets", budget, 1, loaded.max_context, "the model's context")
    runner = Runner(loaded, turns, raw, config.engine_options())
    runner.say = say
    out = {"turns": turns, "strategies": names, "skipped": skipped}
    if config.equal_memory:
        target, rows, probes = equal_memory(runner, names, budgets, config.target)
        out.update(equal_memory=True, target_bytes=target, rows=rows, probes=probes, plotted=probes)
        head, reference = runner.head, runner.reference
    elif config.executor is None:
        rows = []
        for budget in budgets:
            if runs[budget]:
                rows += runner.run([(n, s, budget) for n, s in runs[budget]], f"budget {budget}")
        out.update(budgets=budgets, rows=rows, plotted=rows)
        head, reference = runner.head, runner.reference
    else:
        cells = budget_cells(runs, req, loaded, turns, raw, config.engine_options())
        for i, cell in enumerate(cells):
            labels = ", ".join(s.label for _, s in runs[cell["budget"]])
            say(f"budget {cell['budget']} (cell {i + 1} of {len(cells)}, {config.executor}): {labels}")
        results = run_cells(sweep_cell, cells, config.executor, config.workers, say=say)
        rows = [row for result in results for row in result["rows"]]
        out.update(budgets=budgets, rows=rows, plotted=rows)
        head, reference = results[0]["head"], results[0]["reference"]
    return {**head, **out, "reference": reference}
