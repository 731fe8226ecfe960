"""Caps on one request and one conversation, and the checks of plain values: plain Python, no torch.

`validate.py` checks a whole run (it needs the model and torch); the web page checks its controls with these
before asking the engine anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import UserError
from .hosted import hosted


class SettingError(UserError):
    """One setting out of its allowed values."""


@dataclass(frozen=True)
class Limits:
    """Caps on one request and one conversation (a browser session)."""

    max_new_tokens: int = 1024
    max_prompt_chars: int = 100_000
    max_turns: int = 64  # user turns in one conversation
    max_total_tokens: int | None = None  # tokens in one conversation (None: the model's context)
    max_strategies: int = 12
    run_seconds: float | None = None  # a page run (all its turns) stops cleanly after this long (None: no bound)


LOCAL = Limits()
HOSTED = Limits(
    max_new_tokens=128, max_prompt_chars=4_000, max_turns=12, max_total_tokens=2_048, max_strategies=9, run_seconds=90.0
)


def limits() -> Limits:
    return HOSTED if hosted() else LOCAL


def integer(setting: str, value, low: int, high: int, what: str = "") -> int:
    """An int in low..high from an int, an integral float or a numeric string (not a bool)."""
    allowed = f"allowed: {low}..{high}{f' ({what})' if what else ''}"
    if isinstance(value, bool) or value is None:
        raise SettingError(f"{setting}: {value!r} is not a whole number; {allowed}")
    try:
        number = float(value) if isinstance(value, str) else value
        if isinstance(number, float):
            if not math.isfinite(number) or number != int(number):
                raise ValueError
            number = int(number)
        number = int(number)
    except (TypeError, ValueError, OverflowError):
        raise SettingError(f"{setting}: {str(value)[:40]!r} is not a whole number; {allowed}") from None
    if not low <= number <= high:
        raise SettingError(f"{setting}: {number} is out of range; {allowed}")
    return number


def text(setting: str, value, cap: Limits) -> str:
    if not isinstance(value, str):
        raise SettingError(f"{setting}: expected text, got {type(value).__name__}")
    if not value.strip():
        raise SettingError(f"{setting}: empty; type a message (1..{cap.max_prompt_chars:,} characters)")
    if len(value) > cap.max_prompt_chars:
        raise SettingError(f"{setting}: {len(value):,} characters; allowed: 1..{cap.max_prompt_chars:,} characters")
    if "\x00" in value:
        raise SettingError(f"{setting}: contains a NUL character; allowed: printable text")
    return value
