"""What the gateway adds: the same requests sent straight to stand-in workers and through `kvgate serve`.

Direct and proxied rounds alternate, so both see the same machine noise. Reports added latency p50/p99,
requests/s and the gateway process's CPU time per request (from /proc), for JSON and streaming requests at
each concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.procs import cpu_seconds, free_port, spawn_kvgate, stop, wait_http


@dataclass
class Sample:
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0
    gateway_cpu_s: float = 0.0


@dataclass
class ScenarioResult:
    mode: str
    concurrency: int
    requests: int
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float
    added_p50_ms: float
    added_p99_ms: float
    direct_rps: float
    gateway_rps: float
    gateway_cpu_us_per_request: float
    errors: int


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _drive(
    session: aiohttp.ClientSession, urls: list[str], body: bytes, stream: bool, n: int, concurrency: int
) -> Sample:
    sample = Sample()
    counter = itertools.count()
    cycle = itertools.cycle(urls)

    async def one_client() -> None:
        while next(counter) < n:
            url = next(cycle)
            started = time.perf_counter()
            try:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    if stream:
                        async for _ in resp.content.iter_any():
                            pass
                    else:
                        await resp.read()
                    if resp.status != 200:
                        sample.errors += 1
            except aiohttp.ClientError:
                sample.errors += 1
            sample.latencies_s.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    sample.wall_s = time.perf_counter() - started
    return sample


async def measure(
    worker_urls: list[str], gateway_url: str, gateway_pid: int, requests: int, rounds: int,
    concurrencies: list[int], modes: list[str], progress: bool = True,
) -> list[ScenarioResult]:
    from tqdm import tqdm

    results = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        scenarios = [(mode, c) for mode in modes for c in concurrencies]
        bar = tqdm(total=len(scenarios) * rounds * 2, desc="overhead", disable=not progress)
        for mode, concurrency in scenarios:
            stream = mode == "stream"
            body = orjson.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 8, "stream": stream})
            direct_targets = [u + "/v1/completions" for u in worker_urls]
            gateway_targets = [gateway_url + "/v1/completions"]
            warm = max(50, concurrency * 2)
            await _drive(session, direct_targets, body, stream, warm, concurrency)
            await _drive(session, gateway_targets, body, stream, warm, concurrency)
            direct, proxied = Sample(), Sample()
            for _ in range(rounds):
                d = await _drive(session, direct_targets, body, stream, requests, concurrency)
                bar.update()
                cpu0 = cpu_seconds(gateway_pid)
                g = await _drive(session, gateway_targets, body, stream, requests, concurrency)
                g.gateway_cpu_s = cpu_seconds(gateway_pid) - cpu0
                bar.update()
                for total, part in ((direct, d), (proxied, g)):
                    total.latencies_s += part.latencies_s
                    total.wall_s += part.wall_s
                    total.errors += part.errors
                    total.gateway_cpu_s += part.gateway_cpu_s
            n = requests * rounds
            dp50, dp99 = _percentile(direct.latencies_s, 0.5), _percentile(direct.latencies_s, 0.99)
            gp50, gp99 = _percentile(proxied.latencies_s, 0.5), _percentile(proxied.latencies_s, 0.99)
            results.append(ScenarioResult(
                mode=mode, concurrency=concurrency, requests=n,
                direct_p50_ms=dp50 * 1e3, direct_p99_ms=dp99 * 1e3,
                gateway_p50_ms=gp50 * 1e3, gateway_p99_ms=gp99 * 1e3,
                added_p50_ms=(gp50 - dp50) * 1e3, added_p99_ms=(gp99 - dp99) * 1e3,
                direct_rps=n / direct.wall_s, gateway_rps=n / proxied.wall_s,
                gateway_cpu_us_per_request=proxied.gateway_cpu_s / n * 1e6,
                errors=direct.errors + proxied.errors,
            ))
        bar.close()
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=1000, help="requests per round and target")
    parser.add_argument("--rounds", type=int, default=3, help="alternating direct/gateway rounds")
    parser.add_argument("--concurrency", type=int, action="append", help="client concurrency (default 1 and 64)")
    parser.add_argument("--mode", action="append", choices=["json", "stream"], help="default both")
    parser.add_argument("--workers", type=int, default=2, help="stand-in workers")
    parser.add_argument("--out", default="out/overhead.json", help="JSON results file")
    parser.add_argument("--no-uvloop", action="store_true", help="run the gateway on the default asyncio loop")


def run(args: argparse.Namespace) -> int:
    ports = [free_port() for _ in range(args.workers)]
    gw_port = free_port()
    env = dict(os.environ)
    standins = spawn_kvgate(["standin", *itertools.chain.from_iterable(("--port", str(p)) for p in ports)], env)
    gateway = spawn_kvgate(
        ["serve", "--host", "127.0.0.1", "--port", str(gw_port), "--log-level", "warning",
         *itertools.chain.from_iterable(("--worker", f"http://127.0.0.1:{p}") for p in ports)],
        env,
    )
    try:
        worker_urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in worker_urls:
            wait_http(url + "/health")
        wait_http(f"http://127.0.0.1:{gw_port}/ready")
        results = asyncio.run(measure(
            worker_urls, f"http://127.0.0.1:{gw_port}", gateway.pid, args.requests, args.rounds,
            args.concurrency or [1, 64], args.mode or ["json", "stream"],
        ))
    finally:
        stop(gateway)
        stop(standins)
    header = (f"{'mode':<7}{'conc':>5}{'direct p50':>12}{'gw p50':>10}{'added p50':>11}{'added p99':>11}"
              f"{'direct rps':>12}{'gw rps':>9}{'gw CPU/req':>12}{'errors':>8}")
    print(header)
    for r in results:
        print(f"{r.mode:<7}{r.concurrency:>5}{r.direct_p50_ms:>10.3f}ms{r.gateway_p50_ms:>8.3f}ms"
              f"{r.added_p50_ms:>9.3f}ms{r.added_p99_ms:>9.3f}ms{r.direct_rps:>12.0f}{r.gateway_rps:>9.0f}"
              f"{r.gateway_cpu_us_per_request:>10.0f}µs{r.errors:>8}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "overhead", "python": sys.version.split()[0], "cpus": os.cpu_count(),
        "requests_per_round": args.requests, "rounds": args.rounds, "workers": args.workers,
        "results": [asdict(r) for r in results],
    }
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"wrote {out}")
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
