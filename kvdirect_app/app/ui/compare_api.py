"""The page's `compare` API endpoint: one prompt through a list of strategies in lockstep, answered with the same
JSON as `python -m kvdirect_app.bench run`; every input checked, a bad one answered in one line."""

from __future__ import annotations

import logging
import traceback

import gradio as gr

from ...plain.errors import UserError
from ...plain.limits import integer, limits
from ...plain.specs import external
from .. import service
from .runner import OUT_OF_MEMORY, USER_ERRORS, gpu
from .settings import KERNELS, default_model, expand

log = logging.getLogger(__name__)


def compare_specs(strategies: str, budget: int, spacing: int, mode: str = "") -> str:
    """API strategies: names get the shared settings they declare; spacing 0 and mode "" keep the defaults.  A
    file or module spec is refused before anything reads it, whatever the operator allowed the page: an API call
    is web input, and a path it names may be a file it uploaded a moment before."""
    entries = [e for e in strategies.split(",") if e.strip()]
    for entry in entries:
        if external(entry):
            raise UserError(
                f"strategies: {entry.strip()[:80]!r} names a file or module; the compare API runs "
                "registered strategies only (code is never taken from a web request); allowed: "
                "registered names like 'full,kvdirect:budget=64'"
            )
    return ",".join(expand(e, budget or None, spacing or None, mode or None) for e in entries)


@gpu
def compare(
    prompt: str,
    model: str = "",
    strategies: str = "full,kvdirect:mode=exact",
    budget: int = 64,
    spacing: int = 0,
    max_new_tokens: int = 64,
    device: str = "auto",
    dtype: str = "float32",
    kernels: str = "invariant",
) -> dict:
    """Run `strategies` in lockstep on one prompt; returns the same JSON as `python -m kvdirect_app.bench run`.

    `strategies` is comma-separated `name[:key=value]...`; a strategy that
    declares `budget` or `spacing` and does not set it gets the value given
    here (spacing 0: the strategy's default).  `model` "" is the default
    preset.  `kernels`: "invariant" (batch-invariant, the default) or
    "native"; the JSON's `kernels` says which ran and why.  Every input goes through `validate` and the memory
    guard; a bad one is answered with its one-line message (never a traceback).
    """
    try:
        if not isinstance(strategies, str):
            raise UserError("strategies: expected text like 'full,kvdirect:budget=64'")
        specs = compare_specs(
            strategies,
            integer("budget", budget, 1, 1 << 20),
            integer("spacing", spacing, 0, 4096, "0: the strategy's default"),
        )
        tokens = integer("max_new_tokens", max_new_tokens, 1, limits().max_new_tokens)
        if kernels not in KERNELS:
            raise UserError(f"kernels: {str(kernels)[:40]!r} is not allowed; allowed: {', '.join(KERNELS)}")
        return service.compare(prompt, model or default_model(), device, dtype, specs.split(","), tokens, kernels)
    except USER_ERRORS as e:
        raise gr.Error(str(e), print_exception=False) from None
    except OUT_OF_MEMORY as e:
        raise gr.Error(f"{e}; try fewer tokens or strategies", print_exception=False) from None
    except Exception as e:  # a bug: logged here with its traceback, answered without it
        log.error("compare failed:\n%s", traceback.format_exc())
        raise gr.Error(
            f"internal error ({type(e).__name__}); the server log has the details", print_exception=False
        ) from None
