"""`kvgate demo`: a simulated vLLM fleet on loopback, the gateway in front of it, the same shared-prefix traffic
routed by `round_robin` and by `kv`, and what each did: where requests went, the fleet's prefix-cache hit rate
(from the replicas' own vLLM metrics), time to first token, and the gateway's predicted vs actual cached tokens.

Everything runs on this machine and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.loadgen import closed_loop, fleet_summary, latency_summary, scrape
from bench.make_model import write_model
from bench.procs import free_port
from bench.sim.launch import SimFleet, running_sim_fleet
from kvcore.aio import run_until_signalled
from router.app import GATEWAY, create_app
from router.config import GatewayConfig, WorkerSpec
from strategies import create_strategy

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["databases", "compilers", "gardening", "astronomy", "cooking", "chess"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=3, help="simulated vLLM replicas")
    parser.add_argument("--requests", type=int, default=90, help="requests per strategy")
    parser.add_argument("--concurrency", type=int, default=6, help="requests in flight at once")
    parser.add_argument("--strategy", action="append", help="strategies to compare (default round_robin, kv)")
    parser.add_argument("--speedup", type=float, default=1.0, help="simulated time runs this much faster")
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "demo-model"),
                        help="tiny model directory (made with `kvgate make-model` if missing)")


def _system_prompt(topic: str) -> str:
    rng = random.Random(topic)
    sentences = [f"You are an expert assistant on {topic}."]
    sentences += [f"Rule {i}: answer questions about {topic} with care, cite {rng.randrange(1000)} sources, "
                  f"and keep to {rng.choice(['short', 'clear', 'precise'])} sentences." for i in range(30)]
    return " ".join(sentences)


def _workload(n: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    systems = {topic: _system_prompt(topic) for topic in TOPICS}
    bodies = []
    for i in range(n):
        topic = rng.choice(TOPICS)
        bodies.append({"model": "tiny", "max_tokens": 8, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": systems[topic]},
                                    {"role": "user", "content": f"Question {i} about {topic}?"}]})
    return bodies


async def _run_strategy(fleet: SimFleet, model_dir: str, strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    config = GatewayConfig(host="127.0.0.1", port=free_port(), strategy=strategy, block_size=16,
                           model_dir=[model_dir], worker=[WorkerSpec.parse(s) for s in fleet.worker_specs],
                           health_interval_s=0.5, metrics_interval_s=0.5)
    app = create_app(config, create_strategy(config))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    url = f"http://{config.host}:{config.port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            for replica in fleet.urls:
                async with http.post(replica + "/reset_prefix_cache") as resp:
                    await resp.read()
            gateway = app[GATEWAY]
            if gateway.kv_events is not None:
                while not all(gateway.kv_events.trusted(u) for u in fleet.urls):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            before = await scrape(http, fleet.urls)
            started = time.perf_counter()
            bodies = [orjson.dumps(body) for body in _workload(args.requests)]
            results = await closed_loop(http, url, bodies, args.concurrency, path="/v1/chat/completions")
            fleet_figures = fleet_summary(before, await scrape(http, fleet.urls), time.perf_counter() - started,
                                          fleet.urls)
            registry = gateway.metrics.registry
            routed = {w.url: w.routed for w in gateway.pool.all()}
            predicted = registry.get_sample_value("kvgate_usage_predicted_cached_tokens_total",
                                                  {"strategy": strategy}) or 0.0
            actual = registry.get_sample_value("kvgate_actual_cached_tokens_total", {"strategy": strategy}) or 0.0
    finally:
        await runner.cleanup()
    latency = latency_summary(results)
    return {"strategy": strategy, "hit_rate": fleet_figures["hit_rate"], "routed": routed,
            "ttft_p50_ms": latency["ttft_ms_p50"], "errors": latency["errors"], "predicted": predicted,
            "actual": actual}


async def _demo(args: argparse.Namespace) -> None:
    model_dir = Path(args.model_dir)
    if not (model_dir / "tokenizer.json").exists():
        print(f"making a tiny model directory in {model_dir} ...")
        write_model(model_dir)
    strategies = args.strategy or ["round_robin", "kv"]
    print(f"starting {args.replicas} simulated vLLM replicas (profile llama-3.1-8b-h100, speedup {args.speedup}) ...")
    with running_sim_fleet(args.replicas, model_dir, speedup=args.speedup,
                           extra_args=["--block-size", "16", "--num-gpu-blocks-override", "256"]) as fleet:
        print(f"fleet: {', '.join(fleet.urls)}\n")
        print(f"{len(TOPICS)} system prompts (~600 tokens each) shared by {args.requests} chat requests, "
              f"{args.concurrency} at a time, streamed\n")
        results = [await _run_strategy(fleet, str(model_dir), s, args) for s in strategies]
    print(f"{'strategy':<12}{'fleet hit rate':>16}{'TTFT p50':>11}   requests per replica   predicted/actual cached")
    for r in results:
        routed = " ".join(f"{n:>3}" for n in r["routed"].values())
        ratio = f"{r['predicted']:.0f}/{r['actual']:.0f}" if r["actual"] else "-"
        print(f"{r['strategy']:<12}{r['hit_rate']:>16.1%}{r['ttft_p50_ms']:>9.1f}ms   {routed:<22} {ratio}"
              + (f"   ({r['errors']} errors)" if r["errors"] else ""))
    print("\nhit rate = vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over the fleet (token-weighted);"
          "\nthe gateway exports its own view at /metrics (kvgate_*).")


def run(args: argparse.Namespace) -> int:
    run_until_signalled(_demo(args))
    return 0
