"""`kvgate bench NAME ...`: run one benchmark; each is a module with `add_arguments(parser)` and `run(args)`."""

from __future__ import annotations

import argparse
import importlib

from bench.procs import exit_on_sigterm

BENCHMARKS: dict[str, tuple[str, str]] = {
    "overhead": ("bench.overhead", "what the gateway adds over direct access to the workers"),
    "abuse": ("bench.abuse", "hostile load: 10k held connections, overload, templates, huge bodies, slowloris"),
    "kv": ("bench.kv_bench", "KV events applied per second, index lookup and decision cost, bytes per entry"),
    "prefix": ("bench.prefix_bench", "prefix routing costs: tokenize + hash, next turn, trie lookup, bytes per node"),
    "sim-throughput": ("bench.sim_throughput", "requests/s one simulated replica process sustains"),
    "sim-ttft": ("bench.sim_ttft_curve", "TTFT vs prompt length: a sim profile's model and a live replica"),
    "compare": ("bench.compare", "kvgate strategies, sglang-router, vllm-router on one sim fleet"),
    "vsim": ("bench.vsim", "virtual-time fleet simulation of a whole trace, 8-64 replicas, with or without tiers"),
    "drift": ("bench.drift", "kv: predicted vs the engines' reported cached tokens, per worker and round"),
    "trace": ("bench.traces", "write a synthetic conversation trace (Mooncake's format) of a chosen size"),
    "calibrate": ("bench.calibrate", "fit the simulator's time model to a recorded trace's timings"),
    "plan": ("bench.plan", "the smallest fleet (strategy, replicas, DRAM / NVMe / shared) meeting a TTFT objective"),
    "agent": ("bench.agent_bench", "tier agent: DRAM/NVMe/Redis tiers vs memcpy/file/redis-py, lookup latency"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    choices = ", ".join(f"{name} ({summary})" for name, (_, summary) in BENCHMARKS.items())
    parser.add_argument("name", choices=sorted(BENCHMARKS), metavar="NAME", help=f"benchmark: {choices}")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options (NAME --help)")


def run(args: argparse.Namespace) -> int:
    exit_on_sigterm()  # a benchmark's `finally` blocks stop the replicas, gateways and agents it started
    module_name, summary = BENCHMARKS[args.name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvgate bench {args.name}", description=summary)
    module.add_arguments(parser)
    result: int = module.run(parser.parse_args(args.options))
    return result
