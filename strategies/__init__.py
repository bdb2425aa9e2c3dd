"""Routing strategies by name. Adding one is one new module and one line in STRATEGIES."""

from __future__ import annotations

import importlib

from router.config import ConfigError, GatewayConfig
from strategies.base import Decision, RouteRequest, Strategy

# name -> "module:Class"; imported on first use so an unused strategy costs nothing.
STRATEGIES: dict[str, str] = {
    "round_robin": "strategies.round_robin:RoundRobin",
    "least_load": "strategies.least_load:LeastLoad",
    "kv": "strategies.kv:KvAware",
    "prefix": "strategies.prefix:PrefixAffinity",
}


def create_strategy(config: GatewayConfig) -> Strategy:
    target = STRATEGIES.get(config.strategy)
    if target is None:
        raise ConfigError(f"unknown strategy {config.strategy!r}; choose one of {', '.join(sorted(STRATEGIES))}")
    module, _, cls_name = target.partition(":")
    cls: type[Strategy] = getattr(importlib.import_module(module), cls_name)
    return cls(config)


__all__ = ["STRATEGIES", "Decision", "RouteRequest", "Strategy", "create_strategy"]
