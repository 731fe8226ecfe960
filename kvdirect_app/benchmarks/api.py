"""The benchmarks as typed library calls: a config in, the results (plain JSON-ready data) out.

    from kvdirect_app.benchmarks.api import RunConfig, run
    result = run(RunConfig(model="smollm2-135m", strategies="full,kvdirect:budget=64", scenario="recall"))
    result.lanes["kvdirect:budget=64"]["kv_exact"], result.kernels["mode"], result.device

`python -m kvdirect_app.bench` parses its flags into these configs and prints what they return (`cli/`); the
claims report (`claims/reproduce.py`) calls them directly, in its worker processes, and reads kernels, modes
and devices from the results.  Bad settings raise `BenchError` (a `UserError`: one line naming the setting and
its allowed values).

* `run(RunConfig) -> RunResult`: strategies in lockstep against the full cache (`bench run`).
* `sweep(SweepConfig) -> dict`: every strategy at every budget, or at equal measured memory (`bench sweep`;
  the work itself is `sweeps.py`'s).
* `tasks(TasksConfig) -> dict`: retrieval and QA scores per strategy x budget x context x depth (`bench tasks`;
  the work itself is `task_suite/runner.py`'s).
* `breakeven(BreakevenConfig) -> dict`, `replay(ReplayConfig) -> dict`, `capacity(CapacityConfig) -> dict`:
  AnchorKV's arithmetic, its cascade against naive replay, and parked sessions (`bench breakeven/replay/capacity`;
  the sessions parked and measured in `parking.py`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import psutil
import torch

from ..engine import guard, validate
from ..engine.runner import MEMORY_MODES, PREFILL_CHUNK, Engine, model_lock
from ..kernels.invariant import MODES as KERNEL_MODES
from ..models.geometry import ModelGeometry, breakeven_report, load_config
from ..models.loading import load_model, resolve_dtype
from ..models.prompts import Prompter, filler_ids
from ..plain.errors import UserError
from ..plain.scenarios import scenarios
from ..strategies.anchorkv import AnchorKV, rebuild_all
from . import sweeps
from .parking import capacity_strategies, park
from .task_suite.runner import run_tasks

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


class BenchError(UserError):
    """A benchmark setting out of range or in conflict with another; printed as one line, exit status 2."""


def _stderr(line: str):
    print(line, file=sys.stderr)


class _Config:
    @classmethod
    def from_args(cls, args, **overrides):
        """The config from an argparse namespace whose names are the fields' (the CLI's flags)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})


# --- run ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conversation(_Config):
    """What `run` and `sweep` share: the model, the conversation, the device, timing and memory."""

    model: str = "smollm2-135m"
    prompt: str | None = None
    prompt_file: str | None = None
    scenario: str | None = None
    context: int | None = None  # one raw turn of exactly this many tokens of the long-document preset
    raw: bool = False
    max_new_tokens: int = 64
    dtype: str = "float32"
    device: str = "auto"
    threads: int | None = None
    memory: str = "auto"
    no_instruments: bool = False
    sequential: bool = False
    no_twins: bool = False
    prefill_chunk: int = PREFILL_CHUNK
    kernels: str = "invariant"

    def turns(self) -> tuple[list[str], bool]:
        """User turns and whether to feed them raw."""

        given = [x for x in (self.prompt, self.prompt_file, self.scenario, self.context) if x is not None]
        if len(given) > 1:
            raise BenchError("give only one of --prompt, --prompt-file, --scenario, --context")
        if self.context is not None:
            return [f"({self.context} tokens of the long-document preset)"], True
        if self.prompt_file is not None:
            path = Path(self.prompt_file)
            if not path.is_file():
                raise BenchError(f"--prompt-file: no such file {self.prompt_file!r}")
            return [path.read_text(encoding="utf-8")], self.raw
        if self.scenario is not None:
            table = scenarios()
            if self.scenario not in table:
                raise BenchError(f"--scenario: unknown scenario {self.scenario!r}; allowed: {', '.join(table)}")
            scenario = table[self.scenario]
            return list(scenario["turns"]), self.raw or scenario.get("raw", False)
        return [DEFAULT_PROMPT if self.prompt is None else self.prompt], self.raw

    def engine_options(self) -> dict:
        """The Engine keywords these settings give."""
        return dict(
            max_new_tokens=self.max_new_tokens,
            threads=self.threads,
            memory=self.memory,
            batch=not self.sequential,
            twins=not self.no_twins,
            prefill_chunk=self.prefill_chunk,
            kernels=self.kernels,
            instruments=not self.no_instruments,
        )


@dataclass(frozen=True)
class RunConfig(Conversation):
    strategies: str = "full,kvdirect:budget=64:mode=exact"
    park: bool = False  # park every session between turns and resume it


@dataclass
class RunResult:
    """A lockstep run's results: `data` is the JSON `bench run --json` writes (unstamped)."""

    data: dict
    engine: object  # the Engine that ran it (its token and attention maps for a recording)

    @property
    def lanes(self) -> dict:
        return self.data["strategies"]

    @property
    def kernels(self) -> dict:
        return self.data["kernels"]

    @property
    def device(self) -> str:
        return self.data["device"]


def check(
    config: Conversation,
    specs: str,
    turns: list[str],
    raw: bool,
    compare: bool = True,
    dry_run: bool = False,
    say: Callable[[str], None] = print,
):
    """Every setting through `validate` (the same checks as the app and the API), the model loaded, then the
    memory guard.  Returns (request, loaded model, memory estimate, first turn's ids or None)."""
    validate.integer("threads", 1 if config.threads is None else config.threads, 1, 4096)
    validate.integer("prefill_chunk", config.prefill_chunk, 1, 1 << 20)
    if config.memory not in MEMORY_MODES:
        raise BenchError(f"memory: {config.memory!r} is not allowed; allowed: {', '.join(MEMORY_MODES)}")
    if config.kernels not in KERNEL_MODES:
        raise BenchError(f"kernels: {config.kernels!r} is not allowed; allowed: {', '.join(KERNEL_MODES)}")
    req = validate.request(config.model, config.device, config.dtype, specs, config.max_new_tokens, turns, raw)
    loaded = load_model(req.model, dtype=req.dtype, device=req.device)
    ids = None
    if config.context is not None:
        validate.integer(
            "context",
            config.context,
            2,
            loaded.max_context - 1 - req.max_new_tokens,
            "the model's context less max_new_tokens",
        )
        ids = filler_ids(loaded.tokenizer, config.context)
    total = validate.against_model(req, loaded, prompt_tokens=None if ids is None else len(ids))
    prompt = len(ids) if ids is not None else len(Prompter(loaded, raw).first(turns[0]))
    est = guard.estimate(
        loaded.config,
        loaded.dtype,
        list(req.strategies),
        prompt,
        total,
        config.prefill_chunk,
        twins=not config.no_twins,
        compare=compare,
        turns=len(turns),
        kernels=config.kernels,
    )
    if dry_run:
        free, source = guard.available(loaded.device)
        verdict = "fits" if est.total * guard.HEADROOM <= free else "does NOT fit"
        say(f"memory estimate: {est.describe()}; free {guard.fmt_bytes(free)} ({source}): {verdict}")
    guard.check(est, loaded.device)
    return req, loaded, est, ids


def first_turn_events(engine, text: str, ids: list[int]):
    """A one-turn run given its token ids (`context`), as events ending in "done" like `Engine.run`."""
    yield from engine.turn(text, ids=ids)
    yield {"type": "done", "result": engine.results()}


def consume(events, recorder=None, say: Callable[[str], None] = _stderr) -> dict:
    """Every event (each into the recording, if any); the "done" event's results.  A line per prompt piece read."""
    result = None
    for event in events:
        if recorder is not None:
            recorder.add(event)
        if event["type"] == "done":
            result = event["result"]
        elif event["type"] == "prefill":
            say(f"turn {event['turn'] + 1}: read {event['done']:,} of {event['total']:,} prompt tokens")
    return result


def run(config: RunConfig, recorder=None, say: Callable[[str], None] = _stderr) -> RunResult:
    """Strategies in lockstep against the full cache, on `config`'s conversation (`bench run`)."""
    turns, raw = config.turns()
    req, loaded, est, ids = check(config, config.strategies, turns, raw)
    engine = Engine(loaded, list(req.strategies), raw=raw, compare=True, **config.engine_options())
    events = engine.run(turns, park=config.park) if ids is None else first_turn_events(engine, turns[0], ids)
    data = consume(events, recorder, say)
    data["memory_estimate"] = {"total_bytes": est.total, "lanes": est.lanes, "tokens": est.tokens}
    return RunResult(data, engine)


# --- sweep -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepConfig(Conversation):
    # AnchorKV with only the token-id anchor (the deepest spacing of any model) and rebuild=step first: the exact
    # strategy that saves memory, and so equal_memory's default target.
    strategies: str = "anchorkv:anchors=0:rebuild=step,kvdirect,window,streaming_llm,h2o,snapkv,tova,knorm,pyramidkv"
    budgets: str = "16,32,64,128"
    equal_memory: bool = False
    target: str | None = None  # with equal_memory: a spec whose measured peak is the target, or bytes
    allow_missing: bool = False
    executor: str | None = None
    workers: int | None = None


def sweep(config: SweepConfig, say: Callable[[str], None] = _stderr) -> dict:
    """Every strategy at every budget against the full cache, or each at the budget whose measured peak is
    closest to a target (`bench sweep`).  Returns the sweep JSON's fields (unstamped), with `plotted`: the rows a
    frontier plot shows (every probe at equal memory)."""
    return sweeps.run_sweep(config, say)


# --- tasks ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TasksConfig(_Config):
    """Retrieval and QA scores for every strategy (`bench tasks`; `task_suite/runner.py`).  Unset grid settings take
    the default grid, or with `quick` the quick one (two contexts, three depths, two tasks, one budget)."""

    model: str = "smollm2-135m"
    strategies: str = "kvdirect,anchorkv,window,streaming_llm,h2o,snapkv,tova,knorm,pyramidkv"
    budgets: str | None = None  # unset: the grid's (task_suite/grid.py DEFAULT, QUICK), or none beside `ratios`
    ratios: str | None = None  # compression ratios (kvpress's), each lane's budget from its sample's prompt
    contexts: str | None = None
    depths: str | None = None
    tasks: str | None = None
    samples: int | None = None  # seeds per (task, context, depth), or conversations per (task, context); unset: grid's
    multiturn: bool = False  # conversations: turn 1 a context with a needle per turn, each turn asking another
    turns: int | None = None  # --multiturn: turns per conversation (unset: the grid's)
    asked: str | None = None  # --multiturn: the turns that ask about turn 1 ("5,10,20"; the others chat); unset: all
    question: str | None = None  # "after" or "with-context" (tasks/scores.QUESTIONS); unset: after with ratios
    history: str | None = None  # --multiturn: "keep" (unset) or "drop" (tasks/scores.HISTORIES)
    seed: int = 0
    haystack: str = "noise"
    quick: bool = False
    dtype: str = "float32"
    device: str = "auto"
    threads: int | None = None
    kernels: str = "invariant"
    prefill_chunk: int = PREFILL_CHUNK
    executor: str | None = None
    workers: int | None = None


def tasks(config: TasksConfig, say: Callable[[str], None] = _stderr) -> dict:
    """Every strategy at every budget on generated retrieval tasks, scored against their references, the exact
    strategies' answers checked against the full cache's (`bench tasks`).  Returns the tasks JSON's fields."""
    return run_tasks(config, say)


# --- AnchorKV: breakeven, replay, capacity ---------------------------------------------------------------------------
@dataclass(frozen=True)
class BreakevenConfig(_Config):
    model: str | None = None
    config: str | None = None  # a config.json (instead of a model)
    dtype: str = "bfloat16"
    context: int = 32768  # for the sliding-window view
    max_passes: int | None = None  # replay bound of the DP anchor placement


def breakeven(config: BreakevenConfig) -> dict:
    """Bytes per token and the break-even anchor spacing, from a config alone (arithmetic, no model run)."""
    if (config.model is None) == (config.config is None):
        raise BenchError("give exactly one of --model NAME or --config PATH")
    if config.config is not None and not Path(config.config).is_file():
        raise BenchError(f"--config: no such file {config.config!r}")
    try:
        cfg = load_config(config.config or config.model)
    except (OSError, ValueError) as e:
        raise BenchError(f"--model: cannot read a config for {config.model!r} ({str(e).splitlines()[0]})") from None
    geom = ModelGeometry.from_config(cfg, resolve_dtype(config.dtype))
    report = breakeven_report(geom, context=config.context, max_passes=config.max_passes)
    return {**report, "source": config.config or config.model, "dtype": config.dtype}


def _context_engine(loaded, strategies, n: int):

    if n < 2 or n >= loaded.max_context:
        raise BenchError(f"--context: {n} must be between 2 and the model's context {loaded.max_context - 1}")
    engine = Engine(loaded, strategies, max_new_tokens=1, raw=True)
    for _ in engine.turn("context", ids=filler_ids(loaded.tokenizer, n)):
        pass
    return engine


@dataclass(frozen=True)
class ReplayConfig(_Config):
    spacing: int
    model: str = "smollm2-135m"
    context: int = 1024
    dtype: str = "float32"
    device: str = "auto"
    threads: int | None = None


def replay(config: ReplayConfig) -> dict:
    """Cascade against naive replay of the layers between anchors, timed side by side, each checked bit for bit
    against the full cache."""
    validate.threads(config.threads)
    loaded = load_model(config.model, dtype=config.dtype, device=config.device)
    geom = ModelGeometry.from_config(loaded.config, loaded.dtype)
    if not 1 <= config.spacing <= geom.num_layers:
        raise BenchError(f"--spacing: {config.spacing} must be between 1 and L={geom.num_layers}")
    strategy = AnchorKV(spacing=config.spacing, budget=1)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    engine = _context_engine(loaded, [strategy], config.context)
    cache, reference = engine.lanes[0].cache, engine.reference.cache
    anchors = strategy.anchor_layers(geom)
    rows = {}
    lane, observer = engine.lanes[0], engine.observer
    with model_lock(loaded.model), torch.inference_mode(), engine.kernel_scope():
        for kind in ("cascade", "naive"):
            observer.tallies[lane.label].clear()  # the observer counts the replay's passes and calls
            t0 = time.perf_counter()
            with observer.region(lane.owner, "replay"):
                kv = rebuild_all(cache, kind)
            elapsed = time.perf_counter() - t0
            exact = all(
                torch.equal(k, reference.layers[g].keys) and torch.equal(v, reference.layers[g].values)
                for g, (k, v) in kv.items()
            )
            tally = observer.tallies[lane.label]
            rows[kind] = {
                "seconds": elapsed,
                "layer_passes": tally["layer passes"],
                "layer_calls": tally["layer calls"],
                "kv_exact": exact,
                "expected_passes": geom.replay_passes(anchors, cascade=kind == "cascade"),
            }
            del kv
    speedup = rows["naive"]["seconds"] / rows["cascade"]["seconds"]
    ideal = rows["naive"]["layer_passes"] / rows["cascade"]["layer_passes"]
    return {
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "context": config.context,
        "spacing": config.spacing,
        "anchors": anchors,
        "kernels": engine.kernels.report(),
        "replay": rows,
        "speedup": speedup,
        "ideal_pass_ratio": ideal,
        "speedup_over_ideal": speedup / ideal,
    }


@dataclass(frozen=True)
class CapacityConfig(_Config):
    model: str = "smollm2-135m"
    context: int = 32768
    memory_gb: float | None = None  # default: this machine's memory
    measure_context: int = 1024  # sessions are parked and resumed at min(context, this) tokens
    measure: int = 0  # sessions of each strategy parked in this process (at least one)
    budget: int = 64
    dtype: str = "float32"
    device: str = "auto"
    threads: int | None = None


def capacity(config: CapacityConfig, say: Callable[[str], None] = _stderr) -> dict:
    """Parked bytes per session by formula at `context` and measured at min(context, measure_context) tokens,
    sessions that fit in memory, resume time and the next turn's first token."""
    validate.threads(config.threads)
    if config.context < 2:
        raise BenchError(f"--context: {config.context} must be >= 2")
    if config.measure < 0:
        raise BenchError(f"--measure: {config.measure} must be >= 0 (sessions to park for real)")
    if config.budget < 1:
        raise BenchError(f"--budget: {config.budget} must be >= 1")
    loaded = load_model(config.model, dtype=config.dtype, device=config.device)
    geom = ModelGeometry.from_config(loaded.config, loaded.dtype)
    memory = (config.memory_gb * 2**30) if config.memory_gb else psutil.virtual_memory().total
    if memory <= 0:
        raise BenchError(f"--memory-gb: {config.memory_gb} must be > 0")
    L = geom.num_layers
    spacings = sorted({1, 2, geom.break_even_spacing(token_id_anchor=True) or L, L // 2 or 1, L})
    full_bytes = geom.full_kv_bytes(config.context)
    n = min(config.context, config.measure_context, loaded.max_context - 1)
    rows, kernels = [], None
    for name, strategy in capacity_strategies(geom, spacings, config.budget):
        say(f"{name}: parking {max(1, config.measure)} session(s) of {n} tokens…")
        m = park(loaded, strategy, n, config.measure, config.threads)
        kernels = m.pop("kernels")
        parked = strategy.formula_parked(geom, config.context)
        rows.append(
            {
                "strategy": name,
                "parked_bytes": parked,
                "parked_bytes_per_token": parked / config.context,
                "sessions": int(memory // parked),
                "capacity_vs_full": full_bytes / parked,
                "measured_at": n,
                "formula_parked_bytes_at_measure": strategy.formula_parked(geom, n),
                **m,
                # Linear in tokens: a lower bound, since replayed attention grows faster than linearly.
                "next_ttft_ms_at_context_lower_bound": None
                if m["next_ttft_ms"] is None
                else m["next_ttft_ms"] * config.context / n,
                "estimated": n < config.context,
            }
        )
    return {
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "threads": torch.get_num_threads() if config.threads is None else config.threads,
        "context": config.context,
        "memory_bytes": memory,
        "full_kv_bytes": full_bytes,
        "budget": config.budget,
        "kernels": kernels,
        "rows": rows,
        "max_context": loaded.max_context,
    }
