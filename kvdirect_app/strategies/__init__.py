"""KV-cache strategies, one per module, registered by name (see `base.Strategy`)."""

from .base import Strategy, StrategyCache, StrategyError, parse_spec, parse_specs

__all__ = ["Strategy", "StrategyCache", "StrategyError", "parse_spec", "parse_specs", "registry"]


def registry() -> dict[str, type[Strategy]]:
    from . import available  # noqa: F401

    return dict(Strategy.registry)
