"""The web page's one door to the engine: plain data in, plain data out.

The UI (`kvdirect_app/app/ui/`) never imports torch, nor any module that does:
it calls the functions here, which reach the engine through `engine_side`
(the service's torch side), imported on the first call that needs it (`_engine`,
the one lazy import between the page and torch).  What they take and return is
plain Python (str, numbers, lists, dicts), and a run's events are the engine's
own plain dicts, so the page draws the same from a live run and from a file.
`tests/app/test_ui_plain.py` imports the whole UI in an interpreter where
importing torch fails, and reads every UI module's imports.

Errors: bad input raises `errors.UserError` (one line naming the setting);
running out of memory during a run raises `errors.OutOfMemory`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Iterator

from ..plain.catalog import DTYPE_NAMES
from ..plain.errors import OutOfMemory, UserError

__all__ = [
    "strategy_catalogue",
    "check_specs",
    "canonical_spec",
    "check_model_name",
    "check_device_dtype",
    "devices",
    "gpu_available",
    "load",
    "is_loaded",
    "geometry",
    "prepare",
    "Conversation",
    "FrontierRun",
    "compare",
    "DTYPE_NAMES",
    "UserError",
    "OutOfMemory",
]


def _engine() -> ModuleType:
    """The service's torch side (`engine_side`: torch, transformers and the engine), imported on first use."""
    from . import engine_side  # lazy: the page starts without torch; the first call that needs the engine loads it

    return engine_side


# --- strategies ----------------------------------------------------------------------------------------------------
def strategy_catalogue() -> dict[str, dict]:
    """Every registered strategy: its settings (name -> default) and the first line of its docstring."""
    return _engine().strategy_catalogue()


def strategy_settings(head: str) -> list[str]:
    """The settings of a registered strategy's name or a file's or module's class (`PATH.py:Class`); [] for an
    unknown one (the spec's own check then says why)."""
    return _engine().strategy_settings(head)


def check_specs(specs: list[str]) -> None:
    """Raises the registry's one-line error for unknown names, settings or duplicates."""
    _engine().check_specs(specs)


def canonical_spec(spec: str) -> str:
    """A spec as the registry writes it: its name (or a file's class) then every non-default setting."""
    return _engine().canonical_spec(spec)


# --- models and devices --------------------------------------------------------------------------------------------
def check_model_name(value) -> str:
    return _engine().check_model_name(value)


def check_device_dtype(device, dtype) -> tuple[str, str]:
    return _engine().check_device_dtype(device, dtype)


def devices() -> list[str]:
    return _engine().devices()


def gpu_available() -> bool:
    return _engine().gpu_available()


def load(name: str, dtype: str = "float32", device: str = "auto", progress=None) -> dict:
    """Load a model (once per process); what the page says about it: its name, source, device, dtype, layers,
    geometry and kernels.  `progress(line)` hears what the load is doing (a first load of a GGUF preset dequantises
    it and keeps a copy; later ones map that copy; then the kernels' probe, `engine_side.prove_kernels`)."""
    return _engine().load(name, dtype, device, progress)


def is_loaded(name: str, dtype: str, device: str) -> bool:
    return _engine().is_loaded(name, dtype, device)


def geometry(name: str, dtype: str = "float32", device: str = "auto") -> dict:
    """Bytes per token of a loaded model, from its config alone (`geometry.ModelGeometry`), as plain data."""
    return _engine().geometry(name, dtype, device)


def config_geometry(source: str, dtype: str = "bfloat16") -> dict:
    """The same for a bundled public config (`presets/configs/NAME.json`, e.g. gemma-3-4b), no model loaded."""
    return _engine().config_geometry(source, dtype)


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
    """Every check before a run (the same `validate` stages as the CLI), then the memory guard; raises UserError.
    Returns {"prompt_tokens": each turn's prompt with its chat template, "bytes": the guard's estimate of the peak}."""
    return _engine().prepare(model, device, dtype, specs, max_new_tokens, turns, raw, twins, kernels)


class Conversation:
    """One conversation's engine: every turn's events (plain dicts), the summary, the token maps.

    Parameters
    ----------
    model, device, dtype : the loaded model's name and where it runs.
    specs : strategy specs (`name[:key=value]...`), one pane each.
    max_new_tokens, raw, twins, kernels : as `bench run`.
    """

    def __init__(
        self,
        model: str,
        device: str,
        dtype: str,
        specs: list[str],
        max_new_tokens: int,
        raw: bool = False,
        twins: bool = True,
        kernels: str = "invariant",
    ):
        self.engine = _engine().build_engine(model, device, dtype, specs, max_new_tokens, raw, twins, kernels)

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
            with _engine().memory():
                yield from events
        finally:
            events.close()

    def rearrange(self, specs: list[str]) -> list[dict]:
        """Between turns: the panes become `specs`' (one pane each, as at the start): the panes no spec names leave,
        the new ones join; their events ("drop", "join").  Before the next turn, `catch_up` replays the earlier
        turns for the new panes alone (the others keep their state)."""
        return _engine().rearrange(self.engine, specs)

    def catch_up(self) -> Iterator[dict]:
        """The earlier turns replayed for the panes that joined (`Engine.catch_up`); closed early, they leave."""
        events = self.engine.catch_up()
        try:
            with _engine().memory():
                yield from events
        finally:
            events.close()

    def results(self) -> dict:
        return self.engine.results()

    def roofline(self) -> dict | None:
        """This machine's best time for this conversation's decode step's linears (`roofline.py`: the weights read
        once, or the arithmetic at the measured GEMM rate), over its panes' rows; the machine measured once per
        process, dtype and thread count (a 2048^3 GEMM and a 256 MiB copy, ~1 s).  None off the CPU."""
        return _engine().engine_roofline(self.engine)

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
        self.sweep = _engine().build_sweep(model, device, dtype, turns, raw, max_new_tokens)

    def run(self, entries: list[tuple[str, str, int | None]], should_stop=None) -> list[dict] | None:
        """entries: (name, spec, budget); their rows (the engine's summary per strategy, plus name and budget); None
        where `should_stop()` ended the run."""
        return _engine().run_sweep(self.sweep, entries, should_stop)

    @property
    def head(self) -> dict:
        return self.sweep.head

    @property
    def reference(self) -> dict:
        return self.sweep.reference


def compare(
    prompt: str, model: str, device: str, dtype: str, specs: list[str], max_new_tokens: int, kernels: str = "invariant"
) -> dict:
    """One prompt through `specs` in lockstep; the same JSON as `bench run` (checked first, like every run)."""
    return _engine().compare(prompt, model, device, dtype, specs, max_new_tokens, kernels)
