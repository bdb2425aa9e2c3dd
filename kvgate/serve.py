"""`kvgate serve`: load the configuration, build the configured strategy from the registry, hand both to the
gateway and run it until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys

from kvcore.aio import run_until_signalled
from kvcore.config import ConfigError, add_config_arguments, describe, load_config
from router.app import run_gateway
from router.config import GatewayConfig
from strategies import create_strategy

ENV_PREFIX = "KVGATE_"
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GatewayConfig, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(GatewayConfig, ENV_PREFIX, args)
        strategy = create_strategy(config)
    except ConfigError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(config.log_level.upper())
    log.info("configuration: %s", describe(config))
    run_until_signalled(run_gateway(config, strategy))
    return 0
