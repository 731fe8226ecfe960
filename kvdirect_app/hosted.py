"""Hosted mode: the app serves strangers (a Hugging Face Space, a booth), so it offers less.

On when `KVDIRECT_HOSTED` is 1/true, or, when that is unset, when the app
runs on a Space (`SPACE_ID` is set there).  In hosted mode only the presets
are loaded: from their packages, or, where a package is absent, the preset's
own Hub copy (`catalog.hub_copy`: an id from presets/models.toml, never a
visitor's text).  No Hub id typed in, no local path, no `trust_remote_code`:
nothing a visitor types is used as a path or run; and the caps on a
conversation are smaller (`validate.limits`).
"""

from __future__ import annotations

import os

ENV = "KVDIRECT_HOSTED"


def hosted() -> bool:
    value = os.environ.get(ENV)
    if value is not None and value.strip():
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(os.environ.get("SPACE_ID"))
