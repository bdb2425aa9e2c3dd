"""`kvgate serve`: load the configuration, build the configured strategy from the registry, hand both to the
gateway and run it until SIGINT or SIGTERM.

The gateway's settings (router/config.py) and every strategy's own (its `Options`) come from one YAML file, one
set of `KVGATE_*` environment variables and one set of flags; each strategy's are checked even when another
strategy is chosen, so a typo fails at start-up whichever strategy runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvcore.aio import run_until_signalled
from kvcore.config import ConfigError, add_config_arguments, describe, load_config
from router.config import GatewayConfig
from router.routing import Strategy
from strategies import create_strategy, option_classes, strategy_class

if TYPE_CHECKING:
    from router.processes import GatewayProcess

ENV_PREFIX = "KVGATE_"
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GatewayConfig, ENV_PREFIX, also=option_classes())


def load(args: argparse.Namespace | None = None,
         environ: Mapping[str, str] | None = None) -> tuple[GatewayConfig, Strategy]:
    """The gateway's configuration and its strategy, built with the strategy's options; ConfigError if wrong."""
    sections: list[type[Any]] = [GatewayConfig, *option_classes()]
    config = load_config(GatewayConfig, ENV_PREFIX, args, environ, also=sections)
    options = {cls: load_config(cls, ENV_PREFIX, args, environ, also=sections) for cls in option_classes()}
    return config, create_strategy(config, options[strategy_class(config.strategy).Options])


def assemble(settings: Mapping[str, Any]) -> tuple[GatewayConfig, Strategy]:
    """The same from typed values by name, as a YAML file would name them (tests and benchmarks): each goes to
    the gateway's configuration or, if it is not one of the gateway's settings, to the strategy's options."""
    own = {f.name for f in dataclasses.fields(GatewayConfig)}
    config = GatewayConfig(**{k: v for k, v in settings.items() if k in own})
    return config, create_strategy(config, **{k: v for k, v in settings.items() if k not in own})


def run(args: argparse.Namespace) -> int:
    try:
        config, strategy = load(args)
    except ConfigError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(config.log_level.upper())
    log.info("configuration: %s; %s options: %s", describe(config), strategy.name, describe(strategy.options))
    # the server is imported here, not with the module: `assemble` (vsim's processes) needs no HTTP stack
    from router.app import run_gateway
    from router.processes import serve_processes

    if config.processes > 1:
        return serve_processes(config, strategy.options, serve_one)
    try:
        run_until_signalled(run_gateway(config, strategy))
    except ConfigError as exc:  # found while starting (a trace file that cannot be written)
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    return 0


def serve_one(config: GatewayConfig, options: Any, process: GatewayProcess) -> None:
    """One of `--processes N` gateway processes (spawned: it builds its own strategy)."""
    from router.app import run_gateway

    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [{process.index}] %(name)s: %(message)s")
    run_until_signalled(run_gateway(config, create_strategy(config, options), process))
