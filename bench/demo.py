"""`kvgate demo`: a local fleet, the gateway in front of it, some traffic, and where it went.

Everything runs on loopback and stops by itself. The fleet is made of stand-in workers until the simulated vLLM
fleet is available to the demo.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from bench.procs import free_port
from bench.standin import StandinBehaviour, serve_standins
from router.aio import run_until_signalled
from router.app import GATEWAY, create_app
from router.config import GatewayConfig, WorkerSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=3, help="workers in the local fleet")
    parser.add_argument("--requests", type=int, default=60, help="requests to send")
    parser.add_argument("--strategy", default="round_robin", help="routing strategy")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")


async def _traffic(gateway_url: str, requests: int, concurrency: int) -> dict[str, int]:
    statuses: dict[str, int] = {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

        async def client() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                if i % 3 == 0:
                    path = "/v1/chat/completions"
                    body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "stream": i % 2 == 0,
                                            "messages": [{"role": "user", "content": f"question {i}"}]}
                else:
                    path = "/v1/completions"
                    body = {"model": "tiny", "prompt": f"prompt {i}", "max_tokens": 8, "stream": i % 2 == 0}
                async with http.post(gateway_url + path, json=body) as resp:
                    await resp.read()
                    statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return statuses


async def _demo(args: argparse.Namespace) -> None:
    ports = [free_port() for _ in range(args.replicas)]
    behaviour = StandinBehaviour(token_delay_s=0.002)
    async with serve_standins("127.0.0.1", ports, behaviour) as urls:
        config = GatewayConfig(host="127.0.0.1", port=free_port(), strategy=args.strategy,
                               worker=[WorkerSpec(u) for u in urls], health_interval_s=0.5)
        app = create_app(config)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        gateway_url = f"http://{config.host}:{config.port}"
        try:
            print(f"fleet: {len(urls)} workers; gateway {gateway_url} with strategy {config.strategy}")
            statuses = await _traffic(gateway_url, args.requests, args.concurrency)
            print(f"sent {args.requests} requests: statuses {statuses}")
            print("\nwhere they went (GET /admin/workers):")
            for worker in app[GATEWAY].pool.all():
                row = worker.describe()
                print(f"  {row['url']:<28} healthy={row['healthy']!s:<5} routed={row['requests_routed']:>4}")
            async with aiohttp.ClientSession() as http, http.get(gateway_url + "/metrics") as resp:
                text = await resp.text()
            print("\nselected metrics (GET /metrics):")
            for line in text.splitlines():
                if line.startswith(("kvgate_requests_total", "kvgate_routing_decisions_total",
                                    "kvgate_time_to_first_byte_seconds_count", "kvgate_worker_healthy")):
                    print("  " + line)
        finally:
            await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    run_until_signalled(_demo(args))
    return 0



