"""The web page's one door to the engine: plain data in, plain data out.

The UI (`kvdirect_app/app/ui/`) never imports torch, nor any module that does:
it calls the functions here, which import the engine's modules when they
are first called.  What they take and return is plain Python (str, numbers,
lists, dicts), and a run's events are the engine's own plain dicts, so the
page draws the same from a live run and from a file.
`tests/test_ui_plain.py` imports the whole UI in an interpreter where
importing torch fails, and reads every UI module's imports.

Errors: bad input raises `errors.UserError` (one line naming the setting);
running out of memory during a run raises `errors.OutOfMemory`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

from ..plain.catalog import DTYPE_NAMES
from ..plain.errors import OutOfMemory, UserError
from ..plain.schema import stamp

__all__ = ["strategy_catalogue", "check_specs", "canonical_spec", "check_model_name",
           "check_device_dtype", "devices", "gpu_available", "load", "is_loaded", "geometry", "prepare",
           "Conversation", "FrontierRun", "compare", "DTYPE_NAMES", "UserError", "OutOfMemory"]


@contextlib.contextmanager
def _memory():
    """An allocation that fails during a run becomes `OutOfMemory` (the caller frees the session and says so)."""
    import torch

    try:
        yield
    except (MemoryError, torch.OutOfMemoryError) as e:
        raise OutOfMemory(f"out of memory during the run ({type(e).__name__})") from e


# --- strategies ----------------------------------------------------------------------------------------------------
@functools.cache
def strategy_catalogue() -> dict[str, dict]:
    """Every registered strategy: its settings (name -> default) and the first line of its docstring."""
    from ..strategies import registry

    out = {}
    for name, cls in registry().items():
        doc = (cls.__doc__ or "").strip()
        out[name] = {"settings": {f: field.default for f, field in cls.settings().items()},
                     "doc": doc.splitlines()[0] if doc else ""}
    return out


@functools.cache
def _machine(threads: int, dtype) -> dict:
    from ..benchmarks import roofline

    return roofline.machine(threads, dtype, repeats=2, mib=256)


def strategy_settings(head: str) -> list[str]:
    """The settings of a registered strategy's name or a file's or module's class (`PATH.py:Class`); [] for an
    unknown one (the spec's own check then says why)."""
    from ..strategies import StrategyError, parse_spec, registry

    cls = registry().get(head)
    if cls is None:
        try:
            cls = type(parse_spec(head))
        except StrategyError:
            return []
    return list(cls.settings())


def check_specs(specs: list[str]) -> None:
    """Raises the registry's one-line error for unknown names, settings or duplicates."""
    from ..strategies import parse_specs

    parse_specs(",".join(specs))


@functools.lru_cache(maxsize=1024)
def canonical_spec(spec: str) -> str:
    from ..strategies import parse_spec

    return parse_spec(spec).spec()


# --- models and devices --------------------------------------------------------------------------------------------
def check_model_name(value) -> str:
    from ..engine import validate

    return validate.model_name(value)


def check_device_dtype(device, dtype) -> tuple[str, str]:
    from ..engine import validate

    return validate.device_dtype(device, dtype)


def devices() -> list[str]:
    from ..models.loading import available_devices

    return available_devices()


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _loaded(name: str, dtype: str, device: str, progress=None):
    from ..models.loading import load_model

    return load_model(name, dtype=dtype, device=device, progress=progress)


def load(name: str, dtype: str = "float32", device: str = "auto", progress=None) -> dict:
    """Load a model (once per process); what the page says about it.  `progress(line)` hears what the load is
    doing (a first load of a GGUF preset dequantises it and keeps a copy; later ones map that copy)."""
    loaded = _loaded(name, dtype, device, progress)
    facts = geometry(name, dtype, device)
    kernels = prove_kernels(loaded, progress)
    return {"name": loaded.name, "source": loaded.source, "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."), "layers": facts["layers"], "geometry": facts,
            "kernels": kernels}


def prove_kernels(loaded, progress=None) -> str:
    """The invariant kernels' probe at this process's thread count, once the model is loaded (not inside the first
    turn); its verdicts are kept on disk, so a later start only re-checks them.  Returns the kernels in a few
    words."""
    import torch

    from ..kernels.invariant import Kernels, brief

    store = loaded.probes
    threads = torch.get_num_threads()
    if progress is not None:
        progress("checking the kernels on this CPU" + ("" if store.stored else
                                                       " (the first start here probes them: ~10-20 s, kept for the next)"))
    return brief(Kernels.for_model(loaded, "invariant", threads).report())


def is_loaded(name: str, dtype: str, device: str) -> bool:
    from ..models.loading import is_loaded as loaded_already

    return loaded_already(name, dtype, device)


def _geometry_facts(geom) -> dict:
    return {"layers": geom.num_layers, "hidden_size": geom.hidden_size, "bytes_per_element": geom.bytes_per_element,
            "per_layer": [{"index": layer.index, "sliding": layer.is_sliding, "window": layer.sliding_window,
                           "kv_heads": layer.num_kv_heads, "head_dim": layer.head_dim,
                           "kv_bytes_per_token": layer.kv_bytes_per_token} for layer in geom.layers],
            "break_even": {"residual": geom.break_even_spacing(token_id_anchor=False),
                           "token_id": geom.break_even_spacing(token_id_anchor=True),
                           "global_only": (geom.break_even_spacing(token_id_anchor=True, global_only=True)
                                           if any(layer.is_sliding for layer in geom.layers) else None)}}


def geometry(name: str, dtype: str = "float32", device: str = "auto") -> dict:
    """Bytes per token of a loaded model, from its config alone (`geometry.ModelGeometry`), as plain data."""
    from ..models.geometry import ModelGeometry

    loaded = _loaded(name, dtype, device)
    return _geometry_facts(ModelGeometry.from_config(loaded.config, loaded.dtype))


@functools.cache
def config_geometry(source: str, dtype: str = "bfloat16") -> dict:
    """The same for a bundled public config (`presets/configs/NAME.json`, e.g. gemma-3-4b), no model loaded."""
    from ..models.geometry import ModelGeometry, load_config
    from ..models.loading import resolve_dtype

    return _geometry_facts(ModelGeometry.from_config(load_config(source), resolve_dtype(dtype)))


# --- runs ----------------------------------------------------------------------------------------------------------
def prepare(model: str, device: str, dtype: str, specs: list[str], max_new_tokens: int, turns: list[str],
            raw: bool = False, twins: bool = True, kernels: str = "invariant") -> dict:
    """Every check before a run (the same `validate` stages as the CLI), then the memory guard; raises UserError.
    Returns {"prompt_tokens": each turn's prompt with its chat template, "bytes": the guard's estimate of the peak}."""
    from ..engine import guard, validate
    from ..engine.runner import PREFILL_CHUNK
    from ..models.prompts import Prompter

    req = validate.request(model, device, dtype, specs, max_new_tokens, turns, raw)
    loaded = _loaded(req.model, req.dtype, req.device)
    total = validate.against_model(req, loaded)
    prompter = Prompter(loaded, raw)
    prompts = [len(prompter.first(turns[0]))] + [len(prompter.next(turn, None)) for turn in turns[1:]]
    est = guard.estimate(loaded.config, loaded.dtype, list(req.strategies), prompts[0], total, PREFILL_CHUNK,
                         twins=twins, turns=len(turns), kernels=kernels)
    guard.check(est, loaded.device)
    return {"prompt_tokens": prompts, "bytes": est.total}


class Conversation:
    """One conversation's engine: every turn's events (plain dicts), the summary, the token maps.

    Parameters
    ----------
    model, device, dtype : the loaded model's name and where it runs.
    specs : strategy specs (`name[:key=value]...`), one pane each.
    max_new_tokens, raw, twins, kernels : as `bench run`.
    """

    def __init__(self, model: str, device: str, dtype: str, specs: list[str], max_new_tokens: int,
                 raw: bool = False, twins: bool = True, kernels: str = "invariant"):
        from ..engine.runner import Engine
        from ..strategies import parse_specs

        with _memory():
            self.engine = Engine(_loaded(model, dtype, device), parse_specs(",".join(specs)),
                                 max_new_tokens=max_new_tokens, raw=raw, twins=twins, kernels=kernels)

    @property
    def shown(self) -> list[str]:
        return list(self.engine.show)

    @property
    def layers(self) -> int:
        return len(self.engine.reference.cache.layers)

    def turn(self, text: str) -> Iterator[dict]:
        """One user turn for every pane; closing the generator early ends the turn cleanly (a Stop)."""
        events = self.engine.turn(text)
        try:
            with _memory():
                yield from events
        finally:
            events.close()

    def results(self) -> dict:
        return self.engine.results()

    def roofline(self) -> dict | None:
        """This machine's best time for this conversation's decode step's linears (`roofline.py`: the weights read
        once, or the arithmetic at the measured GEMM rate), over its panes' rows; the machine measured once per
        process, dtype and thread count (a 2048^3 GEMM and a 256 MiB copy, ~1 s).  None off the CPU."""
        from ..benchmarks import roofline

        loaded = self.engine.loaded
        if loaded.device.type != "cpu":
            return None
        here = _machine(self.engine.threads, loaded.dtype)
        weights = roofline.model_side(loaded)
        rows = len(self.engine.all_lanes)
        best = roofline.best_ms(weights["weight_bytes"], weights["params"], rows, roofline.rate_for(here, loaded.dtype),
                                here["bandwidth_gbs"])
        return {**best, "gemm_gflops": roofline.rate_for(here, loaded.dtype), "bandwidth_gbs": here["bandwidth_gbs"],
                "threads": here["threads"]}

    def token_map(self, label: str, layer: int) -> dict | None:
        if label not in self.engine.show:
            return None
        return self.engine.token_map(label, layer)

    def token_maps(self) -> dict:
        """Every layer's token states of every pane (for a page whose engine does not outlive the call)."""
        return self.engine.token_maps()

    def attention_map(self, label: str, layer: int) -> dict | None:
        if label not in self.engine.show:
            return None
        return self.engine.attention_map(label, layer)

    def attention_maps(self) -> dict:
        return self.engine.attention_maps()


class FrontierRun:
    """The frontier's runs on one conversation: each a lockstep run of several strategies (`sweeps.Sweep`)."""

    def __init__(self, model: str, device: str, dtype: str, turns: list[str], raw: bool, max_new_tokens: int):
        from ..benchmarks.sweeps import Sweep

        self.sweep = Sweep(_loaded(model, dtype, device), list(turns), raw=raw,
                           options={"max_new_tokens": max_new_tokens})

    def run(self, entries: list[tuple[str, str, int | None]], should_stop=None) -> list[dict] | None:
        """entries: (name, spec, budget); their rows (the engine's summary per strategy, plus name and budget); None
        where `should_stop()` ended the run."""
        from ..strategies import parse_spec

        with _memory():
            return self.sweep.run([(name, parse_spec(spec), budget) for name, spec, budget in entries], should_stop)

    @property
    def head(self) -> dict:
        return self.sweep.head

    @property
    def reference(self) -> dict:
        return self.sweep.reference


def compare(prompt: str, model: str, device: str, dtype: str, specs: list[str], max_new_tokens: int,
            kernels: str = "invariant") -> dict:
    """One prompt through `specs` in lockstep; the same JSON as `bench run` (checked first, like every run)."""
    from ..engine.runner import run_to_end

    prepare(model, device, dtype, specs, max_new_tokens, [prompt], kernels=kernels)
    conversation = Conversation(model, device, dtype, specs, max_new_tokens, kernels=kernels)
    with _memory():
        return stamp("run", run_to_end(conversation.engine, [prompt]))
