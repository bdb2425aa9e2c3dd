"""`kvgate agent`: run the tier agent beside one vLLM replica."""

from __future__ import annotations

import argparse
import logging

from agent.config import ENV_PREFIX, AgentConfig
from agent.server import TierAgent
from kvcore.aio import run_until_signalled
from kvcore.config import ConfigError, add_config_arguments, describe, load_config

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, AgentConfig, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(AgentConfig, ENV_PREFIX, args).validate()
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    log.info("tier agent config: %s", describe(config, hide=("shared_secret",)))
    run_until_signalled(TierAgent(config).serve_forever())
    return 0
