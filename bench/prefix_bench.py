"""`kvgate bench prefix`: what prefix-aware routing costs and what it buys.

Costs, measured in this process on the tiny model from `kvgate make-model`: tokenize + hash an ~8,000-token chat
prompt (cold), the next turn of the same conversation (its earlier turns cached), a prefix-trie lookup for a
500-block prompt over 16 workers, memory per trie node. Gains, measured on a simulated fleet (`kvgate sim`
replicas, one process each): fleet prefix-cache hit rate (the replicas' own `vllm:prefix_cache_*` counters) and
client-side TTFT p50/p90 of `prefix` against `round_robin` on a shared-prefix workload. Prints a table and writes
JSON (`--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench.make_model import write_model
from bench.procs import free_port, spawn_kvgate, stop, wait_http
from router.app import GATEWAY, create_app
from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.pool import Worker
from router.prefix_trie import PrefixTrie
from router.prompt_tokens import PromptTokens
from strategies import RouteRequest, create_strategy
from strategies.prefix import measure_node_bytes

CHAT = "/v1/chat/completions"
WORDS = Path(random.__file__).read_text().split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- costs ---------------------------------------------------------------------------------------------------


def _conversation(rng: random.Random, target_tokens: int) -> list[dict[str, str]]:
    """A system prompt and alternating turns, about `target_tokens` tokens of the tiny model (~2.2 per word)."""
    messages = [{"role": "system", "content": _words(rng, target_tokens // 6)}]
    while sum(len(m["content"].split()) for m in messages) * 2.2 < target_tokens:
        messages.append({"role": "user", "content": _words(rng, 120)})
        messages.append({"role": "assistant", "content": _words(rng, 200)})
    messages.append({"role": "user", "content": _words(rng, 60)})
    return messages


async def measure_tokenize(model_dir: Path, repeat: int) -> dict[str, Any]:
    """Per request: render the chat template, encode, hash into block keys. `*_ms` run on this thread (the
    work itself); `*_service_ms` go through `PromptTokens.keys`, thread-pool hop included."""
    rng = random.Random(1)
    prompts = PromptTokens(GatewayConfig(model_dir=[str(model_dir)], block_size=16))
    tokenizer = await prompts.tokenizer("tiny")
    assert tokenizer is not None
    root = root_key("tiny")
    conversations = [_conversation(rng, 8000) for _ in range(repeat)]
    cold: list[float] = []
    cold_service: list[float] = []
    tokens = 0
    for messages in conversations:
        body = {"model": "tiny", "messages": messages}
        prompts.clear_caches()
        started = time.perf_counter()
        tokens = prompts.tokenize_now(tokenizer, body, True, root).prompt_tokens
        cold.append(time.perf_counter() - started)
        prompts.clear_caches()
        started = time.perf_counter()
        await prompts.keys(CHAT, "tiny", body, {})
        cold_service.append(time.perf_counter() - started)
    turn: list[float] = []
    turn_service: list[float] = []
    for messages in conversations:
        await prompts.keys(CHAT, "tiny", {"messages": messages}, {})  # the conversation so far is cached
        following = [*messages, {"role": "assistant", "content": _words(rng, 40)},
                     {"role": "user", "content": _words(rng, 25)}]
        started = time.perf_counter()
        prompts.tokenize_now(tokenizer, {"messages": following}, True, root)
        turn.append(time.perf_counter() - started)
        following = [*following, {"role": "assistant", "content": _words(rng, 40)},
                     {"role": "user", "content": _words(rng, 25)}]
        started = time.perf_counter()
        await prompts.keys(CHAT, "tiny", {"messages": following}, {})
        turn_service.append(time.perf_counter() - started)
    prompts.close()
    return {
        "prompt_tokens": tokens,
        "cold_ms_p50": statistics.median(cold) * 1e3,
        "cold_ms_min": min(cold) * 1e3,
        "cold_service_ms_p50": statistics.median(cold_service) * 1e3,
        "next_turn_ms_p50": statistics.median(turn) * 1e3,
        "next_turn_ms_min": min(turn) * 1e3,
        "next_turn_service_ms_p50": statistics.median(turn_service) * 1e3,
        "next_turn_new_text": "one assistant turn of 40 words and one user turn of 25 words",
    }


def measure_trie(workers: int = 16, blocks: int = 500, filler_nodes: int = 200_000) -> dict[str, Any]:
    rng = random.Random(2)
    trie = PrefixTrie(max_nodes=filler_nodes * 2, ttl_s=3600)
    urls = [f"http://10.0.0.{i}:8000" for i in range(workers)]
    for i in range(filler_nodes // blocks):  # other prompts sharing the trie
        trie.insert([rng.getrandbits(64) for _ in range(blocks)], urls[i % workers])
    prompt = [rng.getrandbits(64) for _ in range(blocks)]
    for url in urls:  # every worker was sent a different-length prefix of this prompt
        trie.insert(prompt[: rng.randrange(1, blocks + 1)], url)
    lookups = _timed(lambda: trie.match(prompt), 2000)
    fresh = [[rng.getrandbits(64) for _ in range(blocks)] for _ in range(200)]
    inserts = iter(fresh)
    insert_new = _timed(lambda: trie.insert(next(inserts), urls[0]), len(fresh))
    insert_known = _timed(lambda: trie.insert(prompt, urls[1]), 200)
    config = GatewayConfig(strategy="prefix", block_size=16)
    strategy = create_strategy(config)
    pool = [Worker(spec=WorkerSpec(u), healthy=True, models=frozenset({"tiny"})) for u in urls]
    token_ids = [rng.randrange(4096) for _ in range(blocks * 16)]
    request = RouteRequest("tiny", CHAT, {}, {}, token_ids, block_keys(token_ids, 16, root_key("tiny")),
                           len(token_ids))
    choose = _timed(lambda: strategy.choose(request, pool), 500)
    return {
        "workers": workers, "prompt_blocks": blocks, "trie_nodes": len(trie),
        "lookup_us_p50": statistics.median(lookups) * 1e6, "lookup_us_p99": _pct(lookups, 0.99) * 1e6,
        "insert_new_500_us_p50": statistics.median(insert_new) * 1e6,
        "insert_known_500_us_p50": statistics.median(insert_known) * 1e6,
        "choose_us_p50": statistics.median(choose) * 1e6,
        "bytes_per_node": measure_node_bytes(prompts=100, blocks=200, workers=4),
    }


# --- gains on a simulated fleet ------------------------------------------------------------------------------


async def _metric_sum(http: aiohttp.ClientSession, urls: list[str], name: str) -> float:
    total = 0.0
    for url in urls:
        async with http.get(url + "/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.split("{", 1)[0].split(" ", 1)[0] == name:
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def _ttft(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Seconds until the first generated text arrives (vLLM's first chunk only carries the role)."""
    started = time.perf_counter()
    async with http.post(url + CHAT, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                first = time.perf_counter() - started
                await resp.read()
                return first
    raise RuntimeError("the stream ended without any generated text")


async def run_workload(
    urls: list[str], strategy: str, model_dir: Path, args: argparse.Namespace,
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    systems = [_words(random.Random(100 + g), args.system_words) for g in range(args.groups)]
    weights = [1.0 / (g + 1) for g in range(args.groups)]  # Zipf-like popularity
    bodies = [{"model": "tiny", "stream": True, "max_tokens": args.max_tokens, "ignore_eos": True,
               "messages": [{"role": "system", "content": rng.choices(systems, weights)[0]},
                            {"role": "user", "content": _words(rng, args.user_words)}]}
              for _ in range(args.requests)]
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for url in urls:
            async with http.post(url + "/reset_prefix_cache") as resp:
                await resp.read()
        hits0 = await _metric_sum(http, urls, "vllm:prefix_cache_hits_total")
        queries0 = await _metric_sum(http, urls, "vllm:prefix_cache_queries_total")
        config = GatewayConfig(host="127.0.0.1", port=free_port(), worker=[WorkerSpec.parse(u) for u in urls],
                               strategy=strategy, model_dir=[str(model_dir)], block_size=16,
                               health_interval_s=0.5, metrics_interval_s=0.25,
                               prefix_request_cost_tokens=args.request_cost, prefix_prefill_weight=args.prefill_weight)
        app = create_app(config)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", config.port).start()
        gateway_url = f"http://127.0.0.1:{config.port}"
        try:
            queue = list(reversed(bodies))
            ttfts: list[float] = []

            async def client() -> None:
                while queue:
                    ttfts.append(await _ttft(http, gateway_url, queue.pop()))

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(args.concurrency)))
            elapsed = time.perf_counter() - started
            routed = {w.url: w.routed for w in app[GATEWAY].pool.all()}
        finally:
            await runner.cleanup()
        hits = await _metric_sum(http, urls, "vllm:prefix_cache_hits_total") - hits0
        queries = await _metric_sum(http, urls, "vllm:prefix_cache_queries_total") - queries0
    return {
        "strategy": strategy, "requests": len(ttfts), "seconds": elapsed,
        "fleet_hit_rate": hits / queries if queries else 0.0,
        "ttft_ms_p50": _pct(ttfts, 0.5) * 1e3, "ttft_ms_p90": _pct(ttfts, 0.9) * 1e3,
        "requests_per_replica": sorted(routed.values()),
    }


async def measure_fleet(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    # one `kvgate sim --replicas 1` process per replica, each on its own free ports
    procs = []
    urls = []
    try:
        for _ in range(args.replicas):
            port = free_port()
            procs.append(spawn_kvgate([
                "sim", "--replicas", "1", "--port", str(port), "--events-port", str(free_port()),
                "--replay-port", str(free_port()), "--model-dir", str(model_dir), "--served-model-name", "tiny",
                "--speedup", str(args.speedup), "--block-size", "16",
                "--num-gpu-blocks-override", str(args.gpu_blocks), "--log-level", "warning"]))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_http(url + "/health", 60)
        results = [await run_workload(urls, s, model_dir, args) for s in args.strategies.split(",")]
    finally:
        for proc in procs:
            stop(proc)
    return {"replicas": args.replicas, "speedup": args.speedup, "request_cost_tokens": args.request_cost,
            "prefill_weight": args.prefill_weight, "gpu_blocks_per_replica": args.gpu_blocks,
            "groups": args.groups, "system_words": args.system_words, "user_words": args.user_words,
            "requests": args.requests, "concurrency": args.concurrency, "results": results}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--repeat", type=int, default=20, help="tokenizer timing repetitions")
    parser.add_argument("--skip-fleet", action="store_true", help="only the in-process costs")
    parser.add_argument("--skip-costs", action="store_true", help="only the simulated fleet")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=10.0, help="sim time divisor (TTFTs are wall time)")
    parser.add_argument("--gpu-blocks", type=int, default=1024, help="KV blocks per simulated replica")
    parser.add_argument("--groups", type=int, default=16, help="distinct system prompts")
    parser.add_argument("--system-words", type=int, default=450, help="words per system prompt (~1,000 tokens)")
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--strategies", default="round_robin,prefix", help="comma-separated, compared in order")
    defaults = GatewayConfig()
    parser.add_argument("--request-cost", type=float, default=defaults.prefix_request_cost_tokens,
                        help="prefix strategy knob (--prefix-request-cost-tokens)")
    parser.add_argument("--prefill-weight", type=float, default=defaults.prefix_prefill_weight,
                        help="prefix strategy knob (--prefix-prefill-weight)")


def _print_costs(report: dict[str, Any]) -> None:
    t, p = report["tokenize"], report["trie"]
    print(f"tokenize+hash {t['prompt_tokens']}-token chat, cold:  {t['cold_ms_p50']:.2f} ms p50, "
          f"{t['cold_ms_min']:.2f} ms min "
          f"(through the service: {t['cold_service_ms_p50']:.2f} ms)   target <= 5 ms")
    print(f"next turn of the same conversation:    {t['next_turn_ms_p50']:.3f} ms p50, "
          f"{t['next_turn_ms_min']:.3f} ms min "
          f"(through the service: {t['next_turn_service_ms_p50']:.3f} ms)   target <= 0.5 ms")
    print(f"trie lookup, {p['prompt_blocks']} blocks x {p['workers']} workers ({p['trie_nodes']} nodes): "
          f"{p['lookup_us_p50']:.1f} us p50, {p['lookup_us_p99']:.1f} us p99   target <= 100 us")
    print(f"prefix choose() incl. insert: {p['choose_us_p50']:.1f} us; insert 500 new blocks "
          f"{p['insert_new_500_us_p50']:.0f} us, 500 known {p['insert_known_500_us_p50']:.0f} us")
    print(f"memory per trie node: {p['bytes_per_node']:.0f} bytes")


def _print_fleet(f: dict[str, Any]) -> None:
    print(f"fleet: {f['replicas']} sim replicas (speedup {f['speedup']:g}, {f['gpu_blocks_per_replica']} blocks "
          f"each), {f['groups']} system prompts, {f['requests']} requests at concurrency {f['concurrency']}; "
          f"prefix knobs: request cost {f['request_cost_tokens']:g} tokens, prefill weight {f['prefill_weight']:g}")
    for r in f["results"]:
        print(f"  {r['strategy']:<12} hit rate {r['fleet_hit_rate']:.3f}  TTFT p50 {r['ttft_ms_p50']:.1f} ms  "
              f"p90 {r['ttft_ms_p90']:.1f} ms  per replica {r['requests_per_replica']}")


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-prefix-bench-") as tmp:
        model_dir = Path(tmp)
        write_model(model_dir)
        if not args.skip_costs:
            report["tokenize"] = asyncio.run(measure_tokenize(model_dir, args.repeat))
            report["trie"] = measure_trie()
            _print_costs(report)
        if not args.skip_fleet:
            report["fleet"] = asyncio.run(measure_fleet(model_dir, args))
            _print_fleet(report["fleet"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
