"""The `kvgate` command: one subcommand per job, each defined in the module that does the job."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# subcommand -> module with `add_arguments(parser)` and `run(args) -> int`, imported only when chosen
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvgate.serve", "run the gateway in front of vLLM workers"),
    "demo": ("bench.demo", "start a local fleet and the gateway, send traffic, show where it went"),
    "bench": ("bench.cli", "run a benchmark (`kvgate bench --help` lists them)"),
    "standin": ("bench.standin", "run stand-in OpenAI-compatible workers (for tests and benchmarks)"),
    "agent": ("agent.cli", "run the KV tier agent (DRAM / NVMe / shared tiers) beside a vLLM replica"),
    "sim": ("bench.sim.cli", "run a simulated vLLM fleet: paged prefix cache, time model, KV events, metrics"),
    "make-model": ("bench.make_model", "write a tiny Llama model directory (tokenizer, config, weights)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="Prefix-aware router for vLLM fleets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_module, summary) in SUBCOMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        top.parse_args(argv)  # prints usage or help and exits
        return 2
    name = argv[0]
    module_name, summary = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvgate {name}", description=summary)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper() if isinstance(getattr(args, "log_level", None), str)
        else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    result: int = module.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
