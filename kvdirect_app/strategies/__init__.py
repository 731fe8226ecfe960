"""KV-cache strategies, one per module, registered by name (see `base.Strategy`; specs are read by `parsing`)."""

from .base import Strategy, StrategyCache, StrategyError
from .parsing import kvpress_spec, parse_spec, parse_specs, registry

__all__ = ["Strategy", "StrategyCache", "StrategyError", "kvpress_spec", "parse_spec", "parse_specs", "registry"]
