"""The `ttft` strategy: each part of its prediction on its own (the fit, the learned prefill rate, load or
recompute per tier, the queue, the engine's pressure, the spread cost), the choices they add up to on real Worker
objects and a real KV block index, and the gateway telling it each streamed answer's first token."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import aiohttp

from kvcore.kv_events import CPU, DISK, GPU, SHARED
from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.kv_index import InMemoryKvIndex
from router.pool import Worker
from router.routing import RouteRequest
from strategies import STRATEGIES, create_strategy
from strategies.balance import HIT, MISS, SPILL
from strategies.ttft import (
    OWN_FIT_SAMPLES,
    EnginePressure,
    LinearFit,
    LoadCost,
    PrefillQueue,
    PrefillRate,
    SpreadCost,
    TtftAware,
    TtftOptions,
    Work,
)
from tests.abuse_servers import raw_worker
from tests.conftest import eventually, running_gateway
from tests.test_proxy_usage import HEAD, chunked, event, text_event

BS = 16
ROOT = root_key("tiny")
# a fleet whose prefill is 10,000 tokens/s, 10 ms per request besides, no attention cost: easy sums
OPTIONS = TtftOptions(ttft_prefill_tokens_per_s=10_000.0, ttft_overhead_s=0.01, ttft_attention_s=0.0,
                      ttft_decode_cost_s=0.0, ttft_spread_weight=1.0, ttft_tie_share=0.0)


def make(n: int = 3, options: TtftOptions = OPTIONS) -> tuple[TtftAware, list[Worker], InMemoryKvIndex, list[float]]:
    strategy = create_strategy(GatewayConfig(strategy="ttft", block_size=BS), options)
    assert isinstance(strategy, TtftAware)
    clock = [1000.0]
    strategy.balance.clock = lambda: clock[0]
    strategy.balance.random.seed(0)
    index = InMemoryKvIndex()
    strategy.attach_kv(index, lambda cache: True)
    workers = [Worker(spec=WorkerSpec(f"http://127.0.0.1:{9000 + i}"), healthy=True, models=frozenset({"tiny"}))
               for i in range(n)]
    return strategy, workers, index, clock


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def request(ids: list[int]) -> RouteRequest:
    return RouteRequest(model="tiny", path="/v1/completions", token_ids=ids, block_keys=block_keys(ids, BS, ROOT),
                        prompt_tokens=len(ids))


# --- the parts ------------------------------------------------------------------------------------------------


def test_linear_fit_finds_the_line_its_samples_lie_on_from_a_wrong_prior() -> None:
    fit = LinearFit([0.06, 1e-4, 0.0], [1.0, 1000.0, 1000.0], prior_weight=4, half_life=1000)
    rng = random.Random(1)
    for _ in range(400):
        x = (1.0, rng.uniform(0, 20_000), rng.uniform(0, 50_000))
        fit.add(x, 0.02 + 3e-5 * x[1] + 1e-6 * x[2])
    assert abs(fit.weights[0] - 0.02) < 0.005
    assert abs(fit.weights[1] - 3e-5) / 3e-5 < 0.05
    assert abs(fit.weights[2] - 1e-6) / 1e-6 < 0.1


def test_linear_fit_keeps_weights_non_negative_and_forgets_old_samples() -> None:
    fit = LinearFit([0.0, 1e-4], [1.0, 1000.0], prior_weight=2, half_life=1000)
    for x in range(1, 200):  # a line with a negative intercept: the intercept is held at 0
        fit.add((1.0, float(x)), -1.0 + 0.01 * x)
    assert fit.weights[0] == 0.0 and fit.weights[1] > 0
    fit = LinearFit([0.0, 1e-4], [1.0, 200.0], prior_weight=2, half_life=20)
    rng = random.Random(3)
    for _ in range(200):
        x = rng.uniform(1, 400)
        fit.add((1.0, x), 0.004 * x)
    for _ in range(200):  # the worker became twice as fast: recent samples win
        x = rng.uniform(1, 400)
        fit.add((1.0, x), 0.002 * x)
    assert abs(fit.weights[1] - 0.002) / 0.002 < 0.1  # from 0.004: the prior holds it back a little


def test_prefill_rate_is_learned_from_first_tokens() -> None:
    rate = PrefillRate(OPTIONS)  # believes 10,000 tokens/s; the worker does 40,000
    assert abs(rate.seconds(Work.of(10_000, 0)) - 1.0) < 1e-9
    rng = random.Random(2)
    for _ in range(200):
        work = Work.of(rng.randrange(100, 20_000), 0)
        rate.learn(work, 0.005 + work.tokens / 40_000)
    for n in (1000, 10_000, 20_000):  # within a few percent where the answers were
        predicted = rate.overhead_s + rate.seconds(Work.of(n, 0))
        assert abs(predicted - (0.005 + n / 40_000)) / (0.005 + n / 40_000) < 0.05
    rate.learn(Work.of(100, 0), float("nan"))  # nonsense is ignored
    rate.learn(Work.of(100, 0), -1.0)
    assert abs(rate.overhead_s + rate.seconds(Work.of(10_000, 0)) - 0.255) < 0.01


def test_a_long_lower_tier_run_is_loaded_and_a_short_slow_one_recomputed() -> None:
    options = TtftOptions(ttft_prefill_tokens_per_s=10_000.0, ttft_attention_s=0.0, ttft_kv_bytes_per_token=1e5,
                          ttft_disk_gbps=1.0, ttft_disk_latency_s=1e-3, ttft_shared_latency_s=0.05)
    load, rate = LoadCost(options), PrefillRate(options)
    # 4,096 NVMe tokens: 1 ms + 0.41 s to read, 0.41 s to recompute... at 1 GB/s it is a tie; at 5 GB/s a read
    assert load.load_seconds(DISK, 4096) > rate.seconds(Work.of(4096, 0))
    seconds, recompute = load.plan({GPU: 1024, DISK: 4096}, rate)
    assert recompute == 4096 and seconds == 0.0
    fast = LoadCost(TtftOptions(ttft_kv_bytes_per_token=1e5, ttft_disk_gbps=5.0, ttft_shared_latency_s=0.05))
    seconds, recompute = fast.plan({GPU: 1024, DISK: 4096}, rate)
    assert recompute == 0 and abs(seconds - fast.load_seconds(DISK, 4096)) < 1e-12
    # a 32-token shared run costs 50 ms to fetch and 3.2 ms to recompute; what follows a recomputed run is too
    seconds, recompute = fast.plan({GPU: 1024, SHARED: 32}, rate)
    assert (seconds, recompute) == (0.0, 32)
    seconds, recompute = LoadCost(TtftOptions(ttft_kv_bytes_per_token=1e5, ttft_cpu_latency_s=1.0)).plan(
        {CPU: 32, DISK: 4096}, rate)
    assert (seconds, recompute) == (0.0, 32 + 4096)


def test_the_queue_is_what_has_not_had_its_first_token_and_its_head_drains() -> None:
    rate, queue = PrefillRate(OPTIONS), PrefillQueue()
    queue.add(1, Work.of(1000, 0), now=0.0, expected_s=1.0)
    queue.add(2, Work.of(500, 0), now=0.0, expected_s=1.0)
    assert queue.ahead(0.0, rate).tokens == 1500
    assert abs(queue.ahead(0.05, rate).tokens - 1000) < 1e-6  # half of the head's 0.1 s done
    assert abs(queue.ahead(0.5, rate).tokens - 500) < 1e-6    # the head is done at most: it waits for its report
    queue.done(1, now=0.5)
    assert queue.ahead(0.5, rate).tokens == 500 and queue.count(0.5) == 1
    assert queue.ahead(3.5, rate).tokens == 0  # never reported (a whole answer): gone after 2 x 1 s + 1 s
    assert queue.count(3.5) == 0


def test_engine_pressure_counts_decodes_foreign_waiting_and_a_full_cache() -> None:
    pressure = EnginePressure(TtftOptions(ttft_decode_cost_s=0.001, ttft_kv_high=0.9, ttft_kv_full_penalty_s=0.5))
    worker = Worker(spec=WorkerSpec("http://w"), in_flight=5, running=4.0, waiting=3.0, kv_usage=0.5)
    assert abs(pressure.seconds(worker, ours_waiting=2) - 0.003) < 1e-12  # 3 of the 5 have their first token
    assert pressure.foreign(worker, 2, Work(100.0, 0.0)).tokens == 100.0  # one waiting there is not ours
    worker.kv_usage = 0.95
    assert abs(pressure.seconds(worker, ours_waiting=2) - (0.003 + 0.25)) < 1e-12


def test_a_copy_of_a_prefix_held_elsewhere_costs_its_prefill() -> None:
    spread, rate = SpreadCost(OPTIONS), PrefillRate(OPTIONS)
    assert spread.seconds(held_here=1024, held_most=1024, rate=rate) == 0.0
    assert abs(spread.seconds(held_here=0, held_most=1000, rate=rate) - 0.1) < 1e-12


# --- the strategy ---------------------------------------------------------------------------------------------


def test_registered_with_its_options() -> None:
    assert STRATEGIES["ttft"] == "strategies.ttft:TtftAware"
    assert TtftAware.needs_prompt_tokens and TtftAware.uses_kv_events
    strategy = create_strategy(GatewayConfig(strategy="ttft"), ttft_prefill_tokens_per_s=5000.0)
    assert isinstance(strategy, TtftAware) and strategy.options.ttft_prefill_tokens_per_s == 5000.0


def test_goes_where_the_prefix_is_and_predicts_the_time() -> None:
    strategy, workers, index, _ = make()
    system = tokens(1, 4096)
    prompt = system + tokens(2, 64)
    index.add(workers[1].url, block_keys(system, BS, ROOT), GPU)
    decision = strategy.choose(request(prompt), workers)
    assert decision.worker is workers[1] and decision.reason == HIT and decision.predicted_cached_tokens == 4096
    # 10 ms + 64 uncached tokens at 10,000 tokens/s
    assert decision.predicted_ttft_s is not None and abs(decision.predicted_ttft_s - 0.0164) < 1e-9


def test_a_prefix_on_nvme_beats_a_miss_by_its_transfer_time() -> None:
    strategy, workers, index, _ = make()
    system = tokens(1, 8192)
    index.add(workers[2].url, block_keys(system, BS, ROOT), DISK)
    decision = strategy.choose(request(system + tokens(2, 64)), workers)
    assert decision.worker is workers[2]
    load = strategy.load.load_seconds(DISK, 8192)  # 8,192 x 128 KiB at 5 GB/s: 0.21 s, against 0.82 s
    assert decision.predicted_ttft_s is not None and abs(decision.predicted_ttft_s - (0.01 + load + 0.0064)) < 1e-9


def test_a_hot_prefix_spills_only_when_the_queue_outweighs_its_saving_and_the_copy() -> None:
    strategy, workers, index, _ = make()
    system = tokens(1, 2048)
    index.add(workers[0].url, block_keys(system, BS, ROOT), GPU)
    burst = [request(system + tokens(100 + i, 400)) for i in range(40)]  # none has its first token yet
    placed = [strategy.choose(req, workers) for req in burst]
    first_spill = next(i for i, d in enumerate(placed) if d.worker is not workers[0])
    # worker 0: 10 ms + 40 ms of prefill + 40 ms per request queued; elsewhere 10 ms + 0.2448 s of prefill +
    # 0.2048 s for the copy of the 2,048 prefix tokens: request 11 (the 12th) is the first to go elsewhere
    assert placed[first_spill].reason == SPILL
    assert first_spill == 11
    assert all(d.worker is workers[0] for d in placed[:first_spill])


def test_misses_spread_and_the_learned_rate_follows_first_tokens() -> None:
    strategy, workers, _, clock = make(options=dataclasses.replace(OPTIONS, ttft_tie_share=0.1))
    own = strategy.own_rate(workers[0].url)  # a hair faster, by its own fit: not a reason to take every miss
    own.fit.samples = OWN_FIT_SAMPLES
    own.fit.weights[1] *= 0.95
    chosen = []
    for i in range(3):  # one after another, each long done before the next: the fleet is idle for each
        chosen.append(strategy.choose(request(tokens(10 + i, 1000)), workers))
        clock[0] += 10.0
    assert {d.worker.url for d in chosen} == {w.url for w in workers} and all(d.reason == MISS for d in chosen)
    # the workers are four times faster than believed: the prediction for the same request follows
    before = chosen[0].predicted_ttft_s
    kept = []  # the gateway keeps each request until its end: so does the test
    for i in range(100):
        req = request(tokens(1000 + i, 1000))
        kept.append(req)
        decision = strategy.choose(req, workers)
        clock[0] += 1.0
        strategy.on_first_token(req, decision, 0.01 + 1000 / 40_000)
    again = strategy.choose(request(tokens(5000, 1000)), workers)
    assert before is not None and again.predicted_ttft_s is not None
    # (every answer the same size: the prior still has a say in how it splits into overhead and rate)
    assert before > 0.1 and abs(again.predicted_ttft_s - 0.035) < 0.3 * 0.035


def test_a_worker_without_answers_of_its_own_is_judged_by_the_fleets_fit() -> None:
    """Worker 1 answers four times faster than the prior says; worker 0 never answered. Judged by its prior, worker
    0 would never be chosen (and never learn); judged by the fleet's fit, it takes misses as soon as worker 1 is
    busier."""
    strategy, workers, _, clock = make(2)
    kept = []
    for i in range(OWN_FIT_SAMPLES + 5):
        req = request(tokens(2000 + i, 1000))
        kept.append(req)
        decision = strategy.choose(req, workers[1:])
        clock[0] += 1.0
        strategy.on_first_token(req, decision, 0.01 + 1000 / 40_000)
    assert strategy.own_rate(workers[0].url).fit.samples == 0
    assert strategy.rate(workers[0].url) is strategy.fleet_rate
    assert strategy.rate(workers[1].url) is strategy.own_rate(workers[1].url)
    busy = request(tokens(3000, 1000))
    strategy.choose(busy, workers[1:])  # worker 1 now has a prefill queued
    decision = strategy.choose(request(tokens(3001, 1000)), workers)
    assert decision.worker is workers[0]
    assert decision.predicted_ttft_s is not None and abs(decision.predicted_ttft_s - 0.035) < 0.35 * 0.035


async def test_the_gateway_reports_each_streamed_first_token(http: aiohttp.ClientSession) -> None:
    """A worker that takes 0.2 s to its first chunk: the strategy hears of every streamed answer's first token,
    learns from it, and its prediction error is exported."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(chunked(text_event(" a")) + chunked(event("[DONE]")) + b"0\r\n\r\n")

    async with raw_worker(answer) as url, running_gateway([url], strategy="ttft") as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        strategy: Any = gw.gateway.strategy
        for _ in range(3):
            body = {"model": "tiny", "prompt": "hello there", "stream": True}
            async with http.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        assert strategy.own_rate(url).fit.samples == strategy.fleet_rate.fit.samples == 3
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_ttft_prediction_error_ratio_count") == 3
        assert not strategy._routed and strategy.queue(url).count(strategy.now) == 0
