"""`kvgate sim`: run a simulated vLLM fleet (one replica, or `--replicas N` processes)."""

from __future__ import annotations

import argparse
import logging
import sys

from bench.sim.config import ReplicaConfig, replica_config
from bench.sim.config import add_arguments as add_config_arguments
from kvcore.aio import run_until_signalled

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--log-level", default="info", help="log level: debug, info, warning, error")


def flags_of(args: argparse.Namespace) -> list[str]:
    """The command-line flags that reproduce `args` (for the replica processes of a fleet)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "replicas", "replica_index"):
            continue
        value = getattr(args, action.dest, None)
        flag = next(f for f in action.option_strings if f.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            if value is not None:
                out.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true
            if value:
                out.append(flag)
        elif value is None:
            continue
        elif isinstance(action, argparse._AppendAction):  # repeatable flag: once per value
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def _announce(config: ReplicaConfig) -> None:
    e = config.engine
    print(f"replica {config.index}: {config.url} events={config.events_endpoint} replay={config.replay_endpoint} "
          f"profile={config.profile.name} blocks={e.num_gpu_blocks}x{e.block_size} "
          f"max_model_len={e.max_model_len} speedup={e.speedup:g}"
          + (f" agent={config.agent.socket_path}" if config.agent else ""), flush=True)


def run(args: argparse.Namespace) -> int:
    index = args.replica_index
    if args.replicas < 1:
        print("kvgate sim: --replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        configs = [replica_config(args, i) for i in ([index] if index is not None else range(args.replicas))]
    except (ValueError, OSError) as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    if index is None and args.replicas > 1:
        from bench.sim.fleet import run_fleet

        return run_fleet(flags_of(args), args.replicas)

    from bench.sim.server import serve_replica

    run_until_signalled(serve_replica(configs[0], _announce))
    return 0
