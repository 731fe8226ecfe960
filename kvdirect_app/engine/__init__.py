"""The engine: every chosen strategy in lockstep on one conversation (`runner`), with its lanes (built in
`lane_building`), a turn's steps (`turn_steps`), forwards, hooks, the state between turns (`between_turns`),
teacher-forced twins (`teacher_forcing`), token maps (`token_maps`), the run's report (`summary`), the preflight
checks (`guard`, `validate`) and the integration with transformers' `generate` (`integration`, the public
`kvdirect_app.strategy_cache`, with `cache_hooks` and `verifier`).

`Engine` and `run_to_end` are re-exported here: ``from kvdirect_app.engine import Engine`` is the documented way
in."""

from .runner import (
    MEMORY_MODES,
    Engine,
    InputError,
    InputTap,
    Prompter,
    memory_instrument,
    model_lock,
    run_to_end,
    step_summary,
)

__all__ = [
    "Engine",
    "InputError",
    "InputTap",
    "Prompter",
    "model_lock",
    "run_to_end",
    "MEMORY_MODES",
    "memory_instrument",
    "step_summary",
]
