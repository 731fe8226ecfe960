"""The model presets on offer (presets/models.toml) and which of them this machine has: plain Python, no torch.

The web page draws its model picker from here before any model is loaded; `models.py` loads them.
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from .hosted import hosted
from .paths import data

PRESETS_DIR = data("presets")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")


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


def unavailable_reason(name: str) -> str | None:
    """Why a preset cannot be loaded here without the Hub (None: it can)."""
    p = presets()[name]
    if p["kind"] == "tiny" or package_dir(p["package"]) is not None:
        return None
    return (f"its weights ship in the package {p['package']}, which is not installed ({p['install']}"
            + ("; a Space installs only requirements.txt, and that package must be installed with --no-deps"
               if "--no-deps" in p["install"] else "") + ")"
            + ("; hosted mode does not download its Hub copy" if hosted() else ""))


def offered_presets() -> list[str]:
    """The presets a visitor may pick: in hosted mode only those on this machine."""
    return embedded_presets() if hosted() else list(presets())


def is_test_model(name: str) -> bool:
    p = presets().get(name)
    return p is not None and p["kind"] == "tiny"
