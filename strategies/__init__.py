"""Routing strategies by name. Adding one is one new module and one line in STRATEGIES; the contract they
implement (`Strategy`, `RouteRequest`, `Decision`) is the gateway's, in router/routing.py."""

from __future__ import annotations

import importlib

from kvcore.config import ConfigError
from router.config import GatewayConfig
from router.routing import Strategy

# name -> "module:Class"; imported on first use so an unused strategy costs nothing.
STRATEGIES: dict[str, str] = {
    "round_robin": "strategies.round_robin:RoundRobin",
    "least_load": "strategies.least_load:LeastLoad",
    "kv": "strategies.kv:KvAware",
    "prefix": "strategies.prefix:PrefixAffinity",
}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy registered as `name`; ConfigError when there is none."""
    target = STRATEGIES.get(name)
    if target is None:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    module, _, cls_name = target.partition(":")
    cls: type[Strategy] = getattr(importlib.import_module(module), cls_name)
    return cls


def create_strategy(config: GatewayConfig) -> Strategy:
    """The strategy `config.strategy` names, built for this configuration."""
    return strategy_class(config.strategy)(config)


__all__ = ["STRATEGIES", "create_strategy", "strategy_class"]
