"""KV-cache strategies, one per module, registered by name (see `base.Strategy`; specs are read by `parsing`)."""

from .base import Strategy, StrategyCache, StrategyError
from .parsing import parse_spec, parse_specs, registry

__all__ = ["Strategy", "StrategyCache", "StrategyError", "parse_spec", "parse_specs", "registry"]
