"""`bench reproduce`: every claim of the two papers next to our measurement, in one report.

    python -m kvdirect_app.bench reproduce [--model NAME] [--quick] [--executor local|ray] --out DIR
    python -m kvdirect_app.bench reproduce --render DIR

The work is a list of independent cells (`plan`: one benchmark each, a
typed library call of `benchmarks` (`kind`: run, sweep, breakeven, replay,
capacity; `config`: its settings) with its results, the recompute-vs-read
microbenchmark or residual patching), run by `cells.gather` through
`executors.run_cells` in a bounded process pool or on Ray; each cell
records the environment it ran in, in the process that ran it, and is
kept as it finishes, so a run that did not end resumes from its finished
cells (the report names them).  `gather` puts the cells into one dict
(results.json), and `reassess` adds what follows from them: the claims
with the papers' figures (`papers`), our figures and the one rule's
verdicts (`sections`, `verdicts`).  `render` writes report.md and the plots from that dict alone.  `load` reads a
results.json back and recomputes everything that is not a cell, so
`--render` never trusts a stored verdict.  This module imports no torch
(the UI's claims tab loads it to read the committed report); running the
cells, which does, is `cells`'s.

What `--quick` runs is `QUICK` below (the full run: `FULL`); the report
lists every knob in which they differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..plain.catalog import PRESETS_DIR, embedded_presets, presets
from ..plain.errors import UserError
from ..plain.schema import SchemaError, check
from .papers import SECTIONS
from .sections import assess
from .verdicts import EXACT_TOLERANCE, SIZE_TOLERANCE, VERDICTS, rule_text

FAMILIES = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-olmo2",
    "tiny-mistral",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-llama-mha",
]
# A model without grouped-query attention: a residual is half a layer's K/V (r = 0.5), where KV-Direct's own
# lane can hold claim 2 (on SmolLM2, r = 1.5, it cannot).
MHA = "tiny-llama-mha"
EVICTION = ["window", "streaming_llm", "h2o", "snapkv", "tova", "knorm", "pyramidkv"]
# The twenty-turn run's lanes by name: {s} the break-even spacing s*, {L} the number of layers, {b} the budget.
LANES = {
    "full": "full",
    "kvdirect": "kvdirect:budget={b}",
    "anchorkv:spacing=s*:rebuild=step": "anchorkv:spacing={s}:budget={b}:rebuild=step",
    "anchorkv:spacing=L:rebuild=step": "anchorkv:spacing={L}:budget={b}:rebuild=step",
    "anchorkv:spacing=L:rebuild=turn": "anchorkv:spacing={L}:budget={b}:rebuild=turn",
    **{e: e + ":budget={b}" for e in EVICTION},
}


@dataclass(frozen=True)
class Knobs:
    """How much of each benchmark a run does."""

    new_tokens: int  # new tokens per turn: the recall sweep, the model's own exactness run
    turns_new_tokens: int  # new tokens per turn of the twenty-turn run
    turns_lanes: tuple[str, ...]  # the twenty-turn run's lanes (keys of LANES)
    equal_memory: bool  # the twenty-turn sweep of the baselines at equal measured peak
    budgets: tuple[int, ...]  # the recall sweep's budgets
    recompute_batches: tuple[int, ...]
    recompute_contexts: tuple[int, ...]
    replay_context: int  # tokens
    park_context: int  # tokens at which sessions are parked and measured by the allocator
    model_bf16: bool  # the model's own exactness run in bf16 as well (the tiny families always run both)
    real_size: bool  # the public configs built at full size with random weights (claims/realsize.py)
    task_contexts: tuple[int, ...]  # claim 9's samples: prompt lengths (tokens) ...
    task_names: tuple[str, ...]  # ... and tasks (`bench tasks`), at depths 0, 50 and 100 %
    answer_turns: int = 20  # the twenty-turn section's answers: turns of each `bench tasks --multiturn` conversation
    answer_conversations: int = 1  # ... and how many conversations (seeds)
    answer_asked: tuple[int, ...] = (5, 10, 20)  # ... and the turns that ask about turn 1 (the others chat)


# The full run: every lane, grid and model, with one cut meant to bring SmolLM2 within 90 minutes on 2 CPU cores:
# the twenty-turn run plays 12 new tokens per turn, not 24.  Its rebuild=step lanes replay every old token at every
# step, so their work grows with turns^2 x tokens: at 24 that one cell alone outlasted its share of the 90
# minutes.  Its figures (bytes between turns, peak per turn) are read on a
# shorter conversation, so they are not those of a run at 24.
FULL = Knobs(
    new_tokens=24,
    turns_new_tokens=12,
    turns_lanes=tuple(LANES),
    equal_memory=True,
    budgets=(16, 32, 64, 128),
    recompute_batches=(1, 4, 16, 64),
    recompute_contexts=(256, 1024, 4096),
    replay_context=1024,
    park_context=1024,
    model_bf16=True,
    real_size=True,
    task_contexts=(512, 1024, 2048),
    task_names=("niah_single_number", "niah_multikey", "niah_multivalue", "variable_tracking", "qa"),
    answer_conversations=3,
)
# --quick: SmolLM2 within 10 minutes on 2 CPU cores.  The twenty-turn run dominates (its rebuild=step lanes
# replay every old token at every step, so their work grows with turns x tokens): four new tokens per turn
# instead of eight, and six of the twelve lanes (the exact lane with the lowest peak, KV-Direct's own, three
# baselines) cut it to about a quarter of the earlier quick run's.
QUICK = Knobs(
    new_tokens=8,
    turns_new_tokens=4,
    turns_lanes=("full", "kvdirect", "anchorkv:spacing=L:rebuild=step", "streaming_llm", "h2o", "tova"),
    equal_memory=False,
    budgets=(16, 64),
    recompute_batches=(1, 8),
    recompute_contexts=(256, 1024),
    replay_context=512,
    park_context=256,
    model_bf16=False,
    real_size=False,
    task_contexts=(1024,),
    task_names=("niah_single_number", "qa"),
)
# The byte-level tiny models (tests) hold 1,024 tokens: short turns, small budgets and contexts.
TINY = dict(
    new_tokens=4,
    turns_new_tokens=4,
    budgets=(4, 8),
    replay_context=128,
    park_context=64,
    model_bf16=True,
    real_size=False,
    task_contexts=(512,),
    task_names=("niah_single_number",),
    answer_turns=3,
    answer_conversations=1,
    answer_asked=(2, 3),
)
LABELS = {
    "turns_new_tokens": "new tokens per turn in the twenty-turn run",
    "turns_lanes": "lanes of the twenty-turn run",
    "equal_memory": "the twenty-turn sweep of the baselines at equal measured peak",
    "new_tokens": "new tokens per turn in the recall sweep and the model's own exactness run",
    "budgets": "budgets of the recall sweep",
    "recompute_batches": "batch sizes of recompute vs read",
    "recompute_contexts": "contexts of recompute vs read",
    "replay_context": "tokens of the replay benchmark",
    "park_context": "tokens at which sessions are parked and measured",
    "model_bf16": "the model's own exactness run in bf16",
    "task_contexts": "contexts of the task samples (tokens)",
    "task_names": "tasks of the task samples",
    "answer_turns": "turns of the conversations scored in the twenty-turn section",
    "answer_conversations": "conversations scored in the twenty-turn section",
    "answer_asked": "turns asking about turn 1 in the twenty-turn section",
    "real_size": "exactness at the public configs' real size, random weights (Qwen2.5-0.5B, Llama 3.2-1B, "
    "Qwen3-4B, Gemma 3-4B)",
}


def knobs(model: str, quick: bool) -> Knobs:
    chosen = QUICK if quick else FULL
    return replace(chosen, **TINY) if model.startswith("tiny-") else chosen


def leaves_out(quick: dict, full: dict) -> list[str]:
    """What a run with knobs `quick` leaves out of one with `full`, one phrase per knob that differs."""
    out = []
    for key, label in LABELS.items():
        if key not in quick or key not in full:  # a knob added after the run was made
            continue
        q, f = quick[key], full[key]
        if q == f:
            continue
        if key == "turns_lanes":
            out.append(f"{label}: {', '.join(x for x in f if x not in q)} (it runs {', '.join(q)})")
        elif isinstance(f, bool):
            out.append(label)
        else:
            words = lambda v: ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
            out.append(f"{label}: {words(q)} (full run: {words(f)})")
    return out


# --- the plan --------------------------------------------------------------------------------------------------
def plan(model: str, quick: bool, device: str = "auto", threads: int = 1) -> list[dict]:
    """Every cell of the report for `model`, with the knobs of `knobs(model, quick)`."""
    from ..models.geometry import ModelGeometry, load_config  # lazy: torch; the UI loads this module without it

    k = knobs(model, quick)
    geom = ModelGeometry.from_config(load_config(model))
    L = geom.num_layers
    s_star = geom.break_even_spacing(token_id_anchor=True) or L
    tiny = model.startswith("tiny-")
    budget = 8 if tiny else 32
    common = dict(model=model, device=device, threads=threads)
    traced = dict(memory="trace")  # the claims' bytes are the allocator's
    cells = []
    sources = [("model", p) for p in presets() if not p.startswith("tiny-") or p in (model, MHA)]
    sources += [
        ("config", str(f.relative_to(PRESETS_DIR.parent))) for f in sorted((PRESETS_DIR / "configs").glob("*.json"))
    ]
    for key, source in sources:
        cells.append(
            {
                "kind": "breakeven",
                "section": "bytes",
                "name": f"bytes {Path(source).stem}",
                "config": {key: source, "dtype": "bfloat16"},
            }
        )
    specs = [LANES[lane].format(s=s_star, L=L, b=budget) for lane in k.turns_lanes]
    # The byte-level tiny models cannot hold twenty turns in their 1,024 tokens: they play three.
    scenario = "capitals" if tiny else "twenty-turns"
    cells.append(
        {
            "kind": "run",
            "section": "turns20",
            "name": scenario,
            "scenario": scenario,
            "config": {
                **common,
                **traced,
                "scenario": scenario,
                "max_new_tokens": k.turns_new_tokens,
                "strategies": ",".join(specs),
            },
        }
    )
    # The same section in answers (the papers' setting): conversations whose turn 1 holds a needle for each of turns 5,
    # 10 and 20, which ask about them, the turns between the twenty-turn scenario's chat (`bench tasks --multiturn
    # --asked 5,10,20`), at the twenty-turn run's budget and with its baselines.
    cells.append(
        {
            "kind": "tasks",
            "section": "turns20",
            "name": f"answers over {k.answer_turns} turns",
            "config": {
                **common,
                "multiturn": True,
                "turns": k.answer_turns,
                "asked": ",".join(map(str, k.answer_asked)),
                "contexts": "512" if tiny else "1024",
                "tasks": "niah_single_number",
                "samples": k.answer_conversations,
                "budgets": str(budget),
                "question": "after",
                "strategies": ",".join(["anchorkv", "kvdirect", *[e for e in EVICTION if e in k.turns_lanes]]),
            },
        }
    )
    if model != MHA:  # KV-Direct's own lane where r < 1: three turns of the byte-level MHA model
        mha_layers = ModelGeometry.from_config(load_config(MHA)).num_layers
        cells.append(
            {
                "kind": "run",
                "section": "turns20",
                "name": f"capitals on {MHA}",
                "scenario": "capitals",
                "config": {
                    **common,
                    **traced,
                    "model": MHA,
                    "scenario": "capitals",
                    "max_new_tokens": 4,
                    "strategies": f"full,kvdirect:budget=8,anchorkv:spacing={mha_layers}:budget=8:rebuild=step",
                },
            }
        )
    if k.equal_memory:  # the baselines, each at the budget whose measured peak is closest to AnchorKV's lowest exact
        # lane's in the same conversation (the sweep measures that lane itself; a sweep of baselines alone has no
        # target)
        cells.append(
            {
                "kind": "sweep",
                "section": "turns20",
                "name": "twenty turns at equal memory",
                "config": {
                    **common,
                    **traced,
                    "scenario": scenario,
                    "max_new_tokens": k.turns_new_tokens,
                    "equal_memory": True,
                    "strategies": ",".join(EVICTION),
                    "budgets": "8,16,32,64,128",
                    "target": LANES["anchorkv:spacing=L:rebuild=step"].format(L=L, b=budget),
                },
            }
        )
    cells.append(
        {
            "kind": "sweep",
            "section": "agreement",
            "name": "recall sweep",
            "config": {
                **common,
                **traced,
                "scenario": "recall",
                "max_new_tokens": k.new_tokens,
                "budgets": ",".join(map(str, k.budgets)),
                "strategies": ",".join(["kvdirect", f"anchorkv:spacing={L}:rebuild=step", *EVICTION]),
            },
        }
    )
    cells.append(
        {
            "kind": "recompute",
            "section": "recompute",
            "name": "recompute vs read",
            "model": model,
            "dtype": "float32",
            "device": device,
            "threads": threads,
            "repeats": 3,
            "batches": list(k.recompute_batches),
            "contexts": list(k.recompute_contexts),
        }
    )
    cells.append(
        {
            "kind": "replay",
            "section": "replay",
            "name": f"replay at {k.replay_context}",
            "config": {**common, "context": k.replay_context, "spacing": L},
        }
    )
    cells.append(
        {
            "kind": "capacity",
            "section": "parked",
            "name": "parked sessions at 32k",
            "config": {**common, "context": 32768, "measure": 2, "measure_context": k.park_context, "budget": budget},
        }
    )
    cells += _exactness_cells(model, k, L, device, threads)
    cells.append(
        {
            "kind": "tasks",
            "section": "tasks",
            "name": "task scores",
            "config": {
                **common,
                "contexts": ",".join(map(str, k.task_contexts)),
                "depths": "0,50,100",
                "tasks": ",".join(k.task_names),
                "budgets": "8" if tiny else "64",
                "question": "after",
                "strategies": ",".join(["anchorkv", "kvdirect", *EVICTION]),
            },
        }
    )
    if k.real_size:  # the full run: the four public configs with random weights (fp32 where it fits in time)
        cells.append(
            {
                "kind": "realsize",
                "section": "exactness",
                "name": "random weights at the real configs",
                "configs": [
                    ["qwen2.5-0.5b", "float32"],
                    ["llama-3.2-1b", "float32"],
                    ["qwen3-4b", "bfloat16"],
                    ["gemma-3-4b", "bfloat16"],
                ],
                "prompt_tokens": 300,
                "new_tokens": 8,
                "device": "cpu" if device == "auto" else device,
                "threads": threads,
            }
        )
    real = [] if tiny else [p for p in embedded_presets() if not p.startswith("tiny-")]  # weights on this machine
    for name in dict.fromkeys([model, *real, *FAMILIES]):
        cells.append(
            {
                "kind": "patching",
                "section": "patching",
                "name": f"patching {name}",
                "model": name,
                "dtype": "float32",
                "device": device,
                "threads": threads,
            }
        )
    return cells


def _exactness_cells(model: str, k: Knobs, L: int, device: str, threads: int) -> list[dict]:
    """The tiny families play three turns, so that rebuild=turn rebuilds between them; the model itself one
    prompt under load, with rebuild=step lanes only (one turn of rebuild=turn would rebuild nothing)."""
    cells = []
    for family in dict.fromkeys([*([] if model.startswith("tiny-") else FAMILIES), model]):
        own = family == model
        for dtype in ("float32", "bfloat16"):
            if own and dtype == "bfloat16" and not k.model_bf16:
                continue
            conversation = (
                dict(prompt="Tell me a short story about a lighthouse.", max_new_tokens=k.new_tokens)
                if own
                else dict(scenario="capitals", max_new_tokens=6)
            )
            anchors = (
                ["anchorkv:spacing=2:budget=4:rebuild=step", f"anchorkv:spacing={L}:budget=4:rebuild=step"]
                if own
                else ["anchorkv:spacing=2:budget=4", "anchorkv:spacing=2:budget=4:rebuild=step"]
            )
            cells.append(
                {
                    "kind": "run",
                    "section": "exactness",
                    "name": f"exactness {family} {dtype}",
                    "load": 2 if own else 0,  # the model itself under load: two busy processes
                    "config": {
                        "model": family,
                        "device": device,
                        "dtype": dtype,
                        "threads": threads,
                        "memory": "trace",
                        **conversation,
                        "strategies": ",".join(["full", "kvdirect:budget=4", "kvdirect:budget=4:mode=fast", *anchors]),
                    },
                }
            )
    return cells


# --- results.json ------------------------------------------------------------------------------------------------
def reassess(results: dict) -> dict:
    """`results` with everything that follows from its cells recomputed: the rule, claims, sections, and
    what --quick leaves out (from the knobs the run recorded)."""
    claims, sections = assess(results)
    plan_ = dict(results.get("plan") or {})
    plan_["quick_leaves_out"] = (
        leaves_out(plan_["knobs"], plan_["full"]) if "knobs" in plan_ else ["not recorded in results.json"]
    )
    rule = {
        "text": rule_text(),
        "size_tolerance": SIZE_TOLERANCE,
        "exact_tolerance": EXACT_TOLERANCE,
        "outcomes": list(VERDICTS),
    }
    return {**results, "plan": plan_, "rule": rule, "claims": claims, "sections": sections}


class ResultsError(UserError):
    """A results.json that cannot be rendered: missing, not JSON, or not a reproduce run's."""


def load(folder: Path) -> dict:
    """DIR/results.json, checked and reassessed (stored verdicts and reasons are never reused)."""
    if not folder.exists():
        raise ResultsError(f"no such folder {str(folder)!r}; allowed: a folder written by reproduce --out")
    if not folder.is_dir():
        raise ResultsError(f"{str(folder)!r} is a file; allowed: a folder holding results.json")
    path = folder / "results.json"
    if not path.is_file():
        raise ResultsError(f"no results.json in {str(folder)!r}; allowed: a folder written by reproduce --out")
    try:
        results = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultsError(f"{str(path)!r} is not valid JSON ({str(e).splitlines()[0]})") from None
    try:
        check(results, "reproduce", str(path))
    except SchemaError as e:
        raise ResultsError(str(e)) from None
    _check(results, path)
    try:
        return reassess(results)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration, ZeroDivisionError) as e:
        where = "; ".join(getattr(e, "__notes__", [])) or "a cell"
        raise ResultsError(
            f"{str(path)!r}: {where} does not match a reproduce run's JSON ({type(e).__name__}: {str(e)[:120]})"
        ) from None


def _check(results, path: Path):
    """The shape every section builder relies on: top-level facts, and every section's cells with their JSON."""
    bad = lambda what: ResultsError(f"{str(path)!r} is not a reproduce run's results: {what}")  # noqa: E731
    if not isinstance(results, dict):
        raise bad("not a JSON object")
    for key, kind in (("model", str), ("quick", bool), ("cells", list)):
        if not isinstance(results.get(key), kind):
            raise bad(f"'{key}' missing or not a {kind.__name__}")
    for i, c in enumerate(results["cells"]):
        if not (
            isinstance(c, dict)
            and c.get("section") in SECTIONS
            and isinstance(c.get("json"), dict)
            and isinstance(c.get("config", {}), dict)
        ):
            raise bad(f"cell {i + 1} lacks a known 'section' or its 'json'")
    missing = [s for s in SECTIONS if not any(c["section"] == s for c in results["cells"])]
    if missing:
        raise bad(f"no cell of section(s) {', '.join(missing)}")
