"""Hosted mode: the app serves strangers (a Hugging Face Space, a booth), so it offers less.

On when `KVDIRECT_HOSTED` is 1/true, or, when that is unset, when the app
runs on a Space (`SPACE_ID` is set there).  In hosted mode only the presets
whose weights ship in installed packages are loaded (no Hub id, no local
path, no `trust_remote_code`: nothing a visitor types is used as a path or
run), and the caps on a conversation are smaller (`validate.limits`).
"""

from __future__ import annotations

import os

ENV = "KVDIRECT_HOSTED"


def hosted() -> bool:
    value = os.environ.get(ENV)
    if value is not None and value.strip():
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(os.environ.get("SPACE_ID"))
