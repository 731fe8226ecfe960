"""Benchmarks: the typed API the CLI is a thin layer over (`api`), sweeps and their executors, the strategy
kit's conformance rules and the roofline.

The API is re-exported here: ``from kvdirect_app.benchmarks import run, RunConfig`` is the documented way in."""

from .api import (
    BenchError,
    BreakevenConfig,
    CapacityConfig,
    Conversation,
    ReplayConfig,
    RunConfig,
    RunResult,
    SweepConfig,
    TasksConfig,
    breakeven,
    capacity,
    check,
    consume,
    first_turn_events,
    replay,
    run,
    sweep,
    tasks,
)

__all__ = [
    "BenchError",
    "BreakevenConfig",
    "CapacityConfig",
    "Conversation",
    "ReplayConfig",
    "RunConfig",
    "RunResult",
    "SweepConfig",
    "TasksConfig",
    "breakeven",
    "capacity",
    "check",
    "consume",
    "first_turn_events",
    "replay",
    "run",
    "sweep",
    "tasks",
]
