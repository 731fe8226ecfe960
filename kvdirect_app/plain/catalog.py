"""The model presets on offer (presets/models.toml) and which of them load here (from a package, or a preset's
own Hub copy where its package is absent): plain Python, no torch.

The web page draws its model picker from here before any model is loaded; `models.py` loads them.
"""

from __future__ import annotations

import functools
import importlib.util
import tomllib
from pathlib import Path

from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache

from .hosted import hosted
from .paths import data

PRESETS_DIR = data("presets")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")
HUB_CACHE, HUB = "the local Hub cache", "the Hub"  # where a preset's Hub copy comes from (`hub_copy`)
HUB_PROBE_S = 3.0  # the one metadata request that decides whether the Hub answers (at start, so it is short)


def presets() -> dict[str, dict]:
    with open(PRESETS_DIR / "models.toml", "rb") as f:
        return tomllib.load(f)


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(spec.origin).parent


def embedded_presets() -> list[str]:
    """Presets whose weights are on this machine: packaged GGUF files (package installed) and the tiny models."""
    return [name for name, p in presets().items() if p["kind"] == "tiny" or package_dir(p["package"]) is not None]


def hub_copy(preset: dict) -> str | None:
    """Where a packaged preset whose package is absent loads its Hub copy from: `HUB_CACHE`, `HUB`, or None (not
    here; also for presets that need no Hub).  See `_hub_copy` for how this is decided."""
    if preset["kind"] == "tiny" or "hub_id" not in preset or package_dir(preset["package"]) is not None:
        return None
    return _hub_copy(preset["hub_id"])


@functools.cache
def _hub_copy(ref: str) -> str | None:
    """Decided once per process, cheaply and without a download, because the page asks it before it is drawn:

    * the local Hub cache holds the copy (its `config.json` and `*.safetensors` weights under `refs/main`'s
      snapshot; `HF_HOME` names the cache): `HUB_CACHE`, no network needed, even with `HF_HUB_OFFLINE=1`;
    * else, where `HF_HUB_OFFLINE` is unset, one HEAD request for the copy's `config.json` answers within
      `HUB_PROBE_S` (no retries): `HUB`.  A gated or private copy refuses it as it would refuse the weights, and a
      dead Hub (no network, a firewall) costs those seconds once, not a hung download at the first message;
    * else None.  Kept for the process's life: a Hub that comes back later is seen at the next start.
    """
    try:
        config = try_to_load_from_cache(ref, "config.json")
    except ValueError:  # not a Hub id
        return None
    if isinstance(config, str) and any(Path(config).parent.glob("*.safetensors")):
        return HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        get_hf_file_metadata(hf_hub_url(ref, "config.json"), timeout=HUB_PROBE_S)
    except Exception:  # no network, DNS, timeout, gated, not found: not loadable from here
        return None
    return HUB


def unavailable_reason(name: str) -> str | None:
    """Why a preset cannot be loaded here (None: it can, from its package or its Hub copy)."""
    p = presets()[name]
    if p["kind"] == "tiny" or package_dir(p["package"]) is not None or hub_copy(p) is not None:
        return None
    return (
        f"its weights ship in the package {p['package']}, which is not installed ({p['install']}"
        + (
            "; a Space installs only requirements.txt, and that package must be installed with --no-deps"
            if "--no-deps" in p["install"]
            else ""
        )
        + f"), and its Hub copy {p['hub_id']} is not in the local "
        "Hub cache"
        + (
            " (HF_HUB_OFFLINE is set)"
            if constants.HF_HUB_OFFLINE
            else f" and the Hub did not answer within {HUB_PROBE_S:.0f} s"
        )
    )


def offered_presets() -> list[str]:
    """The presets a visitor may pick: in hosted mode only those that can be loaded here (packaged, or a preset's
    own Hub copy: a preset's id, never a visitor's text)."""
    return [n for n in presets() if unavailable_reason(n) is None] if hosted() else list(presets())


def is_test_model(name: str) -> bool:
    p = presets().get(name)
    return p is not None and p["kind"] == "tiny"
