"""Engine runs shared by the tests: each distinct run happens once per test process, and every test that asserts
on it reads it from here (`run_once`).

The tiny families' checks (KV-Direct's and AnchorKV's exactness, lanes batched against one by one, the
attention snapshot, eviction at a budget larger than the conversation) read one *union* run per family and
dtype (`tiny_union`): every lane any of them asserts on, in one lockstep engine over one three-turn
conversation.  A lane's figures do not depend on which other lanes share its engine (batched and one-by-one
passes give the same bits: `tests/engine/test_lockstep.py` checks it on this very run), so each check sees what
its own smaller run would have shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdirect_app.engine.runner import Engine
from kvdirect_app.models.loading import load_model
from kvdirect_app.strategies import parse_specs

from .specs import EVICTION, every

TINY_FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-olmo2", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"]
TINY_TURNS = ("Tell me about caches.", "Why do keys need positions?")
TINY_NEW_TOKENS = 8

# KV-Direct: 1 and 5 < prompt < sliding window 12 < 16 < the whole conversation < 500.
KVDIRECT_BUDGETS = (1, 5, 16, 500)
KVDIRECT_LANES = tuple(f"kvdirect:budget={b}:mode=exact" for b in KVDIRECT_BUDGETS) + (
    "kvdirect:budget=3:rebuild=turn",
)
ANCHORKV_EXTRA = (
    "anchorkv:spacing=2:budget=3:token_id_anchor=false:replay=naive",
    "anchorkv:anchors=dp:spacing=2:budget=2:rebuild=step",
    "anchorkv:anchors=0-2:budget=1",
)
# Every strategy once, exact and lossy (tests/specs.py: a strategy not named here joins at budget 6): the lanes
# compared batched against one by one.
LOCKSTEP = every(
    (
        "full",
        "kvdirect:budget=4",
        "kvdirect:budget=3:mode=fast",
        "anchorkv:spacing=2:budget=3:rebuild=step",
        "anchorkv:spacing=2:budget=3",
        "h2o:budget=8",
        "snapkv:budget=16",
        "tova:budget=6",
        "streaming_llm:budget=8",
        "window:budget=6",
        "knorm:budget=6",
        "pyramidkv:budget=8:window=2",
    ),
    budget=6,
)
ATTENTION = (
    "full",
    "kvdirect:budget=4",
    "anchorkv:spacing=2:budget=3",
    "h2o:budget=8",
    "snapkv:budget=16",
    "window:budget=6",
)
LARGE_BUDGET = tuple(f"{name}:budget=400" for name in EVICTION)  # every eviction strategy (tests/specs.py)
# AnchorKV's one-chunk replay (KV-Direct's fast mode is among LOCKSTEP's lanes).
ANCHORKV_FAST = ("anchorkv:spacing=2:budget=2:mode=fast:rebuild=step",)


def tiny(name: str, dtype: str = "float32"):
    return load_model(name, dtype=dtype, device="cpu")


def anchorkv_lanes(layers: int) -> tuple[str, ...]:
    return tuple(f"anchorkv:spacing={s}:budget=2:rebuild=step" for s in range(1, layers + 1)) + ANCHORKV_EXTRA


@dataclass
class Run:
    """One engine run, kept: the engine after it, its results, its events, and what was seen along the way."""

    engine: Engine
    result: dict
    events: list[dict]
    # Per step: label -> (logits, teacher-forced twin's logits or None), for every lane and twin of the engine.
    steps: list[dict] = field(default_factory=list)
    # label -> layer -> positions evicted right after the last turn's first decode step.
    evicted_at_last_turn: dict = field(default_factory=dict)

    @property
    def kinds(self) -> list[str]:
        return [event["type"] for event in self.events]


_RUNS: dict[tuple, Run] = {}


def run_once(
    loaded,
    specs: str | tuple | list,
    turns=TINY_TURNS,
    max_new_tokens: int = TINY_NEW_TOKENS,
    *,
    park: bool = False,
    steps: bool = False,
    snapshots: bool = True,
    **options,
) -> Run:
    """The run of these lanes over this conversation with these engine options, made the first time it is asked
    for in this process and kept.  `steps` keeps every lane's logits after every step; `snapshots` False turns
    the attention snapshots off."""
    specs = specs if isinstance(specs, str) else ",".join(dict.fromkeys(specs))
    # The allocator's trace unless a test asks for another instrument: the tests' byte checks are against it, and
    # every traced run audits the allocator's ledger (the default instrument) beside it
    # (`tests/measure/test_memory.py`).
    options.setdefault("memory", "trace")
    key = (
        loaded.name,
        str(loaded.dtype),
        str(loaded.device),
        specs,
        tuple(turns),
        max_new_tokens,
        park,
        steps,
        snapshots,
        tuple(sorted(options.items())),
    )
    if key not in _RUNS:
        _RUNS[key] = _run(loaded, specs, list(turns), max_new_tokens, park, steps, snapshots, options)
    return _RUNS[key]


def _run(loaded, specs, turns, max_new_tokens, park, steps, snapshots, options) -> Run:
    engine = Engine(loaded, parse_specs(specs), max_new_tokens=max_new_tokens, **options)
    engine.instruments.snapshots = snapshots
    run = Run(engine, None, [])
    turn = 0
    for event in engine.run(turns, park=park):
        run.events.append(event)
        if event["type"] == "turn":
            turn += 1
        elif event["type"] == "step":
            if steps:
                run.steps.append(
                    {
                        lane.label: (lane.logits.clone(), None if lane.tf_logits is None else lane.tf_logits.clone())
                        for lane in engine.all_lanes
                    }
                )
            if turn == len(turns) and not run.evicted_at_last_turn and engine.loaded.name.startswith("tiny-"):
                for label in engine.show:
                    layers = range(len(engine.reference.cache.layers))
                    run.evicted_at_last_turn[label] = {
                        j: {i for i, s in enumerate(engine.token_map(label, j)["states"]) if s == "evicted"}
                        for j in layers
                    }
        elif event["type"] == "done":
            run.result = event["result"]
    return run


def one_by_one(batched: Run, specs=LOCKSTEP) -> Run:
    """`specs` over the batched run's conversation, with its options, each lane in a pass of its own."""
    engine = batched.engine
    turns = [e["user"] for e in batched.events if e["type"] == "turn"]
    return run_once(
        engine.loaded,
        specs,
        turns,
        engine.max_new_tokens,
        steps=True,
        batch=False,
        threads=engine.threads,
        prefill_chunk=engine.prefill_chunk,
        twins=engine.twins,
        kernels=engine.kernels.requested,
    )


def union_specs(loaded) -> tuple[str, ...]:
    lanes = (
        ("full",)
        + KVDIRECT_LANES
        + anchorkv_lanes(loaded.config.num_hidden_layers)
        + ANCHORKV_FAST
        + LOCKSTEP
        + ATTENTION
    )
    if loaded.dtype == torch.float32:
        lanes += LARGE_BUDGET
    return tuple(dict.fromkeys(lanes))


def tiny_union(family: str, dtype: str = "float32", kernels: str = "invariant") -> Run:
    """The tiny family's union run (one thread: these matrices are too small for a second one to pay)."""
    loaded = tiny(family, dtype)
    return run_once(loaded, union_specs(loaded), steps=True, threads=1, kernels=kernels)


def all_sliding(loaded) -> bool:
    """Every layer slides (tiny-mistral): such layers keep their window like the full cache, nothing is rebuilt."""
    from kvdirect_app.models.compat import layer_specs

    return all(spec.is_sliding for spec in layer_specs(loaded.config))


def differences(a, b, path: str = "") -> list[str]:
    """Where two results differ: a path per differing leaf (what a failed comparison prints)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in dict.fromkeys([*a, *b])
            for d in (
                differences(a[k], b[k], f"{path}/{k}") if k in a and k in b else [f"{path}/{k}: on one side only"]
            )
        ]
    return [] if a == b else [f"{path}: {str(a)[:80]} != {str(b)[:80]}"]
