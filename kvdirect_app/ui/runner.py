"""Where the UI meets the engine: building engines, playing turns, the `compare` API.

On Hugging Face ZeroGPU the generation functions run in a short-lived GPU
worker (`spaces.GPU`), so no engine outlives a call there: each call rebuilds
the engine and replays the conversation (greedy decoding makes the replay
identical).  Elsewhere `spaces.GPU` is not applied, or is a no-op, and a
session keeps its engine between turns.
"""

from __future__ import annotations

import logging
import os
import traceback
import queue
import threading
from typing import Callable, Iterator

import torch

from .. import guard, validate
from ..engine import PREFILL_CHUNK, Engine, run_to_end
from ..errors import UserError
from ..frontier import frontier_figure, points_from_rows
from ..geometry import ModelGeometry
from ..hosted import hosted
from ..models import LoadedModel, load_model
from ..prompts import Prompter
from ..strategies import parse_spec, parse_specs
from ..sweeps import Sweep
from ..units import fmt_bytes
from .settings import REFERENCE, RunConfig, Settings, default_model, expand

USER_ERRORS = (UserError,)
log = logging.getLogger(__name__)
OUT_OF_MEMORY = (MemoryError, torch.OutOfMemoryError)


def gpu(fn):
    """`spaces.GPU` where the `spaces` package is importable (it does nothing off ZeroGPU), else `fn`."""
    try:
        import spaces
    except ImportError:
        return fn
    return spaces.GPU(duration=180)(fn)


def on_zero_gpu() -> bool:
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def release_memory():
    """After a session's engine is dropped: collect it, and hand glibc's freed heap back to the OS (malloc_trim),
    so that the process's RSS shows what is really still held."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def queue_options() -> dict:
    """Gradio's queue for this device: one run at a time on a CPU (the cores are the bottleneck), two on a GPU;
    a bounded line (a full one is answered "busy", not left hanging)."""
    concurrency = 2 if torch.cuda.is_available() else 1
    return {"default_concurrency_limit": concurrency, "max_size": 16 if hosted() else 64}


def session_capacity() -> int:
    """Sessions whose page copy Gradio keeps (the oldest go first): a bound on what idle visitors hold."""
    return 200 if hosted() else 1000


def is_loaded(config: RunConfig) -> bool:
    from ..models import is_loaded as loaded_already

    return loaded_already(config.model, config.dtype, config.device)


def load(config: RunConfig) -> LoadedModel:
    return load_model(config.model, dtype=config.dtype, device=config.device)


def prepare(config: RunConfig, turns: list[str]) -> tuple[LoadedModel, guard.Estimate]:
    """Every check before a run (the same `validate` stages as the CLI), then the memory guard."""
    req = validate.request(config.model, config.device, config.dtype, config.specs, config.max_new_tokens, turns,
                           config.raw)
    loaded = load(config)
    total = validate.against_model(req, loaded)
    prompt = len(Prompter(loaded, config.raw).first(turns[0]))
    est = guard.estimate(loaded.config, loaded.dtype, list(req.strategies), prompt, total, PREFILL_CHUNK,
                         twins=config.twins)
    return loaded, guard.check(est, loaded.device)


def build_engine(config: RunConfig) -> Engine:
    return Engine(load(config), parse_specs(",".join(config.specs)), max_new_tokens=config.max_new_tokens,
                  raw=config.raw, twins=config.twins)


def geometry(loaded: LoadedModel) -> ModelGeometry:
    return ModelGeometry.from_config(loaded.config, loaded.dtype)


def frontier_plan(config: RunConfig, settings: Settings, budgets: tuple[int, ...]) -> list[list[tuple]]:
    """One lockstep run per budget: every ticked strategy at that budget (AnchorKV: its deepest spacing in both
    rebuild modes, and the break-even spacing with ``rebuild=step``)."""
    geom = geometry(load(config))
    names = [spec.split(":")[0] for spec in config.specs if spec.split(":")[0] != REFERENCE]
    plan = []
    for budget in budgets:
        entries, seen = [], set()
        for name in dict.fromkeys(names):
            variants = [expand(name, budget, settings.spacing, settings.mode, settings.rebuild)]
            if name == "anchorkv":
                deepest, s_star = geom.num_layers, geom.break_even_spacing(token_id_anchor=True) or geom.num_layers
                variants = [f"anchorkv:spacing={deepest}:budget={budget}:rebuild=step",
                            f"anchorkv:spacing={deepest}:budget={budget}:rebuild=turn",
                            f"anchorkv:spacing={s_star}:budget={budget}:rebuild=step"]
            for spec in variants:
                strategy = parse_spec(spec)
                if strategy.spec() not in seen:
                    seen.add(strategy.spec())
                    entries.append((name, strategy, budget))
        plan.append(entries)
    return plan


def frontier_sweep(config: RunConfig, turns: list[str]) -> Sweep:
    return Sweep(load(config), turns, raw=config.raw, options={"max_new_tokens": config.max_new_tokens})


def frontier_plot(rows: list[dict], sweep: Sweep, source: str):
    reference = sweep.reference["state_bytes"]
    return frontier_figure(points_from_rows(rows), title=f"{sweep.head['model']}, {source}: memory against agreement",
                           subtitle=f"{sweep.head['device']}, {sweep.head['dtype']}; full cache: peak "
                                    f"{fmt_bytes(reference['peak'])}, between turns {fmt_bytes(reference['between_turns_peak'])}")


def token_maps(engine: Engine, labels: list[str]) -> dict:
    """Every layer's token states of every shown strategy, for sessions whose engine does not survive the call."""
    maps = {}
    for label in labels:
        first = engine.token_map(label, 0)
        layers = len(engine.lanes[0].cache.layers) if engine.lanes else len(engine.reference.cache.layers)
        maps[label] = {"tokens": first["tokens"],
                       "states": [first["states"]] + [engine.token_map(label, i)["states"] for i in range(1, layers)]}
    return maps


@gpu
def play(config: RunConfig, turns: list[str], engine: Engine | None = None) -> Iterator[dict]:
    """The engine's events for `turns`, then "done" with `engine.results()`.

    With no engine (ZeroGPU), a fresh one is built here and the token maps
    are sent along, because the engine ends with the call.
    """
    own = engine is None
    engine = engine or build_engine(config)
    for text in turns:
        yield from engine.turn(text)
    yield {"type": "done", "result": engine.results()}
    if own:
        yield {"type": "token_maps", "maps": token_maps(engine, engine.show)}


class Pump:
    """Drives an engine's event generator on one thread of its own and hands the events over a queue.

    Gradio runs each step of a streaming handler on whichever worker thread is
    free, and may drop a handler (a closed tab) without closing it.  The
    engine copes with being advanced from any thread, but a turn holds the
    model's lock until its generator is closed: one driver thread that asks
    `should_stop` (the Stop button) and `abandoned` (the reader went away)
    after every event, and always closes the generator, guarantees that the
    lock is released and the turn ends cleanly.  Iterating the pump yields
    every event the engine produced, then re-raises its error, if any.
    """

    def __init__(self, events: Iterator[dict], should_stop: Callable[[], bool]):
        self.events, self.should_stop = events, should_stop
        self.queue: queue.Queue = queue.Queue()
        self.abandoned = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvdirect-engine", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for event in self.events:
                self.queue.put(("event", event))
                if self.should_stop() or self.abandoned.is_set():
                    break
        except BaseException as e:  # handed to the reader, who reports it
            self.queue.put(("error", e))
        finally:
            self.events.close()
            self.queue.put(("end", None))

    def __iter__(self) -> Iterator[dict]:
        while True:
            kind, item = self.queue.get()
            if kind == "event":
                yield item
            elif kind == "error":
                raise item
            else:
                return

    def close(self):
        """Stop after the current step, when the reader goes away early (the engine's thread ends the turn)."""
        self.abandoned.set()


def token_map(engine: Engine | None, maps: dict | None, label: str, layer: int) -> dict | None:
    if maps is not None and label in maps:
        states = maps[label]["states"]
        return {"tokens": maps[label]["tokens"], "states": states[min(layer, len(states) - 1)]}
    if engine is None or label not in engine.show:
        return None
    return engine.token_map(label, layer)


def compare_specs(strategies: str, budget: int, spacing: int, mode: str = "") -> str:
    """API strategies: names get the shared settings they declare; spacing 0 and mode "" keep the defaults."""
    entries = [e for e in strategies.split(",") if e.strip()]
    return ",".join(expand(e, budget or None, spacing or None, mode or None) for e in entries)


@gpu
def compare(prompt: str, model: str = "", strategies: str = "full,kvdirect:mode=exact",
            budget: int = 64, spacing: int = 0, max_new_tokens: int = 64, device: str = "auto",
            dtype: str = "float32") -> dict:
    """Run `strategies` in lockstep on one prompt; returns the same JSON as `python -m kvdirect_app.bench run`.

    `strategies` is comma-separated `name[:key=value]...`; a strategy that
    declares `budget` or `spacing` and does not set it gets the value given
    here (spacing 0: the strategy's default).  `model` "" is the default
    preset.  Every input goes through `validate` and the memory guard; a bad
    one is answered with its one-line message (never a traceback).
    """
    import gradio as gr

    try:
        if not isinstance(strategies, str):
            raise validate.SettingError("strategies: expected text like 'full,kvdirect:budget=64'")
        specs = compare_specs(strategies, validate.integer("budget", budget, 1, 1 << 20),
                              validate.integer("spacing", spacing, 0, 4096, "0: the strategy's default"))
        config = RunConfig(model or default_model(), device, dtype, tuple(specs.split(",")),
                           validate.integer("max_new_tokens", max_new_tokens, 1, validate.limits().max_new_tokens))
        loaded, _ = prepare(config, [prompt])
        engine = Engine(loaded, parse_specs(specs), max_new_tokens=config.max_new_tokens)
        return run_to_end(engine, [prompt])
    except USER_ERRORS as e:
        raise gr.Error(str(e), print_exception=False) from None
    except OUT_OF_MEMORY as e:
        raise gr.Error(f"out of memory during the run ({type(e).__name__}); try fewer tokens or strategies",
                       print_exception=False) from None
    except Exception as e:  # a bug: logged here with its traceback, answered without it
        log.error("compare failed:\n%s", traceback.format_exc())
        raise gr.Error(f"internal error ({type(e).__name__}); the server log has the details",
                       print_exception=False) from None
