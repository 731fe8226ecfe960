"""The service's torch side: every call the page makes into the engine, with torch and the engine imported here.

`service` is the page's torch-free facade; it imports this module on the first call that needs the engine
(`service._engine`, the one lazy import between the page and torch), so the page starts without torch.  Nothing in
the UI (`kvdirect_app/app/ui/`) imports this module: `tests/app/test_ui_plain.py` reads their imports.  What these
functions take and return is plain Python, except `build_engine` and `build_sweep`, whose objects stay inside
`service.Conversation` and `service.FrontierRun`.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..benchmarks import roofline
from ..benchmarks.sweeps import Sweep
from ..engine import guard, validate
from ..engine.runner import PREFILL_CHUNK, Engine, run_to_end
from ..kernels.invariant import Kernels, brief
from ..models.geometry import ModelGeometry, load_config
from ..models.loading import available_devices, load_model, resolve_dtype
from ..models.loading import is_loaded as loaded_already
from ..models.prompts import Prompter
from ..plain.errors import OutOfMemory
from ..plain.schema import stamp
from ..strategies import StrategyError, parse_spec, parse_specs, registry


@contextlib.contextmanager
def memory():
    """An allocation that fails during a run becomes `OutOfMemory` (the caller frees the session and says so)."""
    try:
        yield
    except (MemoryError, torch.OutOfMemoryError) as e:
        raise OutOfMemory(f"out of memory during the run ({type(e).__name__})") from e


# --- strategies ----------------------------------------------------------------------------------------------------
@functools.cache
def strategy_catalogue() -> dict[str, dict]:
    out = {}
    for name, cls in registry().items():
        doc = (cls.__doc__ or "").strip()
        out[name] = {
            "settings": {f: field.default for f, field in cls.settings().items()},
            "doc": doc.splitlines()[0] if doc else "",
        }
    return out


def strategy_settings(head: str) -> list[str]:
    cls = registry().get(head)
    if cls is None:
        try:
            cls = type(parse_spec(head))
        except StrategyError:
            return []
    return list(cls.settings())


def check_specs(specs: list[str]) -> None:
    parse_specs(",".join(specs))


@functools.lru_cache(maxsize=1024)
def canonical_spec(spec: str) -> str:
    return parse_spec(spec).spec()


# --- models and devices --------------------------------------------------------------------------------------------
def check_model_name(value) -> str:
    return validate.model_name(value)


def check_device_dtype(device, dtype) -> tuple[str, str]:
    return validate.device_dtype(device, dtype)


def devices() -> list[str]:
    return available_devices()


def gpu_available() -> bool:
    return torch.cuda.is_available()


def loaded(name: str, dtype: str, device: str, progress=None):
    """The loaded model (`models.loading.load_model`: once per process, then cached)."""
    return load_model(name, dtype=dtype, device=device, progress=progress)


def load(name: str, dtype: str = "float32", device: str = "auto", progress=None) -> dict:
    model = loaded(name, dtype, device, progress)
    facts = geometry(name, dtype, device)
    kernels = prove_kernels(model, progress)
    return {
        "name": model.name,
        "source": model.source,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "layers": facts["layers"],
        "geometry": facts,
        "kernels": kernels,
    }


def prove_kernels(model, progress=None) -> str:
    """The invariant kernels' probe at this process's thread count, once the model is loaded (not inside the first
    turn); its verdicts are kept on disk, so a later start only re-checks them.  Returns the kernels in a few
    words."""
    store = model.probes
    threads = torch.get_num_threads()
    if progress is not None:
        progress(
            "checking the kernels on this CPU"
            + ("" if store.stored else " (the first start here probes them: ~10-20 s, kept for the next)")
        )
    return brief(Kernels.for_model(model, "invariant", threads).report())


def is_loaded(name: str, dtype: str, device: str) -> bool:
    return loaded_already(name, dtype, device)


def _geometry_facts(geom) -> dict:
    return {
        "layers": geom.num_layers,
        "hidden_size": geom.hidden_size,
        "bytes_per_element": geom.bytes_per_element,
        "per_layer": [
            {
                "index": layer.index,
                "sliding": layer.is_sliding,
                "window": layer.sliding_window,
                "kv_heads": layer.num_kv_heads,
                "head_dim": layer.head_dim,
                "kv_bytes_per_token": layer.kv_bytes_per_token,
            }
            for layer in geom.layers
        ],
        "break_even": {
            "residual": geom.break_even_spacing(token_id_anchor=False),
            "token_id": geom.break_even_spacing(token_id_anchor=True),
            "global_only": (
                geom.break_even_spacing(token_id_anchor=True, global_only=True)
                if any(layer.is_sliding for layer in geom.layers)
                else None
            ),
        },
    }


def geometry(name: str, dtype: str = "float32", device: str = "auto") -> dict:
    model = loaded(name, dtype, device)
    return _geometry_facts(ModelGeometry.from_config(model.config, model.dtype))


@functools.cache
def config_geometry(source: str, dtype: str = "bfloat16") -> dict:
    return _geometry_facts(ModelGeometry.from_config(load_config(source), resolve_dtype(dtype)))


# --- runs ----------------------------------------------------------------------------------------------------------
def prepare(
    model: str,
    device: str,
    dtype: str,
    specs: list[str],
    max_new_tokens: int,
    turns: list[str],
    raw: bool = False,
    twins: bool = True,
    kernels: str = "invariant",
) -> dict:
    req = validate.request(model, device, dtype, specs, max_new_tokens, turns, raw)
    here = loaded(req.model, req.dtype, req.device)
    total = validate.against_model(req, here)
    prompter = Prompter(here, raw)
    prompts = [len(prompter.first(turns[0]))] + [len(prompter.next(turn, None)) for turn in turns[1:]]
    est = guard.estimate(
        here.config,
        here.dtype,
        list(req.strategies),
        prompts[0],
        total,
        PREFILL_CHUNK,
        twins=twins,
        turns=len(turns),
        kernels=kernels,
    )
    guard.check(est, here.device)
    return {"prompt_tokens": prompts, "bytes": est.total}


def build_engine(
    model: str,
    device: str,
    dtype: str,
    specs: list[str],
    max_new_tokens: int,
    raw: bool = False,
    twins: bool = True,
    kernels: str = "invariant",
) -> Engine:
    """A conversation's engine (`service.Conversation` holds it)."""
    with memory():
        return Engine(
            loaded(model, dtype, device),
            parse_specs(",".join(specs)),
            max_new_tokens=max_new_tokens,
            raw=raw,
            twins=twins,
            kernels=kernels,
        )


def rearrange(engine: Engine, specs: list[str]) -> list[dict]:
    """The engine's panes made `specs`' (`service.Conversation.rearrange`): those no spec names leave, the new ones
    join; their events ("drop", "join")."""
    strategies = parse_specs(",".join(specs))
    ref = engine.reference
    labels = [s.label if s.spec() != ref.strategy.spec() else ref.label for s in strategies]
    events = []
    gone = [label for label in engine.show if label not in labels]
    if gone:
        events.append(engine.drop(gone))
    new = [s for s, label in zip(strategies, labels) if label not in engine.show]
    if new:
        with memory():
            events.append(engine.join(new))
    return events


@functools.cache
def _machine(threads: int, dtype) -> dict:
    """This machine's GEMM rate and memory bandwidth (`roofline.machine`), measured once per thread count and dtype."""
    return roofline.machine(threads, dtype, repeats=2, mib=256)


def engine_roofline(engine: Engine) -> dict | None:
    """`service.Conversation.roofline`: this machine's best time for the engine's decode step; None off the CPU."""
    model = engine.loaded
    if model.device.type != "cpu":
        return None
    here = _machine(engine.threads, model.dtype)
    weights = roofline.model_side(model)
    rows = len(engine.all_lanes)
    best = roofline.best_ms(
        weights["weight_bytes"], weights["params"], rows, roofline.rate_for(here, model.dtype), here["bandwidth_gbs"]
    )
    return {
        **best,
        "gemm_gflops": roofline.rate_for(here, model.dtype),
        "bandwidth_gbs": here["bandwidth_gbs"],
        "threads": here["threads"],
    }


def build_sweep(model: str, device: str, dtype: str, turns: list[str], raw: bool, max_new_tokens: int) -> Sweep:
    """The frontier's lockstep runs on one conversation (`service.FrontierRun` holds it)."""
    return Sweep(loaded(model, dtype, device), list(turns), raw=raw, options={"max_new_tokens": max_new_tokens})


def run_sweep(sweep: Sweep, entries: list[tuple[str, str, int | None]], should_stop=None) -> list[dict] | None:
    with memory():
        return sweep.run([(name, parse_spec(spec), budget) for name, spec, budget in entries], should_stop)


def compare(
    prompt: str, model: str, device: str, dtype: str, specs: list[str], max_new_tokens: int, kernels: str = "invariant"
) -> dict:
    prepare(model, device, dtype, specs, max_new_tokens, [prompt], kernels=kernels)
    engine = build_engine(model, device, dtype, specs, max_new_tokens, kernels=kernels)
    with memory():
        return stamp("run", run_to_end(engine, [prompt]))
