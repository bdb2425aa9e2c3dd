"""The `kv` strategy on a simulated vLLM fleet (real `kvgate sim` processes publishing real KV events)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.procs import free_port
from kvcore.kv_events import GPU
from tests.conftest import RunningGateway, eventually, running_gateway
from tests.test_kv_recovery import CuttableProxy
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
    seeds: Sequence[int] = (1, 2),
) -> tuple[float, float]:
    """Two gateways behind one (simulated) L4 balancer, each taking every other request: 24 system prompts of
    ~7 blocks with Zipf popularity (s = 0.8), 480 requests 4 at a time, over replicas whose caches hold about 6
    each (the fleet about 20 of the 24). One such run per seed, each with fresh gateways and empty caches.

    Returns the fleet hit rate from the replicas' counters, and how far the first gateway's predicted cached
    tokens overshoot what the engines reported (predicted / actual - 1), both over all the runs.

    Many groups with a flat tail, and more than one run: where two `prefix` gateways place a group is a matter of
    luck that then sticks for the run. With 12 groups and s = 1.1 the few hottest decided the result, and `prefix`'s
    hit rate swung by 0.10 from run to run (kv - prefix measured -0.01 to 0.16; a fresh-clone CI run failed the
    margin with 0.660 against 0.654)."""
    systems = [words(random.Random(300 + g), 50) for g in range(24)]
    weights = [1 / (g + 1) ** 0.8 for g in range(24)]
    settings: dict[str, Any] = {"strategy": strategy, "model_dir": [str(model_dir)], "block_size": 16}
    hits = queries = predicted = actual = 0.0
    for seed in seeds:
        rng = random.Random(seed)
        for url in urls:
            async with http.post(url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
        before = await prefix_cache_counters(http, urls)
        async with running_gateway(specs, **settings) as gw1, running_gateway(specs, **settings) as gw2:
            if strategy == "kv":
                await eventually(lambda: all(g.gateway.kv_events.trusted(u)  # type: ignore[union-attr]
                                             for g in (gw1, gw2) for u in urls))
            bodies = [chat(rng, rng.choices(systems, weights)[0], 4) for _ in range(480)]
            for i in range(0, len(bodies), 4):
                await asyncio.gather(*(send(http, (gw1, gw2)[(i + j) % 2].url, body)
                                       for j, body in enumerate(bodies[i:i + 4])))
            registry = gw1.gateway.metrics.registry
            labels = {"strategy": strategy}
            predicted += registry.get_sample_value("kvgate_usage_predicted_cached_tokens_total", labels) or 0.0
            actual += registry.get_sample_value("kvgate_actual_cached_tokens_total", labels) or 0.0
        after = await prefix_cache_counters(http, urls)
        hits, queries = hits + after[0] - before[0], queries + after[1] - before[1]
    return hits / queries, predicted / max(actual, 1.0) - 1


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


@pytest.mark.timeout(300)
async def test_after_a_forced_gap_the_hot_prefix_is_routed_and_predicted_right_again(
    sim_fleet: Callable[..., Any], tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    """Issue 12 item 2: after a gap the replay cannot cover, the gateway forgot what the replica holds, and vLLM
    never announces a cached block again: once trusted again, the index could not see the replica's hottest
    prefix. The answers routed meanwhile teach it, so within a few requests the prefix is predicted as cached
    where it is, as the engine reports."""
    fleet = sim_fleet(2, speedup=100, extra_args=["--block-size", "16", "--num-gpu-blocks-override", "256"])
    proxies = [CuttableProxy(int(e.rsplit(":", 1)[1])) for e in fleet.events_endpoints]
    for proxy in proxies:
        await proxy.start()
    dead = f"tcp://127.0.0.1:{free_port()}"  # no replay: a gap is never repaired
    specs = [f"{url};events=tcp://127.0.0.1:{proxy.port};replay={dead}"
             for url, proxy in zip(fleet.urls, proxies, strict=True)]
    rng = random.Random(12)
    hot = words(random.Random(77), 260)  # about 20 blocks
    try:
        async with running_gateway(specs, strategy="kv", model_dir=[str(tiny_model_dir)], block_size=16,
                                   kv_resync_s=1.0, kv_replay_timeout_s=0.2) as gw:
            hub = gw.gateway.kv_events
            assert hub is not None
            pool = gw.gateway.pool

            async def ask() -> str:
                before = {w.url: w.routed for w in pool.all()}
                await send(http, gw.url, chat(rng, hot))
                (chosen,) = [w.url for w in pool.all() if w.routed > before[w.url]]
                return chosen

            while not all(hub.trusted(u) for u in fleet.urls):  # the first events make each stream known
                await send(http, gw.url, chat(rng, words(rng, 40)))
            home = await ask()
            assert await ask() == home
            for proxy in proxies:  # the subscriptions go away; what the replicas publish meanwhile is lost
                await proxy.down()
            await send(http, fleet.urls[0], chat(rng, words(rng, 40)))
            await send(http, fleet.urls[1], chat(rng, words(rng, 40)))
            for proxy in proxies:
                await proxy.start()
            assert await ask() == home  # the gap not seen yet: the trie keeps the prefix where it was
            # the gap shows at home's next event once its subscription is back (ZMQ reconnects within its 0.1-2 s
            # backoff), and a replica publishes only what it computes: a hot prompt adds no full block, so home
            # computes new prompts, sent to it directly, until the gateway has seen the gap (asking through the
            # gateway meanwhile, as this test once did, sends the hot prefix there 20 times in a row on a fast
            # machine, and the balance rightly spreads it before the subscription is back)
            deadline = time.monotonic() + 30
            while not gw.gateway.metrics.registry.get_sample_value("kvgate_kv_state_resets_total",
                                                                   {"worker": home, "reason": "gap"}):
                assert time.monotonic() < deadline, "the gateway never saw the events it missed"
                await send(http, home, chat(rng, words(rng, 40)))
                await asyncio.sleep(0.1)
            assert not hub.trusted(home)
            assert await ask() == home  # an answer while the picture is incomplete: it teaches the index
            await eventually(lambda: hub.trusted(home), timeout=10)
            registry = gw.gateway.metrics.registry

            def tokens(kind: str) -> float:
                return registry.get_sample_value(f"kvgate_worker_{kind}_cached_tokens_total", {"worker": home}) or 0

            predicted, reported = tokens("predicted"), tokens("reported")
            for _ in range(3):
                assert await ask() == home
            predicted, reported = tokens("predicted") - predicted, tokens("reported") - reported
            assert reported >= 3 * 16 * 16  # the hot prefix, cached
            assert abs(predicted - reported) <= 0.05 * reported, (predicted, reported)
            assert hub.applier.learned(home) > 0
    finally:
        for proxy in proxies:
            await proxy.close()


async def test_tenants_and_model_aliases_are_predicted_where_the_engines_cache_them(
    sim_fleet: Callable[..., Any], tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    """Issue 12 item 6: `--tenant-header` put the tenant into the gateway's keys but nothing sent it to the
    engines as `cache_salt`, so `kv` missed every such request; and of `--served-model-name a b`, only the first
    name ever hit. Now the engines get the tenant's salt, every alias is keyed as the engines name the blocks,
    and what the gateway predicts is what the engines report."""
    fleet = sim_fleet(2, speedup=100, extra_args=["--block-size", "16", "--served-model-name", "tiny", "tiny-b"])
    rng = random.Random(3)
    system = words(random.Random(99), 200)
    async with running_gateway(fleet.worker_specs, strategy="kv", model_dir=[str(tiny_model_dir)], block_size=16,
                               tenant_header="X-Tenant") as gw:
        hub = gw.gateway.kv_events
        assert hub is not None
        registry = gw.gateway.metrics.registry

        def tokens(kind: str) -> float:
            return sum(registry.get_sample_value(f"kvgate_worker_{kind}_cached_tokens_total", {"worker": u}) or 0
                       for u in fleet.urls)

        async def three(model: str, headers: dict[str, str]) -> tuple[float, float]:
            await send(http, gw.url, {**chat(rng, system), "model": model}, headers)  # cold: computes the prefix
            await asyncio.sleep(0.3)  # its events arrive
            predicted, reported = tokens("predicted"), tokens("reported")
            for _ in range(2):
                await send(http, gw.url, {**chat(rng, system), "model": model}, headers)
            return tokens("predicted") - predicted, tokens("reported") - reported

        while not all(hub.trusted(u) for u in fleet.urls):
            await send(http, gw.url, chat(rng, words(rng, 30)))
        for model, headers in (("tiny", {"X-Tenant": "acme"}), ("tiny-b", {}), ("tiny-b", {"X-Tenant": "acme"})):
            predicted, reported = await three(model, headers)
            assert reported >= 2 * 10 * 16, (model, headers, reported)  # the engines cached the prefix...
            assert predicted == reported, (model, headers, predicted, reported)  # ...where the gateway said
        # another tenant's first request of the same prompt finds nothing: its namespace is its own, at the engine
        before = tokens("reported")
        await send(http, gw.url, chat(rng, system), {"X-Tenant": "zeta"})
        assert tokens("reported") == before
