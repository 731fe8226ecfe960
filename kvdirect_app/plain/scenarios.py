"""Scripted conversations (`presets/scenarios.toml`): lists of user turns played one after another."""

from __future__ import annotations

import tomllib

from .paths import data

PRESETS_DIR = data("presets")


def scenarios() -> dict[str, dict]:
    """name -> {"about", "turns", "raw"?}; a scenario's `file` is read as its first turn."""
    with open(PRESETS_DIR / "scenarios.toml", "rb") as f:
        table = tomllib.load(f)
    for scenario in table.values():
        if "file" in scenario:
            scenario["turns"] = [
                (PRESETS_DIR / scenario["file"]).read_text(encoding="utf-8"),
                *scenario.get("turns", []),
            ]
    return table
