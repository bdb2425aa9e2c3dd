"""Routing strategies by name. Adding one is one new module and one line in STRATEGIES: the module declares the
strategy's settings (`Options`) and registers its metrics itself. The contract they implement (`Strategy`,
`RouteRequest`, `Decision`) is the gateway's, in router/routing.py."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from kvcore.config import ConfigError
from router.config import GatewayConfig
from router.routing import Strategy

# name -> "module:Class"; imported on first use so an unused strategy costs nothing.
STRATEGIES: dict[str, str] = {
    "round_robin": "strategies.round_robin:RoundRobin",
    "least_load": "strategies.least_load:LeastLoad",
    "kv": "strategies.kv:KvAware",
    "prefix": "strategies.prefix:PrefixAffinity",
    "ttft": "strategies.ttft:TtftAware",
}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy registered as `name`; ConfigError when there is none."""
    target = STRATEGIES.get(name)
    if target is None:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    module, _, cls_name = target.partition(":")
    cls: type[Strategy] = getattr(importlib.import_module(module), cls_name)
    return cls


def option_classes() -> list[type[Any]]:
    """Every registered strategy's `Options`, each once: what `kvgate serve` accepts besides its own settings."""
    found: list[type[Any]] = []
    for name in STRATEGIES:
        options = strategy_class(name).Options
        if options not in found:
            found.append(options)
    return found


def create_strategy(config: GatewayConfig, options: Any = None, **overrides: Any) -> Strategy:
    """The strategy `config.strategy` names, with `options` (an instance of its `Options`; its defaults when
    None) and any single settings overridden by name (`prefix_prefill_weight=3.0`)."""
    cls = strategy_class(config.strategy)
    chosen = cls.Options() if options is None else options
    if not isinstance(chosen, cls.Options):
        raise ConfigError(f"strategy {config.strategy!r} takes {cls.Options.__name__}, not {type(chosen).__name__}")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(chosen)}
    if unknown:
        raise ConfigError(f"strategy {config.strategy!r} has no option {', '.join(sorted(unknown))}")
    return cls(config, dataclasses.replace(chosen, **overrides))


__all__ = ["STRATEGIES", "create_strategy", "option_classes", "strategy_class"]
