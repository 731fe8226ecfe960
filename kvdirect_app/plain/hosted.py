"""Hosted mode: the app serves strangers (a Hugging Face Space, a booth), so it offers less.

On when `KVDIRECT_HOSTED` is 1/true/yes/on, off when it is 0/false/no/off, and on for any other value: a
mistyped setting must not open the app to strangers (`misread` is the line the studio prints at start about it).
When it is unset, on when the app runs on a Space (`SPACE_ID` is set there).  The studio also turns it on for
a server bound to anything but loopback, or with a share link (`studio.serving`).  In hosted mode only the
presets are loaded: from their packages, or, where a package is absent, the preset's own Hub copy
(`catalog.hub_copy`: an id from presets/models.toml, never a visitor's text).  No Hub id typed in, no local
path, no `trust_remote_code`, no strategy file or module: nothing a visitor types is used as a path or run; and
the caps on a conversation are smaller (`validate.limits`).
"""

from __future__ import annotations

import os
from typing import Mapping

ENV = "KVDIRECT_HOSTED"
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def hosted(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    value = (environ.get(ENV) or "").strip().lower()
    if value:
        return value not in OFF  # fails closed: only an explicit "off" value turns it off
    return bool(environ.get("SPACE_ID"))


def misread(environ: Mapping[str, str] | None = None) -> str | None:
    """One line where `KVDIRECT_HOSTED` holds a value that is neither on nor off (hosted mode is then on)."""
    environ = os.environ if environ is None else environ
    value = (environ.get(ENV) or "").strip()
    if not value or value.lower() in ON + OFF:
        return None
    return (
        f"{ENV}={value[:40]!r} is not understood, so hosted mode is on; allowed: {'/'.join(ON)} (on) or "
        f"{'/'.join(OFF)} (off)"
    )
