"""Where the data files are: the checkout's folders (presets/, assets/, docs/claims/), or the copies an installed
package carries (`pip install .` puts them under kvdirect_app/_data/, see pyproject.toml)."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # kvdirect_app/ (this module is in kvdirect_app/plain/)
CHECKOUT = PACKAGE.parent
INSTALLED = {"presets": "presets", "assets": "assets", "docs/claims": "claims", "docs/schema": "schema"}


def data(name: str) -> Path:
    """The folder `name` ("presets", "assets", "docs/claims" or "docs/schema"): the checkout's when this module runs
    from a checkout, else the installed package's copy."""
    local = CHECKOUT / name
    if local.is_dir():
        return local
    return PACKAGE / "_data" / INSTALLED[name]


def cache(env: str, name: str) -> Path | None:
    """A cache folder of ours: the environment variable `env` names it (``off`` turns it off: None), else
    ``$XDG_CACHE_HOME`` or ``~/.cache``, then ``kvdirect-studio/<name>``."""
    value = os.environ.get(env, "").strip()
    if value.lower() in ("off", "0", "none", "false"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "kvdirect-studio" / name
