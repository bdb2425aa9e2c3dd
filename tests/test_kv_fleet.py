"""The `kv` strategy on a simulated vLLM fleet (real `kvgate sim` processes publishing real KV events)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.kv_index import GPU
from tests.conftest import RunningGateway, eventually, running_gateway
from tests.test_prefix_fleet import prefix_cache_counters, send, words

SMALL_CACHE = ["--block-size", "16", "--num-gpu-blocks-override", "48", "--max-model-len", "640"]


async def replica_hashes(http: aiohttp.ClientSession, url: str) -> set[int]:
    async with http.get(url + "/sim/blocks") as resp:
        return {h for h, _ in (await resp.json())["hashes"]}


async def wait_until_index_matches(http: aiohttp.ClientSession, gw: RunningGateway, urls: list[str]) -> None:
    """The gateway's picture of every replica equals the replica's real block set (events are asynchronous)."""
    hub = gw.gateway.kv_events
    assert hub is not None
    truth: dict[str, set[int]] = {}

    async def refresh() -> None:
        for url in urls:
            truth[url] = await replica_hashes(http, url)

    for _ in range(100):
        await refresh()
        if all(hub.engine_hashes(u, GPU) == truth[u] for u in urls):
            return
        await asyncio.sleep(0.05)
    for url in urls:
        mine = hub.engine_hashes(url, GPU)
        assert mine == truth[url], (url, len(mine), len(truth[url]), len(mine ^ truth[url]))


def chat(rng: random.Random, system: str, user_words: int = 8) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": words(rng, user_words)}]}


async def test_index_follows_evictions_and_equals_replica_block_sets(
    sim_fleet: Callable[..., Any], tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    fleet = sim_fleet(2, speedup=100, extra_args=SMALL_CACHE)
    rng = random.Random(5)
    systems = [words(random.Random(100 + g), 120) for g in range(8)]
    async with running_gateway(fleet.worker_specs, strategy="kv", model_dir=[str(tiny_model_dir)],
                               block_size=16) as gw:
        await eventually(lambda: all(gw.gateway.kv_events.trusted(u) for u in fleet.urls))  # type: ignore[union-attr]
        for _ in range(10):
            await asyncio.gather(*(send(http, gw.url, chat(rng, rng.choice(systems))) for _ in range(4)))
        await wait_until_index_matches(http, gw, fleet.urls)
        applied = gw.gateway.metrics.registry.get_sample_value(
            "kvgate_kv_events_applied_total", {"worker": fleet.urls[0], "type": "BlockRemoved"})
        assert applied and applied > 0  # the small cache evicted, and the map followed
        entries = gw.gateway.kv_events.index.entries()  # type: ignore[union-attr]
        assert 0 < entries <= 2 * 48
        # a replica that restarts comes back empty, and the map says so
        fleet.replicas[0].kill()
        fleet.replicas[0].start()
        await send(http, gw.url, chat(rng, systems[0]))
        await wait_until_index_matches(http, gw, fleet.urls)
        assert not gw.gateway.metrics.registry.get_sample_value(
            "kvgate_kv_event_decode_errors_total", {"worker": fleet.urls[0], "reason": "payload"})


async def test_gateway_restart_recovers_the_map_from_replay(
    sim_fleet: Callable[..., Any], tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    fleet = sim_fleet(2, speedup=100, extra_args=SMALL_CACHE)
    rng = random.Random(8)
    systems = [words(random.Random(200 + g), 100) for g in range(3)]
    for url in fleet.urls:  # traffic before any gateway exists
        for system in systems:
            async with http.post(url + "/v1/chat/completions", json=chat(rng, system)) as resp:
                assert resp.status == 200
    async with running_gateway(fleet.worker_specs, strategy="kv", model_dir=[str(tiny_model_dir)],
                               block_size=16) as gw:
        await wait_until_index_matches(http, gw, fleet.urls)
        hub = gw.gateway.kv_events
        assert hub is not None and all(hub.trusted(u) for u in fleet.urls)
        # the recovered picture routes: a known system prompt goes where its blocks are
        decision_worker = None
        before = {w.url: w.routed for w in gw.gateway.pool.all()}
        await send(http, gw.url, chat(rng, systems[1]))
        for w in gw.gateway.pool.all():
            if w.routed > before[w.url]:
                decision_worker = w.url
        assert decision_worker is not None
        hits = gw.gateway.metrics.registry.get_sample_value("kvgate_routing_decisions_total",
                                                            {"strategy": "kv", "reason": "hit"})
        assert hits == 1


async def fleet_hit_rate(
    http: aiohttp.ClientSession, specs: list[str], urls: list[str], strategy: str, model_dir: Path,
) -> tuple[float, float]:
    """Two gateways behind one (simulated) L4 balancer, each taking every other request: 12 system prompts of
    ~14 blocks with Zipf popularity, 480 requests 4 at a time, over replicas whose caches hold about 3 each.

    Returns the fleet hit rate from the replicas' counters, and how far the first gateway's predicted cached
    tokens overshoot what the engines reported (predicted / actual - 1)."""
    rng = random.Random(1)
    systems = [words(random.Random(300 + g), 100) for g in range(12)]
    weights = [1 / (g + 1) ** 1.1 for g in range(12)]
    for url in urls:
        async with http.post(url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
    before = await prefix_cache_counters(http, urls)
    settings: dict[str, Any] = {"strategy": strategy, "model_dir": [str(model_dir)], "block_size": 16}
    async with running_gateway(specs, **settings) as gw1, running_gateway(specs, **settings) as gw2:
        if strategy == "kv":
            await eventually(lambda: all(g.gateway.kv_events.trusted(u)  # type: ignore[union-attr]
                                         for g in (gw1, gw2) for u in urls))
        bodies = [chat(rng, rng.choices(systems, weights)[0], 4) for _ in range(480)]
        for i in range(0, len(bodies), 4):
            await asyncio.gather(*(send(http, (gw1, gw2)[(i + j) % 2].url, body)
                                   for j, body in enumerate(bodies[i:i + 4])))
        registry = gw1.gateway.metrics.registry
        predicted = registry.get_sample_value("kvgate_usage_predicted_cached_tokens_total", {"strategy": strategy})
        actual = registry.get_sample_value("kvgate_actual_cached_tokens_total", {"strategy": strategy})
    after = await prefix_cache_counters(http, urls)
    hits, queries = after[0] - before[0], after[1] - before[1]
    return hits / queries, (predicted or 0.0) / max(actual or 0.0, 1.0) - 1


@pytest.mark.timeout(300)
async def test_kv_beats_prefix_with_two_gateways_and_small_caches(
    sim_fleet: Callable[..., Any], tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    """Scale-out: two gateways in front of one fleet. Each `prefix` gateway only knows the half of the traffic it
    routed, so the two tries place a prefix group on different replicas and the small caches hold it twice;
    `kv` gateways both see every engine's events and agree without talking to each other."""
    fleet = sim_fleet(3, speedup=10, extra_args=SMALL_CACHE)
    kv, kv_overshoot = await fleet_hit_rate(http, fleet.worker_specs, fleet.urls, "kv", tiny_model_dir)
    prefix, prefix_overshoot = await fleet_hit_rate(http, fleet.worker_specs, fleet.urls, "prefix", tiny_model_dir)
    print(f"fleet hit rate: kv {kv:.3f}, prefix {prefix:.3f}; predicted/actual - 1: kv {kv_overshoot:.2f}, "
          f"prefix {prefix_overshoot:.2f}")
    assert kv > prefix + 0.03, (kv, prefix)
    # the trie believes in blocks the engines evicted (or another gateway's traffic displaced); the index does not
    assert abs(kv_overshoot) < abs(prefix_overshoot), (kv_overshoot, prefix_overshoot)


async def test_worker_removed_and_added_again_starts_clean(
    sim_fleet: Callable[..., Any], tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    fleet = sim_fleet(1, speedup=100, extra_args=SMALL_CACHE)
    (url,), (spec,) = fleet.urls, fleet.worker_specs
    rng = random.Random(4)
    async with running_gateway([spec], strategy="kv", model_dir=[str(tiny_model_dir)], block_size=16) as gw:
        hub = gw.gateway.kv_events
        assert hub is not None
        await send(http, gw.url, chat(rng, words(rng, 80)))
        await wait_until_index_matches(http, gw, [url])
        async with http.delete(gw.url + "/admin/workers", params={"url": url}) as resp:
            assert resp.status == 202
        await eventually(lambda: gw.gateway.pool.get(url) is None)
        assert not hub.watched(url) and hub.index.entries() == 0
        async with http.post(gw.url + "/admin/workers", json={"worker": spec}) as resp:
            assert resp.status == 201
        await eventually(lambda: hub.trusted(url))
        await wait_until_index_matches(http, gw, [url])  # recovered from the replica's replay buffer
        assert hub.index.entries() > 0
