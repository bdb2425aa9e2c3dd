"""`kvgate serve`: run the gateway until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys

from router.aio import run_until_signalled
from router.app import run_gateway
from router.config import ConfigError, GatewayConfig, add_config_arguments, describe, load_config

ENV_PREFIX = "KVGATE_"
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GatewayConfig, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(GatewayConfig, ENV_PREFIX, args)
        from strategies import STRATEGIES

        if config.strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {config.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    except ConfigError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(config.log_level.upper())
    log.info("configuration: %s", describe(config))
    run_until_signalled(run_gateway(config))
    return 0
