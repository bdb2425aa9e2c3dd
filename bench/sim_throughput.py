"""How many requests per second one simulated replica process sustains, with model time made negligible.

Starts `kvgate sim --replicas 1 --speedup X` (X large: every step's modelled duration is divided by X), drives it
with a lean keep-alive HTTP client (router.upstream, on uvloop) at a fixed concurrency for a fixed time, and
reports requests/s, latency percentiles and the replica's CPU seconds per request (from /proc), so the
capacity of one core is known even when the load generator shares the machine. Prints a table and writes JSON.

    kvgate bench sim-throughput [--seconds 5] [--concurrency 64] [--out sim_throughput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.procs import cpu_seconds, exit_on_sigterm, free_port, spawn_kvgate, stop, wait_http
from router.upstream import FETCH_MAX_BYTES, UpstreamPool


@dataclass
class Result:
    scenario: str
    concurrency: int
    seconds: float
    requests: int
    errors: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    replica_cpu_ms_per_request: float
    replica_core_capacity_rps: float   # 1 / CPU per request: what one fully busy core would sustain


SCENARIOS: dict[str, dict[str, Any]] = {
    # a short text prompt (tokenized by the replica), one output token
    "completion-text-1tok": {"path": "/v1/completions", "body": {"prompt": "Say hello to the simulator.",
                                                                 "max_tokens": 1}},
    # 64 prompt token ids (4 blocks hashed), 8 output tokens
    "completion-ids-8tok": {"path": "/v1/completions", "body": {"prompt": list(range(10, 74)), "max_tokens": 8}},
    # a chat request through the chat template, 4 output tokens, streamed
    "chat-stream-4tok": {"path": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": "Hello there, how are you?"}],
                                  "max_tokens": 4, "stream": True}},
}


async def drive(url: str, model: str, scenario: dict[str, Any], concurrency: int, seconds: float,
                pid: int) -> tuple[int, int, list[float], float, float]:
    pool = UpstreamPool(limit_per_host=concurrency, connect_timeout=5)
    body = orjson.dumps({"model": model, **scenario["body"]})
    target = url + scenario["path"]
    headers = [("Content-Type", "application/json")]
    latencies: list[float] = []
    errors = 0
    counter = itertools.count()

    async def one() -> None:
        nonlocal errors
        t0 = time.perf_counter()
        response = await pool.request("POST", target, headers, body, read_timeout=30)
        try:
            await response.read(FETCH_MAX_BYTES)
            if response.status != 200:
                errors += 1
        finally:
            response.close()
        latencies.append(time.perf_counter() - t0)
        next(counter)

    async def worker(deadline: float) -> None:
        while time.perf_counter() < deadline:
            await one()

    # warm-up: connections, caches
    await asyncio.gather(*(worker(time.perf_counter() + 0.5) for _ in range(concurrency)))
    latencies.clear()
    errors = 0
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    async with asyncio.timeout(seconds + 30):
        await asyncio.gather(*(worker(t0 + seconds) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0
    pool.close()
    return len(latencies), errors, latencies, wall, cpu


def run_scenario(name: str, url: str, model: str, concurrency: int, seconds: float, pid: int) -> Result:
    import uvloop

    n, errors, lat, wall, cpu = uvloop.run(drive(url, model, SCENARIOS[name], concurrency, seconds, pid))
    lat.sort()
    cpu_per = cpu / n if n else float("nan")
    return Result(name, concurrency, round(wall, 3), n, errors, round(n / wall, 1),
                  round(statistics.median(lat) * 1e3, 3) if lat else float("nan"),
                  round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 3) if lat else float("nan"),
                  round(cpu_per * 1e3, 4), round(1 / cpu_per, 1) if n else 0.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", help="model dir (default: make one with kvgate make-model in a temp dir)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--speedup", type=float, default=1e6)
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all")
    parser.add_argument("--out", default="sim_throughput.json")


def _options(args: argparse.Namespace) -> list[str]:
    out = [f"--seconds={args.seconds:g}", f"--concurrency={args.concurrency}", f"--speedup={args.speedup:g}",
           f"--profile={args.profile}"]
    return out + [f"--scenario={s}" for s in args.scenario or []]


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from bench.make_model import write_model

            model_dir = str(Path(tmp) / "tiny")
            write_model(Path(model_dir))
        port = free_port()
        proc = spawn_kvgate(["sim", "--model-dir", model_dir, "--served-model-name", "tiny", "--port", str(port),
                             "--events-port", str(free_port()), "--replay-port", str(free_port()),
                             "--speedup", str(args.speedup), "--profile", args.profile,
                             "--enable-prompt-tokens-details", "--log-level", "warning"],
                            env=os.environ)
        results = []
        try:
            wait_http(f"http://127.0.0.1:{port}/health", 30)
            for name in args.scenario or list(SCENARIOS):
                results.append(run_scenario(name, f"http://127.0.0.1:{port}", "tiny", args.concurrency,
                                            args.seconds, proc.pid))
        finally:
            stop(proc)
    header = f"{'scenario':<22} {'conc':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms/req':>11} " \
             f"{'1-core req/s':>13} {'errors':>6}"
    print(header)
    for r in results:
        print(f"{r.scenario:<22} {r.concurrency:>5} {r.requests_per_s:>9.1f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} "
              f"{r.replica_cpu_ms_per_request:>11.3f} {r.replica_core_capacity_rps:>13.1f} {r.errors:>6}")
    report = {"command": " ".join(["kvgate", "bench", "sim-throughput", *_options(args)]),
              "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0], "speedup": args.speedup,
              "profile": args.profile,
              "results": [asdict(r) for r in results]}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r.errors == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
