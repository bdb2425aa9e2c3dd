"""`prefix` against `round_robin` on a simulated vLLM fleet (real `kvgate sim` processes): fleet hit rate from the
replicas' own /metrics, and a hot prefix spilling to more replicas under load."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen import scrape
from tests.conftest import running_gateway

CHAT = "/v1/chat/completions"
WORDS = Path(random.__file__).read_text().split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def prefix_cache_counters(http: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over the fleet, from each replica's vLLM metrics."""
    counters = await scrape(http, urls)
    return sum(c["hit_tokens"] for c in counters), sum(c["query_tokens"] for c in counters)


async def send(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> None:
    async with http.post(url + CHAT, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def fleet_hit_rate(
    http: aiohttp.ClientSession, fleet_urls: list[str], strategy: str, model_dir: Path, seed: int,
) -> float:
    """12 system prompts (groups) of ~40 blocks, 96 requests in random group order, 4 at a time; the replicas
    hold ~6 groups each, so spreading every group over every replica makes their caches thrash."""
    rng = random.Random(seed)
    systems = [words(random.Random(g), 260) for g in range(12)]
    for url in fleet_urls:
        async with http.post(url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
    before = await prefix_cache_counters(http, fleet_urls)
    async with running_gateway(fleet_urls, strategy=strategy, model_dir=[str(model_dir)], block_size=16) as gw:
        bodies = [{"model": "tiny", "max_tokens": 2,
                   "messages": [{"role": "system", "content": rng.choice(systems)},
                                {"role": "user", "content": words(rng, 12)}]} for _ in range(96)]
        for i in range(0, len(bodies), 4):
            await asyncio.gather(*(send(http, gw.url, b) for b in bodies[i:i + 4]))
    after = await prefix_cache_counters(http, fleet_urls)
    hits, queries = after[0] - before[0], after[1] - before[1]
    assert queries > 96 * 500
    return hits / queries


async def test_shared_system_prompts_hit_far_more_with_prefix_than_round_robin(
    sim_fleet: Callable[..., Any], tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    fleet = sim_fleet(3, speedup=200, extra_args=["--block-size", "16", "--num-gpu-blocks-override", "256"])
    round_robin = await fleet_hit_rate(http, fleet.urls, "round_robin", tiny_model_dir, seed=1)
    prefix = await fleet_hit_rate(http, fleet.urls, "prefix", tiny_model_dir, seed=1)
    print(f"fleet hit rate: prefix {prefix:.3f}, round_robin {round_robin:.3f}")
    assert prefix > 0.7, (prefix, round_robin)
    assert prefix > round_robin + 0.25, (prefix, round_robin)


async def test_hot_prefix_spills_to_more_replicas_under_heavy_load(
    sim_fleet: Callable[..., Any], tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    fleet = sim_fleet(3, speedup=2, extra_args=["--block-size", "16"])
    rng = random.Random(3)
    system = words(rng, 400)

    def body() -> dict[str, Any]:
        return {"model": "tiny", "max_tokens": 16, "ignore_eos": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": words(rng, 10)}]}

    async with running_gateway(fleet.urls, strategy="prefix", model_dir=[str(tiny_model_dir)],
                               block_size=16) as gw:
        for _ in range(6):  # light load: one at a time, all on the replica that holds the prefix
            await send(http, gw.url, body())
        light = {w.url: w.routed for w in gw.gateway.pool.all()}
        assert sorted(light.values()) == [0, 0, 6], light
        await asyncio.gather(*(send(http, gw.url, body()) for _ in range(60)))  # heavy: 60 at once
        heavy = {w.url: w.routed - light[w.url] for w in gw.gateway.pool.all()}
        print("hot prefix under load:", sorted(heavy.values()))
        assert sum(heavy.values()) == 60
        assert sum(1 for n in heavy.values() if n >= 5) >= 2, heavy
        assert max(heavy.values()) < 60, heavy
