"""Spec text -> strategy instances, and the names registered: `name[:key=value]...`, or a class of one's own
(`PATH.py:Class`, `module:Class`, loaded by `external`).  Apart from `base` so that the base imports none of the
families: this module imports them all (`available`), so the registry is full before a spec is read."""

from __future__ import annotations

import typing

from ..plain.specs import external, settings_of
from . import available  # noqa: F401  (imports every strategy module so the registry is full)
from . import external as outside
from .base import Strategy, StrategyError


def registry() -> dict[str, type[Strategy]]:
    """Every registered strategy class by name."""
    return dict(Strategy.registry)


def _coerce(value: str, typ, field: str, strategy: str):
    try:
        if typ is bool:
            if value.lower() in ("true", "1", "yes", "on"):
                return True
            if value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        return typ(value)
    except ValueError:
        raise StrategyError(f"{strategy}: setting {field}={value!r} is not a valid {typ.__name__}") from None


def parse_spec(text: str) -> Strategy:
    """`name[:key=value]...`, `PATH.py:Class[:key=value]...` or `module:Class[:key=value]...` -> a Strategy
    instance; one clear error line on bad input."""
    text = text.strip()
    if not text:
        raise StrategyError(f"empty strategy spec; known strategies: {', '.join(sorted(Strategy.registry))}")
    if external(text):
        cls = outside.load(text)
        name, pairs = cls._source, settings_of(text)
    else:
        name, *pairs = text.split(":")
        cls = Strategy.registry.get(name)
    if cls is None:
        raise StrategyError(
            f"unknown strategy {name!r}; known strategies: {', '.join(sorted(Strategy.registry))}; "
            "or a class of one's own: PATH.py:ClassName or module:ClassName"
        )
    fields = cls.settings()
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise StrategyError(f"{name}: setting {pair!r} is not of the form key=value")
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise StrategyError(f"{name}: unknown setting {key!r}; allowed: {allowed}")
        kwargs[key] = _coerce(value, hints[key], key, name)
    strategy = cls(**kwargs)
    strategy._label = text
    return strategy


def kvpress_spec(text: str) -> str:
    """`text` with the settings under which the built-in strategy it names is its kvpress press (`Strategy.kvpress`)
    added where `text` does not set them itself: `snapkv` -> `snapkv:window=64`, `snapkv:window=32` stays.  A class
    of one's own is left as written."""
    strategy = parse_spec(text)
    if external(text):
        return text
    given = {pair.partition("=")[0] for pair in text.strip().split(":")[1:]}
    return ":".join([text.strip()] + [f"{k}={v}" for k, v in type(strategy).kvpress.items() if k not in given])


def parse_specs(text: str) -> list[Strategy]:
    """Comma-separated specs; duplicates are an error."""
    out, seen = [], set()
    for part in text.split(","):
        strategy = parse_spec(part)
        if strategy.spec() in seen:
            raise StrategyError(f"strategy {strategy.spec()!r} is listed twice")
        seen.add(strategy.spec())
        out.append(strategy)
    return out
