"""`kvgate agent`: run the tier agent beside one vLLM replica."""

from __future__ import annotations

import argparse
import gc
import logging

from agent.config import ENV_PREFIX, AgentConfig
from agent.server import TierAgent
from kvcore.aio import run_until_signalled
from kvcore.config import ConfigError, add_config_arguments, describe, load_config

log = logging.getLogger(__name__)

# The agent holds a few objects per block (hundreds of thousands), long-lived, and allocates a few more per block
# stored; at Python's default first threshold (700) its collector ran every couple of stores and cost a quarter of
# the CPU of a store (36 blocks: 0.22 -> 0.16 ms in process). Cycles are rare here; they are still collected.
GC_THRESHOLDS = (50_000, 20, 100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, AgentConfig, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(AgentConfig, ENV_PREFIX, args).validate()
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    log.info("tier agent config: %s", describe(config, hide=("shared_secret",)))
    gc.set_threshold(*GC_THRESHOLDS)
    try:  # the tiers: a directory that cannot be made, a shared URL that is not one
        agent = TierAgent(config)
    except (OSError, ValueError) as exc:
        log.error("cannot start the tier agent: %s", exc)
        return 2
    run_until_signalled(agent.serve_forever())
    return 0
