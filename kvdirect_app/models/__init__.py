"""Models: loading a preset (`loading`), its kept copy (`model_cache`), transformers' cache internals behind one
adapter (`compat`), the geometry a cache's size follows from, prompts, the thread count, and the kernels' probe
verdicts a loaded model keeps (`probe_verdicts`).

`load_model` and its companions are re-exported here: ``from kvdirect_app.models import load_model`` is the
documented way in."""

from .loading import (
    DTYPES,
    LoadedModel,
    ModelError,
    available_devices,
    is_loaded,
    load_model,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "DTYPES",
    "LoadedModel",
    "ModelError",
    "available_devices",
    "is_loaded",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]
