"""The `ttft` strategy: each part of its prediction on its own (the fit, the learned prefill rate, load or
recompute per tier, the queue, the engine's pressure, the spread cost), the choices they add up to on real Worker
objects and a real KV block index, and the gateway telling it each streamed answer's first token."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
from typing import Any

import aiohttp
import orjson

from bench.sim.perf_model import load_profile
from kvcore.kv_events import CPU, DISK, GPU, SHARED
from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.kv_index import InMemoryKvIndex
from router.kv_transport import cache_name
from router.pool import Worker
from router.prom_text import sum_samples
from router.routing import Decision, RouteRequest
from strategies import STRATEGIES, create_strategy
from strategies.balance import HIT, MISS, SPILL
from strategies.ttft import (
    OWN_FIT_SAMPLES,
    BusyCost,
    EnginePressure,
    EngineTimings,
    HeldUpCost,
    LinearFit,
    LoadCost,
    PrefillQueue,
    PrefillRate,
    RequestShare,
    SpreadCost,
    StepClock,
    TtftAware,
    TtftOptions,
    Work,
)
from tests.abuse_servers import raw_worker
from tests.conftest import eventually, running_gateway
from tests.test_proxy_usage import HEAD, chunked, event, text_event

BS = 16
ROOT = root_key("tiny")
# a fleet whose prefill is 10,000 tokens/s, 10 ms per request besides, no attention cost: easy sums (the balance
# cap off: each part on its own; the balance's tests turn it on)
OPTIONS = TtftOptions(ttft_prefill_tokens_per_s=10_000.0, ttft_overhead_s=0.01, ttft_attention_s=0.0,
                      ttft_decode_cost_s=0.0, ttft_spread_weight=1.0, ttft_tie_share=0.0, ttft_balance_slack=-1.0)
# the balance's price: 1,200 tokens of prefill, 0.12 s on this fleet until it learns otherwise
BALANCED = dataclasses.replace(OPTIONS, ttft_balance_slack=0.2, ttft_balance_tokens=1200.0, ttft_balance_window=300.0)


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
        u = rng.uniform(1, 400)
        fit.add((1.0, u), 0.004 * u)
    for _ in range(200):  # the worker became twice as fast: recent samples win
        u = rng.uniform(1, 400)
        fit.add((1.0, u), 0.002 * u)
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


def test_a_slow_run_is_loaded_where_recomputing_it_would_hold_up_the_workers_hits() -> None:
    """The same 4,096 NVMe tokens as above, 1 ms + 0.4096 s to read at 1 GB/s and 0.4096 s to recompute: alone the
    recompute is cheaper, but it takes the GPU, and priced for the hits that wait for it (here 10% of its time)
    the read is."""
    options = TtftOptions(ttft_prefill_tokens_per_s=10_000.0, ttft_attention_s=0.0, ttft_kv_bytes_per_token=1e5,
                          ttft_disk_gbps=1.0, ttft_disk_latency_s=1e-3)
    load, rate = LoadCost(options), PrefillRate(options)
    assert load.plan({GPU: 1024, DISK: 4096}, rate) == (0.0, 4096)
    seconds, recompute = load.plan({GPU: 1024, DISK: 4096}, rate, lambda busy: 0.1 * busy)
    assert recompute == 0 and seconds == load.load_seconds(DISK, 4096) == 1e-3 + 0.4096


def test_busy_cost_is_what_a_prefill_holds_up_of_the_hits_that_come_for_the_worker() -> None:
    busy = BusyCost(weight=2.0, half_life_s=10.0)
    assert busy.hit_rate("a", 100.0) == 0.0
    for _ in range(10):
        busy.hit("a", 100.0)
    # 10 hits, each 10 s old counting half: as a rate, 10 x ln 2 / 10 per second; half that 10 s later
    assert abs(busy.hit_rate("a", 100.0) - math.log(2)) < 1e-12
    assert abs(busy.hit_rate("a", 110.0) - math.log(2) / 2) < 1e-12
    busy.hit("a", 110.0)  # the count decays to 5 before this one is added
    assert abs(busy.hit_rate("a", 110.0) - 6 * math.log(2) / 10) < 1e-12
    # 2 s of prefill behind 0.5 s queued, 0.3 hits a second: each arriving before waits 2 s, during it 1 s
    assert abs(busy.seconds(0.3, 0.5, 2.0) - 2.0 * 0.3 * 2.0 * (0.5 + 1.0)) < 1e-12
    assert busy.hit_rate("b", 110.0) == 0.0 and busy.seconds(0.0, 0.5, 2.0) == 0.0
    busy.forget("a")
    assert busy.hit_rate("a", 110.0) == 0.0


def test_held_up_cost_is_the_step_a_prefill_adds_against_each_waiting_requests_own_time() -> None:
    rate = PrefillRate(OPTIONS)  # 10,000 tokens/s
    held = HeldUpCost(weight=1.0, step_tokens=1024.0, floor_s=0.002)
    # a 2,112-token prefill adds at most one step's 1,024 tokens (0.1024 s) to the step a waiting request ends in;
    # a 16.4 ms hit and a 221.2 ms first read waiting there, against this request's best of 227.6 ms
    cost = held.seconds([0.0164, 0.2212], Work.of(2112, 0), rate, 0.2276)
    assert abs(cost - 0.1024 * (0.2276 / 0.0164 + 0.2276 / 0.2212)) < 1e-12
    # a 64-token prefill adds its own 6.4 ms; a waiting time under the floor counts as the floor
    assert abs(held.seconds([0.0005], Work.of(64, 2048), rate, 0.0164) - 0.0064 * 0.0164 / 0.002) < 1e-12
    assert held.seconds([], Work.of(2112, 0), rate, 0.2276) == 0.0
    assert HeldUpCost(0.0, 1024.0, 0.002).seconds([0.0164], Work.of(2112, 0), rate, 0.2276) == 0.0


def test_the_queue_tells_each_waiting_requests_expected_time_less_its_loads() -> None:
    queue = PrefillQueue()
    queue.add(1, Work.of(64, 2048), now=0.0, expected_s=0.0464, reported=True, load_s=0.03)
    queue.add(2, Work.of(2112, 0), now=0.0, expected_s=0.2212, reported=True)
    assert [round(x, 12) for x in queue.expected(0.0)] == [0.0164, 0.2212]
    queue.done(1, now=0.01)
    assert queue.expected(0.01) == [0.2212]


def test_a_first_read_doubles_up_with_another_rather_than_hold_up_a_waiting_hit() -> None:
    """vsim, the README's tenants fleet with agents (--tiers-sped-up), seed 3, request 12: a tenant's first read
    (2,112 tokens) came while every worker computed another tenant's first read but one, where a hit of 64 tokens
    waited for its shared-tier load. Sent there, it took the hit's next step (the hit: 70.3 ms instead of about
    15); doubled up with a first read, it makes that one about twice as slow, a hit five times. In seconds the two
    are alike, so without `HeldUpCost` the read goes to the hit's worker (0.2276 s against 0.4324); counted
    against each waiting request's own time, elsewhere: 0.2276 + 0.2112 x 0.2276 / 0.0164 = 3.159 s on worker 0,
    0.4324 + 0.2112 x 0.2276 / 0.2212 = 0.6497 s on worker 1."""
    for weight, goes_to in ((0.0, 0), (1.0, 1)):
        strategy, workers, _, clock = make(2, dataclasses.replace(OPTIONS, ttft_held_up_weight=weight))
        strategy.queue(workers[0].url).add(1, Work.of(64, 2048), clock[0], 0.0464, reported=True, load_s=0.03)
        strategy.queue(workers[1].url).add(2, Work.of(2112, 0), clock[0], 0.2212, reported=True)
        read = strategy.choose(request(tokens(7, 2112)), workers)
        assert read.reason == MISS and read.worker is workers[goes_to]
        assert read.predicted_ttft_s is not None
        assert abs(read.predicted_ttft_s - (0.2276 if goes_to == 0 else 0.4324)) < 1e-9


def test_a_request_some_worker_holds_is_not_sent_from_its_hit_for_the_requests_waiting_there() -> None:
    """A request whose 2,048-token prefix worker 0 holds, with 1,000 new tokens, while a 64-token hit waits there
    (16.4 ms expected): it keeps its hit (0.01 + 0.0064 + 0.1 = 0.1164 s against 0.01 + 0.3048 + the copy's 0.2048
    elsewhere). Counted, its 0.1 s of prefill against the hit's own 16.4 ms (0.1 x 0.1164 / 0.0164 = 0.71 s) would
    have sent it away to compute the prefix again: a hit traded against a copy is the spread cost's and the
    balance's to price, and counted there too RAG at 8 replicas had p90 46 ms against 31."""
    strategy, workers, index, clock = make(2, dataclasses.replace(OPTIONS, ttft_held_up_weight=1.0))
    system = tokens(1, 2048)
    index.add(workers[0].url, block_keys(system, BS, ROOT), GPU)
    strategy.queue(workers[0].url).add(1, Work.of(64, 2048), clock[0], 0.0164, reported=True)
    decision = strategy.choose(request(system + tokens(2, 1000)), workers)
    assert decision.worker is workers[0] and decision.reason == HIT
    assert decision.predicted_ttft_s is not None and abs(decision.predicted_ttft_s - 0.1164) < 1e-9


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


def test_a_streamed_request_counts_in_the_queue_however_long_it_waits() -> None:
    """Three 4,000-token requests wait on worker 0 (1.2 s of prefill) and have no first token 5 s later: an
    overloaded engine. Streamed, their first tokens (or ends) will be reported, so they still count, and a request
    whose 1,024-token prefix worker 0 holds goes elsewhere. They stopped counting after twice their predicted time
    to first token and a second, as whole answers do: on the pinned small conversation trace (4 replicas, overloaded,
    TTFT p50 about 5 s) the queue forgot requests still waiting, `ttft` predicted 0.7 s for a median of 5.9 s and
    spilled prefixes (hit rate 0.322 against `kv`'s 0.436). A whole answer's first token is never reported: it still
    stops counting (its prefill is long done while it decodes)."""
    chosen = {}
    for stream in (True, False):
        strategy, workers, index, clock = make(2)
        prefix = tokens(1, 1024)
        index.add(workers[0].url, block_keys(prefix, BS, ROOT), GPU)
        waiting = [dataclasses.replace(request(prefix + tokens(10 + i, 2976)), stream=stream) for i in range(3)]
        for req in waiting:
            assert strategy.choose(req, workers[:1]).worker is workers[0]
        clock[0] += 5.0
        assert strategy.queue(workers[0].url).count(clock[0]) == (3 if stream else 0)
        chosen[stream] = strategy.choose(request(prefix + tokens(2, 64)), workers)
    assert chosen[True].worker.url == workers[1].url and chosen[True].reason == SPILL
    assert chosen[False].worker.url == workers[0].url and chosen[False].reason == HIT


def test_engine_pressure_counts_decodes_foreign_waiting_and_a_full_cache() -> None:
    pressure = EnginePressure(TtftOptions(ttft_decode_cost_s=0.001, ttft_kv_high=0.9, ttft_kv_full_penalty_s=0.5))
    worker = Worker(spec=WorkerSpec("http://w"), in_flight=5, running=4.0, waiting=3.0, kv_usage=0.5)
    assert abs(pressure.seconds(worker, ours_waiting=2) - 0.003) < 1e-12  # 3 of the 5 have their first token
    assert pressure.foreign(worker, 2, Work(100.0, 0.0)).tokens == 100.0  # one waiting there is not ours
    worker.kv_usage = 0.95
    assert abs(pressure.seconds(worker, ours_waiting=2) - (0.003 + 0.25)) < 1e-12


def test_an_engines_waiting_queue_is_set_against_the_gateways_requests_of_the_scrapes_time() -> None:
    """A scrape (up to a metrics interval old) saw three requests waiting on worker 0, two of them the gateway's;
    both have had their first token since. Only the third is another's: set against the gateway's requests
    waiting now (none), all three counted as foreign prefill there, and on a fleet whose prefills end well within
    the interval (the live tenants at speedup 10, scraped every second) that phantom queue sent requests away from
    their prefix."""
    strategy, workers, index, clock = make(2)
    prefix = tokens(1, 2048)
    index.add(workers[0].url, block_keys(prefix, BS, ROOT), GPU)
    sent = [request(prefix + tokens(10 + i, 64)) for i in range(2)]
    decisions = [strategy.choose(req, workers) for req in sent]
    assert all(d.worker is workers[0] for d in decisions)
    workers[0].waiting, workers[0].load_scraped_at = 3.0, clock[0] + 0.001
    clock[0] += 0.05
    for req, decision in zip(sent, decisions, strict=True):
        strategy.on_first_token(req, decision, 0.02)
    held = strategy.holdings(request(prefix).block_keys, workers, 2048)
    estimate = strategy.estimate(workers[0], 2112, held[0], clock[0])
    assert estimate.queued == strategy._mean  # the one request waiting there that the gateway did not send
    workers[0].waiting = 2.0  # both the gateway's: nothing foreign
    assert strategy.estimate(workers[0], 2112, held[0], clock[0]).queued == Work()
    workers[0].load_scraped_at = clock[0] - 1.0  # a scrape before the two were sent: both foreign then
    assert strategy.estimate(workers[0], 2112, held[0], clock[0]).queued == strategy._mean.scaled(2.0)


def test_the_step_clock_finds_the_engines_steps_in_its_streams_chunks() -> None:
    """Three streams on one worker, an engine step every 10 ms (one of 100 ms: a long prefill the gateway did not
    send), each step's chunks arriving within 0.3 ms of each other: each step's boundary is its first chunk and its
    duration is known once per step; the rest of the step in progress is what the durations longer than the time
    elapsed leave. A step that brought a stream's first token computed a prefill the gateway's queue counts: it is
    kept apart."""
    clock = StepClock(jitter_s=0.001)
    assert clock.rest(0.0) == 0.0  # nothing known yet
    t = 0.0
    ends = []
    for step in range(12):
        t += 0.1 if step == 6 else 0.01
        ends.append(t)
        for stream in (1, 2, 3):
            clock.chunk(stream, t + 0.0001 * (stream - 1), first=step == 0)
        if step == 11:
            clock.chunk(3, t + 0.0004, first=False)  # its usage chunk and `[DONE]`, after its last token: the same step
    assert clock.boundary == ends[-1]
    # the first batch has no earlier chunk of its streams; the latest one's duration is kept once it is complete
    assert sorted(round(d, 6) for d in clock.durations) == [0.01] * 9 + [0.1]
    assert not clock.prefill_steps
    # 4 ms in, every step is longer: the mean one's rest (a decode step's 6 ms, and one in ten the long one's 96)
    assert abs(clock.rest(ends[-1] + 0.004) - (0.19 / 10 - 0.004)) < 1e-9
    assert abs(clock.rest(ends[-1] + 0.03) - 0.07) < 1e-9  # 30 ms in, it is the long kind: 70 ms to go
    assert clock.rest(ends[-1] + 0.2) == 0.0               # longer than any: about to end
    # stream 4's first token comes with stream 1's next: a prefill step, kept apart once the next step begins
    t = ends[-1] + 0.0101
    clock.chunk(4, t, first=True)
    clock.chunk(1, t + 0.0001, first=False)
    clock.chunk(1, t + 0.02, first=False)
    assert len(clock.durations) == 11 and [round(d, 6) for d in clock.prefill_steps] == [0.0102]
    assert abs(clock.rest(t + 0.02 + 0.0101) - (0.1 - 0.0101)) < 1e-9  # the prefill step is not among them


def test_steps_while_a_held_prefill_computes_are_prefill_steps() -> None:
    """Stream 1 decodes in 10 ms steps; a long prefill that waited for its turn there then computes two 57 ms
    chunks beside it, the first with no first token in its batch: while the gateway's queue has that prefill at its
    head, the step is a prefill's (kept apart), not a decode step that makes every hit expect a long one in
    progress (`kvgate bench vsim`, the live tenants fleet: hits predicted 45-56 ms of a step that took 7)."""
    queue = PrefillQueue()
    clock = StepClock(jitter_s=0.001, prefilling=queue.prefilling_held)
    queue.add(1, Work.of(2112, 0), now=0.0, expected_s=0.06, reported=True, turn=True)  # in its turn
    queue.add(2, Work.of(2112, 0), now=0.0, expected_s=0.12, reported=True, turn=True)  # held for it
    assert queue.turns == 2 and not queue.prefilling_held()  # the head is the one in its turn, not held
    for t in (0.03, 0.04, 0.05):
        clock.chunk(3, t, first=t == 0.03)  # another stream decoding, 10 ms steps
    queue.done(1, now=0.06)  # the one in its turn has its first token: the held one is sent
    clock.chunk(1, 0.06, first=True)
    clock.chunk(3, 0.0601, first=False)
    assert queue.prefilling_held()
    for t in (0.117, 0.1171):    # the held one's first chunk: a 57 ms step, no first token in it
        clock.chunk(3 if t == 0.117 else 1, t, first=False)
    queue.done(2, now=0.174)
    clock.chunk(2, 0.174, first=True)  # its last chunk and first token
    clock.chunk(3, 0.1741, first=False)
    for t in (0.184, 0.194):
        clock.chunk(3, t, first=False)
    assert [round(d, 3) for d in clock.durations] == [0.01, 0.01, 0.01]  # the last one's once the next begins
    assert [round(d, 3) for d in clock.prefill_steps] == [0.01, 0.057, 0.057]
    assert queue.turns == 0


def test_a_stream_that_begins_is_not_taken_for_an_ended_one_of_the_same_identity() -> None:
    """The gateway keys streams by their request's identity, which a later request may have once one has ended
    (its key stays until forgotten): its first chunk is a prefill step's, not a step since the old one's last."""
    clock = StepClock(jitter_s=0.001)
    for step in range(5):
        clock.chunk(1, 0.01 * step, first=step == 0)
        clock.chunk(2, 0.01 * step, first=step == 0)
    clock.chunk(2, 0.5, first=False)
    clock.chunk(1, 0.5, first=True)  # a new request, with an ended one's identity
    clock.chunk(2, 0.51, first=False)
    # the 0.46 s since stream 2's last chunk was a prefill step's (stream 1 began in it), not a decode step
    assert [round(d, 6) for d in clock.prefill_steps] == [0.46]
    assert len(clock.durations) == 4 and all(abs(d - 0.01) < 1e-9 for d in clock.durations)


def test_the_step_clock_learns_through_chunks_of_one_step_further_apart_than_its_jitter() -> None:
    """Live, the chunks of one step can reach the gateway some milliseconds apart (a loaded machine): two streams
    whose chunks come 3 ms apart in every 30 ms step, against a jitter of 1 ms. Durations are learned all the same,
    and once they are, a step's chunks are one batch again: the boundary is its first chunk."""
    clock = StepClock(jitter_s=0.001)
    for step in range(1, 20):
        clock.chunk(1, 0.03 * step, first=step == 1)
        clock.chunk(2, 0.03 * step + 0.003, first=step == 1)
    assert len(clock.durations) == 18 and all(abs(d - 0.03) < 1e-9 for d in clock.durations)
    assert abs(clock.boundary - 0.03 * 19) < 1e-9


def step_streams(strategy: TtftAware, worker: Worker, ends: list[float], clock: list[float]) -> None:
    """Two streams on `worker` relayed a chunk at the end of each of these engine steps."""
    streams = [(request(tokens(900 + i, 8)), Decision(worker, HIT)) for i in range(2)]
    for end in ends:
        clock[0] = end
        for req, decision in streams:
            strategy.on_chunk(req, decision, end == ends[0])


def test_a_worker_whose_step_has_just_begun_waits_its_rest() -> None:
    """Two workers, each with a request decoding. Worker 0 holds the first 320 tokens of the prompt (32 ms of
    prefill saved) but its steps take 150 ms (long prompts decoding), and one has just begun; worker 1's steps
    take 10 ms and its step in progress ends in 1 ms. Without the step phase worker 0 takes it by its hit; with
    it the request goes where its first step comes 149 ms sooner, and the prediction carries the wait."""
    chosen = {}
    for phase in (False, True):
        strategy, workers, index, clock = make(2, dataclasses.replace(OPTIONS, ttft_step_phase=phase))
        prefix = tokens(1, 320)
        index.add(workers[0].url, block_keys(prefix, BS, ROOT), GPU)
        step_streams(strategy, workers[0], [1000.0 + 0.15 * i for i in range(6)], clock)
        step_streams(strategy, workers[1], [1000.0 + 0.01 * i for i in range(76)], clock)
        for worker in workers:
            worker.in_flight = 2
        clock[0] = 1000.75 + 0.009  # worker 0's last step began at 1000.75, worker 1's at 1000.75 too
        assert phase == bool(strategy.steps)
        decision = strategy.choose(request(prefix + tokens(2, 64)), workers)
        chosen[phase] = decision
    assert chosen[False].worker.url.endswith(":9000") and chosen[False].reason == HIT
    assert chosen[True].worker.url.endswith(":9001")
    # worker 1: 10 ms overhead + 38.4 ms of prefill (384 tokens) + the 1 ms left of its step
    predicted = chosen[True].predicted_ttft_s
    assert predicted is not None and abs(predicted - 0.0494) < 1e-6
    strategy, workers, _, clock = make(2)
    step_streams(strategy, workers[0], [1000.0 + 0.15 * i for i in range(6)], clock)
    workers[0].in_flight = 2
    clock[0] = 1000.75 + 0.05
    assert abs(strategy.estimate(workers[0], 100, strategy.holdings([], workers, 0)[0], clock[0]).step_s - 0.1) < 1e-9
    workers[0].in_flight = 0  # nothing running there: the engine is idle, no step in progress
    assert strategy.estimate(workers[0], 100, strategy.holdings([], workers, 0)[0], clock[0]).step_s == 0.0


def test_a_data_parallel_engine_has_a_step_clock_per_rank() -> None:
    """A data-parallel engine's ranks each run steps of their own, and their streams' chunks reach the gateway
    interleaved: rank 0's steps take 150 ms, rank 1's 10 ms, out of phase. Each rank's clock learns its own steps
    exactly; a request the engine holds nothing of is sent to the rank whose step ends soonest (named in the
    decision), and one held on rank 0 waits the rest of rank 0's step."""
    strategy, _, index, clock = make(0)
    worker = Worker(spec=WorkerSpec("http://127.0.0.1:9100", dp_ranks=2), healthy=True, models=frozenset({"tiny"}))
    streams = [(request(tokens(900 + i, 8)), Decision(worker, HIT, dp_rank=i // 2)) for i in range(4)]
    for req, decision in streams:  # each decodes on its rank
        strategy.on_first_token(req, decision, 0.02)
    chunks = sorted([(1000.0 + 0.15 * i, 0) for i in range(6)] + [(1000.0033 + 0.01 * i, 1) for i in range(76)])
    started = set()
    for at, rank in chunks:
        clock[0] = at
        for req, decision in streams[2 * rank: 2 * rank + 2]:
            strategy.on_chunk(req, decision, rank not in started)
        started.add(rank)
    worker.in_flight = 4
    assert sorted(strategy.steps) == [cache_name(worker.url, 0), cache_name(worker.url, 1)]
    assert all(abs(d - 0.15) < 1e-9 for d in strategy.steps[cache_name(worker.url, 0)].durations)
    assert all(abs(d - 0.01) < 1e-9 for d in strategy.steps[cache_name(worker.url, 1)].durations)
    clock[0] = 1000.75 + 0.009  # rank 0's step began at 1000.75 (141 ms to go), rank 1's at 1000.7533 (4.3 ms)
    miss = strategy.choose(request(tokens(2, 64)), [worker])
    assert miss.dp_rank == 1
    # 10 ms overhead + 6.4 ms of prefill (64 tokens) + the 4.3 ms left of rank 1's step
    assert miss.predicted_ttft_s is not None and abs(miss.predicted_ttft_s - 0.0207) < 1e-6
    prefix = tokens(1, 320)
    index.add(cache_name(worker.url, 0), block_keys(prefix, BS, ROOT), GPU)
    hit = strategy.choose(request(prefix + tokens(3, 64)), [worker])
    assert hit.dp_rank == 0 and hit.predicted_ttft_s is not None
    assert abs(hit.predicted_ttft_s - (0.01 + 0.0064 + 0.141)) < 1e-6
    for req, decision in streams[:2]:  # rank 0's requests end: it is idle, its step no longer counts
        strategy.on_finished(req, decision)
    assert strategy.choose(request(tokens(4, 64)), [worker]).dp_rank == 0
    strategy.forget_worker(worker.url)
    assert not strategy.steps


def test_a_data_parallel_engines_ranks_queue_their_own_prefills() -> None:
    """Each rank of a data-parallel engine schedules its own requests: three 2,976-token prefills waiting on rank 0
    (whose cache holds their prefix) do not delay a request no rank holds any of, which goes to rank 1. With one
    queue per engine they counted for every rank: rank 1's prediction carried rank 0's 0.89 s."""
    strategy, _, index, _ = make(0)
    worker = Worker(spec=WorkerSpec("http://127.0.0.1:9100", dp_ranks=2), healthy=True, models=frozenset({"tiny"}))
    prefix = tokens(1, 1024)
    index.add(cache_name(worker.url, 0), block_keys(prefix, BS, ROOT), GPU)
    waiting = [dataclasses.replace(request(prefix + tokens(10 + i, 2976)), stream=True) for i in range(3)]
    assert [strategy.choose(req, [worker]).dp_rank for req in waiting] == [0, 0, 0]
    miss = strategy.choose(request(tokens(2, 64)), [worker])
    # rank 1: 10 ms overhead + 6.4 ms of prefill (64 tokens), nothing queued
    assert miss.dp_rank == 1 and miss.predicted_ttft_s is not None and abs(miss.predicted_ttft_s - 0.0164) < 1e-9
    hit = strategy.choose(request(prefix + tokens(3, 64)), [worker])
    # rank 0: behind its three prefills (3 x 0.2976 s)
    assert hit.dp_rank == 0 and hit.predicted_ttft_s is not None
    assert abs(hit.predicted_ttft_s - (0.01 + 3 * 0.2976 + 0.0064)) < 1e-9
    queues = [strategy.queue(cache_name(worker.url, rank)).count(strategy.now) for rank in (0, 1)]
    assert queues == [4, 1]
    strategy.forget_worker(worker.url)
    assert not strategy.queues


def test_an_engines_prefill_histograms_make_a_sample_per_window() -> None:
    timings = EngineTimings(window_s=10.0)
    worker = Worker(spec=WorkerSpec("http://w"))
    assert timings.sample(worker) is None  # never scraped

    def scraped(at: float, seconds: float, requests: float, computed: float, prompt: float) -> None:
        worker.load_scraped_at, worker.prefill_seconds, worker.prefill_requests = at, seconds, requests
        worker.prefill_computed_tokens, worker.prefill_prompt_tokens = computed, prompt

    scraped(100.0, 5.0, 10, 20_000, 30_000)
    assert timings.sample(worker) is None  # the window starts
    scraped(105.0, 6.0, 14, 26_000, 40_000)
    assert timings.sample(worker) is None  # 5 s: not yet a window
    scraped(110.0, 7.0, 20, 32_000, 50_000)  # 10 requests: 12,000 computed of 20,000 prompt tokens, 2 s
    sample = timings.sample(worker)
    assert sample is not None and sample.requests == 10 and abs(sample.seconds - 0.2) < 1e-12
    assert sample.work == Work.of(1200, 800)  # the mean request computed 1,200 tokens after 800 cached
    scraped(120.0, 37.0, 40, 92_000, 110_000)  # 30 s of prefill in 10 s (side by side): 10 s at most
    sample = timings.sample(worker)
    assert sample is not None and abs(sample.seconds - 10.0 / 20) < 1e-12
    scraped(130.0, 1.0, 2, 100, 100)  # the engine restarted: counters back near 0, a new window starts
    assert timings.sample(worker) is None
    scraped(140.0, 1.0, 2, 100, 100)  # a window where nothing finished: no sample
    assert timings.sample(worker) is None
    assert EngineTimings(window_s=0.0).sample(worker) is None  # off


def test_a_copy_of_a_prefix_held_elsewhere_costs_its_prefill() -> None:
    spread, rate = SpreadCost(OPTIONS, LoadCost(OPTIONS)), PrefillRate(OPTIONS)
    assert spread.seconds(held_here=1024, held_most=1024, rate=rate) == 0.0
    assert abs(spread.seconds(held_here=0, held_most=1000, rate=rate) - 0.1) < 1e-12


def test_a_copy_loaded_from_a_tier_costs_reloading_what_it_pushes_out_from_dram() -> None:
    """Tokens a worker loads from a lower tier while another worker's GPU holds them: the copy pushes as many out of
    its GPU into its own agent's DRAM, whence they come back: priced at that reload (50 us + 2,048 x 128 KiB at
    25 GB/s: 10.79 ms), not at the shared-tier load that brought the copy (28.84 ms), and never above the load."""
    load = LoadCost(OPTIONS)
    spread, rate = SpreadCost(OPTIONS, load), PrefillRate(OPTIONS)
    shared = load.load_seconds(SHARED, 2048)
    assert abs(shared - (2e-3 + 2048 * 131072 / 10e9)) < 1e-15
    dram = 50e-6 + 2048 * 131072 / 25e9
    assert abs(spread.seconds(held_here=2048, held_most=2048, rate=rate, load_s=shared, gpu_here=0,
                              gpu_most=2048) - dram) < 1e-15
    # half of it on this GPU already: the other half is the copy
    half = load.load_seconds(SHARED, 1024)
    assert abs(spread.seconds(held_here=2048, held_most=2048, rate=rate, load_s=half, gpu_here=1024,
                              gpu_most=2048) - (50e-6 + 1024 * 131072 / 25e9)) < 1e-15
    # a load cheaper than the reload (a short one from DRAM itself, with less latency) costs at most itself
    assert spread.seconds(held_here=2048, held_most=2048, rate=rate, load_s=0.001, gpu_here=0,
                          gpu_most=2048) == 0.001
    # no GPU holds it anywhere: loading it is no copy
    assert spread.seconds(held_here=2048, held_most=2048, rate=rate, load_s=shared, gpu_here=0, gpu_most=0) == 0.0


def test_tier_loads_are_priced_at_what_the_fleets_loads_take() -> None:
    """The links say 28.84 ms for a 2,048-token shared-tier load; this fleet's loads take a tenth of that. Each
    request that loaded teaches the fit (its first token less the rest of its prediction, against the links'
    time): a fit through the origin, held towards 1 as four samples at the typical load (the same 2,048 tokens
    here) would hold it, each sample counting half after 200. A stall (a first token 1 s late) is learned as five
    times the load's price, no more."""
    load = LoadCost(OPTIONS)
    rate = PrefillRate(OPTIONS)
    link = load.load_seconds(SHARED, 2048)
    assert load.scale == 1.0 and load.plan({SHARED: 2048}, rate) == (link, 0)
    decay = 0.5 ** (1 / 200)
    n = 40
    for _ in range(n):
        load.learn(link, 0.1 * link)
    seen = sum(decay ** k for k in range(n))  # the samples' weight after forgetting
    expected = (seen * 0.1 + 4 * 1.0) / (seen + 4)
    assert abs(load.scale - expected) < 1e-12 and 0.18 < load.scale < 0.19
    seconds, recompute = load.plan({GPU: 1024, SHARED: 2048}, rate)
    assert recompute == 0 and abs(seconds - expected * link) < 1e-15
    before = load.scale
    load.learn(link, 1.0)  # a stall: at most 5 x the price
    after = (seen * decay * 0.1 * link * link + link * min(1.0, 5 * before * link) + 4 * link * link) / (
        (seen * decay + 1 + 4) * link * link)
    assert abs(load.scale - after) < 1e-12
    off = LoadCost(dataclasses.replace(OPTIONS, ttft_learn_loads=False))
    off.learn(link, 0.1 * link)
    assert off.scale == 1.0


def test_a_worker_over_its_share_of_recent_requests_is_at_its_cap_and_old_requests_fade() -> None:
    share = RequestShare(slack=0.2, window=10)
    urls = ["a", "b", "c", "d"]
    assert share.over(urls) == [False] * 4
    for _ in range(3):
        share.add("a", 4)
    # a: 3 of 3; the cap 1.2 x (3 + 1) / 4 + 1 = 2.2: one more would be 4
    assert share.over(urls) == [True, False, False, False]
    for url in ("b", "c", "d") * 2:
        share.add(url, 4)
    assert share.over(urls) == [False] * 4
    for _ in range(400):  # 10 requests per worker is a half-life: a's old lead is forgotten, d's new one counts
        share.add("d", 4)
    assert share.counts["a"] < 0.01 and share.over(urls) == [False, False, False, True]
    assert RequestShare(slack=-1.0, window=10).over(urls) == [False] * 4  # off
    share.forget("d")
    assert "d" not in share.counts


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


def test_a_long_miss_goes_where_no_hits_wait_for_the_gpu() -> None:
    """Mooncake, 8 replicas, NVMe at 2.9 GB/s: a 191k-token first read (23 s of prefill) went to the worker whose
    GPU held the window's hottest prefixes, and the next hits there were sent away to recompute 34-46k tokens each.
    Its prefill costs the hits that come for that worker: with 5 hits there lately (half-life 30 s: 0.1155 a
    second), 2 s of prefill costs them 0.1155 x 2 x 1 = 0.231 s, more than the 0.05 s queued elsewhere."""
    for weight, goes_to, predicted, then in ((0.0, {0}, 0.01 + 2.0, SPILL), (1.0, {1, 2}, 0.01 + 0.05 + 2.0, HIT)):
        strategy, workers, index, clock = make(options=dataclasses.replace(OPTIONS, ttft_busy_weight=weight))
        system = tokens(1, 2048)
        index.add(workers[0].url, block_keys(system, BS, ROOT), GPU)
        for i in range(5):
            req = request(system + tokens(100 + i, 64))
            decision = strategy.choose(req, workers)
            assert decision.worker is workers[0] and decision.reason == HIT
            strategy.on_first_token(req, decision, 0.0164)
        for w in workers[1:]:  # a 500-token prefill queued on each of the others: 0.05 s
            strategy.queue(w.url).add(id(w), Work.of(500, 0), clock[0], 0.06, reported=True)
        miss = strategy.choose(request(tokens(7, 20_000)), workers)
        assert workers.index(miss.worker) in goes_to and miss.reason == MISS
        assert miss.predicted_ttft_s is not None and abs(miss.predicted_ttft_s - predicted) < 1e-9
        # the next hit: behind 2 s of prefill on its holder it is sent away to compute its prefix again; with the
        # miss elsewhere it keeps it
        hit = strategy.choose(request(system + tokens(200, 64)), workers)
        assert hit.reason == then and (hit.worker is workers[0]) == (then == HIT)


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


def test_a_prefix_in_the_shared_tier_spills_when_the_queue_outweighs_its_load_and_the_copy() -> None:
    """As above with the prefix also in the shared tier, where every worker can load it: another worker pays the
    load (2 ms + 2,048 x 128 KiB at 10 GB/s: 28.84 ms) and, since worker 0's GPU holds the prefix, the copy, priced
    at reloading what it pushes out from that worker's DRAM (50 us + 2,048 x 128 KiB at 25 GB/s: 10.79 ms).
    Without the copy's price every request whose holder had a queue worth more than a load went elsewhere (live
    tenants with agents and the fleet's tier links: GPU hit rate 0.21-0.27); priced at the load itself (before),
    the holder kept them until its queue was worth two loads: request 2 was the first to go."""
    strategy, workers, index, _ = make()
    system = tokens(1, 2048)
    keys = block_keys(system, BS, ROOT)
    index.add(workers[0].url, keys, GPU)
    index.add(workers[0].url, keys, SHARED)  # the agent's write-through: reachable from every worker
    burst = [request(system + tokens(100 + i, 400)) for i in range(40)]  # none has its first token yet
    placed = [strategy.choose(req, workers) for req in burst]
    first_spill = next(i for i, d in enumerate(placed) if d.worker is not workers[0])
    # worker 0: 10 ms + 40 ms of prefill + 40 ms per request queued; elsewhere 10 + 28.84 (load) + 40 + 10.79
    # (the copy) = 89.63 ms: request 1 (the second, 90 ms on worker 0) is the first to go elsewhere
    assert first_spill == 1
    assert placed[first_spill].predicted_cached_tokens == 2048
    load = strategy.load.load_seconds(SHARED, 2048)
    predicted = placed[first_spill].predicted_ttft_s
    assert predicted is not None and abs(predicted - (0.01 + load + 0.04)) < 1e-9  # the copy's price is no wait


def test_a_hit_does_not_wait_behind_another_prefill_on_its_holder_when_a_tier_has_it() -> None:
    """The live tenants with agents: a tenant's holder has begun another tenant's first read (450 tokens here,
    45 ms) when the tenant's next question comes. Waiting for it there: 10 + 45 + 6.4 = 61.4 ms. Loading it from
    the shared tier on an idle worker: 10 + 28.84 + 6.4 = 45.2 ms, and the copy 10.79 ms (reloading what it
    pushes out from that worker's DRAM): 56.0 ms, and it goes there. Priced at the shared-tier load (28.84 ms:
    74.1 ms) the copy kept it on the holder, and the hits that waited behind other tenants' first reads were
    ttft's p90 (vsim, the README's tenants at speedup 10 with the live fleet's tier links, seeds 0-9: round_robin
    21.2 ms, ttft 30.4)."""
    strategy, workers, index, clock = make()
    system = tokens(1, 2048)
    keys = block_keys(system, BS, ROOT)
    index.add(workers[0].url, keys, GPU)
    index.add(workers[0].url, keys, SHARED)
    strategy.queue(workers[0].url).add(1, Work.of(450, 0), clock[0], 0.055, reported=True)
    decision = strategy.choose(request(system + tokens(2, 64)), workers)
    assert decision.worker is not workers[0] and decision.reason == HIT  # the shared tier holds it there too
    assert decision.predicted_cached_tokens == 2048
    load = strategy.load.load_seconds(SHARED, 2048)
    assert decision.predicted_ttft_s is not None and abs(decision.predicted_ttft_s - (0.01 + load + 0.0064)) < 1e-9


def test_the_gateway_learns_what_its_tier_loads_take_from_first_tokens() -> None:
    """A request loads its 2,048-token prefix from worker 1's NVMe tier (priced 0.2 ms + 2,048 x 128 KiB at 5 GB/s:
    53.9 ms) and its first token comes 0.9 of that sooner than predicted: the load took a tenth of its price. One
    sample against the prior (four at 1, each as a typical 28.8 ms shared-tier load): 0.58 of the links' time from
    then on."""
    strategy, workers, index, _ = make()
    system = tokens(1, 2048)
    index.add(workers[1].url, block_keys(system, BS, ROOT), DISK)
    req = request(system + tokens(2, 64))
    decision = strategy.choose(req, workers)
    link = strategy.load.load_seconds(DISK, 2048)
    assert decision.worker is workers[1] and decision.predicted_ttft_s is not None
    assert abs(decision.predicted_ttft_s - (0.01 + link + 0.0064)) < 1e-9
    strategy.on_first_token(req, decision, decision.predicted_ttft_s - 0.9 * link)
    strategy.request_ended(req, decision)
    strategy.pending.discard(workers[1].url, req.block_keys)
    typical = strategy.load.load_seconds(SHARED, 2048)
    scale = (link * link * 0.1 + 4 * typical * typical) / (link * link + 4 * typical * typical)
    assert abs(strategy.load.scale - scale) < 1e-12 and 0.58 < scale < 0.59
    again = strategy.choose(request(system + tokens(3, 64)), workers)
    assert again.worker is workers[1] and again.predicted_ttft_s is not None
    # (its first token less the load it was priced at is under 0: the prefill fit learned nothing from it)
    assert abs(again.predicted_ttft_s - (0.01 + scale * link + 0.0064)) < 1e-9


def test_a_tie_band_does_not_give_up_a_hit() -> None:
    """Predictions within `ttft_tie_share` of the best count as equal, but only among workers holding as much of the
    prompt as the best one: with the 10% band the hot prefix still spills at the 12th request, as above (at the
    11th, 0.45 s on worker 0 against 0.46 s elsewhere, the band would make the idle workers its equals and the
    least busy of them take it: on the Mooncake window with tiers, 8 replicas, hit rate 90% of the bound, 98% now)."""
    strategy, workers, index, _ = make(options=dataclasses.replace(OPTIONS, ttft_tie_share=0.1))
    system = tokens(1, 2048)
    index.add(workers[0].url, block_keys(system, BS, ROOT), GPU)
    burst = [request(system + tokens(100 + i, 400)) for i in range(40)]
    placed = [strategy.choose(req, workers) for req in burst]
    first_spill = next(i for i, d in enumerate(placed) if d.worker is not workers[0])
    assert first_spill == 11 and placed[first_spill].reason == SPILL


def sequential(strategy: TtftAware, workers: list[Worker], clock: list[float], prompts: list[list[int]],
               index: InMemoryKvIndex) -> list[Any]:
    """Each prompt routed, answered (its blocks announced by the worker chosen) and done before the next: an idle
    fleet, where only the cache and the balance decide."""
    decisions = []
    for ids in prompts:
        req = request(ids)
        decision = strategy.choose(req, workers)
        clock[0] += 1.0
        strategy.on_first_token(req, decision, decision.predicted_ttft_s or 0.01)
        index.add(decision.worker.url, req.block_keys, GPU)
        decisions.append(decision)
    return decisions


def test_a_hot_prefix_is_copied_to_as_many_workers_as_its_traffic_needs() -> None:
    """Every request shares one 1,024-token system prompt (0.1 s of prefill to copy) on an idle fleet of four: with
    the balance off all of them follow the worker that read it first (no queue ever outweighs the copy); with it
    each worker takes at most 1.2x the mean plus one, and the prompt is copied once per worker, not per request."""
    system = tokens(1, 1024)
    prompts = [system + tokens(100 + i, 32) for i in range(200)]
    strategy, workers, index, clock = make(4)
    alone = sequential(strategy, workers, clock, prompts, index)
    assert {d.worker.url for d in alone} == {alone[0].worker.url}

    strategy, workers, index, clock = make(4, BALANCED)
    spread = sequential(strategy, workers, clock, prompts, index)
    counts = [sum(d.worker is w for d in spread) for w in workers]
    assert max(counts) / (sum(counts) / 4) <= 1.25
    assert sum(d.reason != HIT for d in spread) == 4  # the first read and three copies


def test_a_holder_at_its_cap_shares_the_tie_band_with_the_workers_that_would_copy() -> None:
    """A 1,296-token prefix costs 0.13 s to copy, a little more than the balance's 0.12 s: its holder at its cap
    (0.133 s) and an idle worker copying it (0.142 s) are within the 10% band, so the balance may copy it (RAG's hot
    4,096-token documents on an H100 are such prefixes); a holder with room keeps it (the test above)."""
    system = tokens(1, 1296)
    prompts = [system + tokens(100 + i, 32) for i in range(200)]
    strategy, workers, index, clock = make(4, dataclasses.replace(BALANCED, ttft_tie_share=0.1))
    decisions = sequential(strategy, workers, clock, prompts, index)
    counts = [sum(d.worker is w for d in decisions) for w in workers]
    assert max(counts) <= 1.25 * len(prompts) / len(workers), counts


def test_a_prefix_still_being_computed_is_not_copied_for_the_balance() -> None:
    """A burst's second request of a new 512-token prefix (0.05 s to compute, less than the balance's 0.12 s) finds
    its only holder still computing it and at its cap (two requests routed, one of them there: with four workers
    the first few cannot spread evenly). Live, on the tenants workload, such a request was sent to compute the
    prefix a second time elsewhere, and the copy evicted another tenant. It waits for that prefill now; once the
    holder's events announce the prefix and the holder is over its share, the balance copies it as before."""
    strategy, workers, index, clock = make(4, BALANCED)
    prefix = tokens(1, 512)
    first = request(prefix + tokens(100, 32))
    placed = strategy.choose(first, workers)
    holder = placed.worker
    other = strategy.choose(request(tokens(2, 544)), workers).worker
    assert other is not holder
    assert strategy.share.over([w.url for w in workers])[workers.index(holder)]  # at its cap
    second = strategy.choose(request(prefix + tokens(101, 32)), workers)
    assert second.worker is holder and second.reason == HIT

    clock[0] += 0.1
    strategy.on_first_token(first, placed, 0.06)
    index.add(holder.url, first.block_keys, GPU)
    third = strategy.choose(request(prefix + tokens(102, 32)), workers)
    assert third.worker is not holder and third.reason == SPILL


def test_the_balance_costs_a_request_at_most_its_budget() -> None:
    """A prefix whose copy would cost more than `ttft_balance_s` (4,096 tokens: 0.41 s against 0.12 s) stays on
    its worker even at its cap."""
    system = tokens(1, 4096)
    strategy, workers, index, clock = make(4, BALANCED)
    decisions = sequential(strategy, workers, clock, [system + tokens(100 + i, 32) for i in range(40)], index)
    assert {d.worker.url for d in decisions} == {decisions[0].worker.url}
    assert strategy.share.over([w.url for w in workers]) == [w is decisions[0].worker for w in workers]


def routed_at_speed(speed: float, prompts: list[list[int]], options: TtftOptions = BALANCED) -> list[tuple[int, str]]:
    """Each prompt routed over four workers and answered one after another by a fleet `speed` times faster than
    OPTIONS' prior (10 ms + 0.1 ms per uncached token, divided by `speed`), its blocks announced by the worker
    chosen: (worker, reason) per prompt."""
    strategy, workers, index, clock = make(4, options)
    placed = []
    for ids in prompts:
        req = request(ids)
        decision = strategy.choose(req, workers)
        clock[0] += 1.0
        uncached = len(ids) - decision.predicted_cached_tokens
        strategy.on_first_token(req, decision, (0.01 + uncached / 10_000) / speed)
        index.add(decision.worker.url, req.block_keys, GPU)
        placed.append((workers.index(decision.worker), decision.reason))
    return placed


def test_fleets_that_differ_only_in_speed_make_the_same_choices() -> None:
    """Five tenants' 2,048-token prompts on four workers: one worker reads two of them, and with twice its share of
    requests it is at its balance cap. Moving a tenant costs a full miss, and (in a full cache) another tenant's
    place; the price makes that worth it only for a prefix cheaper than 1,200 tokens of prefill. On the live
    fleet, ten times faster than the time model (`kvgate sim --speedup 10`), the price was 0.12 s whatever the
    speed: more than a 2,048-token prefill there (0.02 s), so the balance moved tenants (hit rate 0.84 against
    `kv`'s 0.87), while the same fleet at speedup 1 kept them. Priced in the fleet's learned prefill it makes the
    same choices at either speed, and keeps every tenant where it was first read."""
    rng = random.Random(5)
    warmup = [tokens(500 + i, rng.randrange(200, 4000)) for i in range(40)]  # misses of every size: the rate
    prefixes = [tokens(10 + t, 2048) for t in range(5)]
    order = [t for t in range(5) for _ in range(12)]
    rng.shuffle(order)
    prompts = warmup + [prefixes[t] + tokens(1000 + i, 64) for i, t in enumerate(order)]
    slow, fast = routed_at_speed(1.0, prompts), routed_at_speed(10.0, prompts)
    assert fast == slow
    tenants = slow[len(warmup):]
    for t in range(5):
        placed = [p for p, tenant in zip(tenants, order, strict=True) if tenant == t]
        assert len({worker for worker, _ in placed}) == 1, (t, placed)  # read once, never moved
        assert [reason for _, reason in placed[1:]] == [HIT] * (len(placed) - 1)


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


def test_a_stall_of_the_gateway_does_not_teach_that_prefill_is_free() -> None:
    """Answers as the fit predicts them (hits of a 2,048-token prefix and 2,112-token misses), then a stall: 15 hits
    whose first tokens took 1.3 s (live, at load 12, the gateway's machine stalled so). Learned whole, the stall made
    the fit's overhead large and its price of a prefill token about nothing, so a miss looked as cheap as a hit and
    the tenants scattered (hit rate 0.363 of 0.888). Each answer counts at most OUTLIER_RATIO times its prediction:
    a miss stays dearer than a hit by most of its prefill."""
    strategy, workers, index, clock = make(2)
    prefix = tokens(1, 2048)
    index.add(workers[0].url, block_keys(prefix, BS, ROOT), GPU)

    def answer(ids: list[int], seconds: float | None = None) -> None:
        req = request(ids)
        decision = strategy.choose(req, workers)
        clock[0] += 1.0
        strategy.on_first_token(req, decision, seconds if seconds is not None else decision.predicted_ttft_s or 0.0)

    for i in range(30):
        answer(prefix + tokens(100 + i, 64))
        answer(tokens(1000 + i, 2112))
    for i in range(15):
        answer(prefix + tokens(200 + i, 64), 1.3)
    rate = strategy.fleet_rate
    hit, miss = rate.seconds(Work.of(64, 2048)), rate.seconds(Work.of(2112, 0))
    assert miss - hit > 0.5 * 0.2048, (hit, miss)


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
        seen: list[bool] = []
        choose = strategy.choose

        def seeing(request: Any, workers: Any) -> Any:
            seen.append(request.stream)
            return choose(request, workers)

        strategy.choose = seeing
        for _ in range(3):
            body = {"model": "tiny", "prompt": "hello there", "stream": True}
            async with http.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        assert seen == [True] * 3  # the strategy is told the answer streams (its queue keeps it until reported)
        assert strategy.own_rate(url).fit.samples == strategy.fleet_rate.fit.samples == 3
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_ttft_prediction_error_ratio_count") == 3
        assert not strategy._routed and strategy.queue(url).count(strategy.now) == 0


async def test_the_prediction_is_sent_to_the_client_only_when_asked(http: aiohttp.ClientSession) -> None:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(text_event(" a")) + chunked(event("[DONE]")) + b"0\r\n\r\n")

    body = {"model": "tiny", "prompt": "hello there", "stream": True}
    async with raw_worker(answer) as url:
        for asked in (False, True):
            async with running_gateway([url], strategy="ttft", predicted_ttft_header=asked) as gw:
                await eventually(lambda: bool(gw.gateway.pool.healthy()))
                async with http.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
                    header = resp.headers.get("X-Kvgate-Predicted-Ttft-Ms")
                if asked:
                    assert header is not None and 0 < float(header) < 1000
                else:
                    assert header is None


async def engine_prefill(http: aiohttp.ClientSession, url: str) -> tuple[float, float, float]:
    """(seconds, requests, tokens computed): what the engine's /metrics report of its finished requests' prefill."""
    async with http.get(url + "/metrics") as resp:
        totals = sum_samples(await resp.text(), ("vllm:request_prefill_time_seconds_sum",
                                                 "vllm:request_prefill_time_seconds_count",
                                                 "vllm:request_prefill_kv_computed_tokens_sum"))
    return tuple(totals.values())  # type: ignore[return-value]


async def test_the_prefill_rate_is_learned_from_a_real_engines_metrics(sim_fleet: Any,
                                                                       http: aiohttp.ClientSession) -> None:
    """A `kvgate sim` replica (vLLM's metrics, prefill timed by the H100 profile) behind a `ttft` gateway that
    believes prefill is free (10 M tokens/s, no overhead). Only whole answers are asked for, so no first token is
    ever reported to the strategy: what it learns comes from the engine's /metrics alone. Its prediction for the
    mean request moves from ~0.2 ms to within a quarter of the prefill time the engine reported for them (on a
    loaded machine that is slower than the profile's, so the profile is only a check of the units)."""
    fleet = sim_fleet(1, extra_args=["--max-model-len", "4096", "--num-gpu-blocks-override", "4000"])
    url = fleet.urls[0]
    profile = load_profile("llama-3.1-8b-h100")
    async with running_gateway(fleet.worker_specs, strategy="ttft", ttft_prefill_tokens_per_s=1e7,
                               ttft_overhead_s=0.0, ttft_attention_s=0.0, ttft_metrics_window_s=0.5) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        strategy: Any = gw.gateway.strategy
        rate = strategy.own_rate(url)
        assert rate.overhead_s + rate.seconds(Work.of(2000, 0)) < 0.001
        before = await engine_prefill(http, url)
        rng = random.Random(5)
        for i in range(200):
            ids = [rng.randrange(1, 4000) for _ in range(rng.randrange(1000, 3000))]
            body = {"model": "tiny", "prompt": ids, "max_tokens": 1}
            async with http.post(gw.url + "/v1/completions", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
                await resp.read()
            if rate.fit.samples >= 20 and i >= 20:
                break
        assert rate.fit.samples >= 20 and strategy.fleet_rate.fit.samples == rate.fit.samples
        # the engine's totals as of the last window the strategy learned from (later answers are not in its fit)
        last = strategy.timings._last[url]
        seconds, requests, computed = (a - b for a, b in zip((last.seconds, last.requests, last.computed), before,
                                                              strict=True))
        mean = computed / requests
        learned = rate.overhead_s + rate.seconds(Work.of(mean, 0))
        assert abs(learned - seconds / requests) / (seconds / requests) < 0.25, (learned, seconds / requests)
        profiled = profile.prefill_time(round(mean)) + profile.request_overhead_s
        assert profiled / 3 < learned < profiled * 10, (learned, profiled)  # the units: the prior was 300x off
        registry = gw.gateway.metrics.registry
        assert registry.get_sample_value("kvgate_ttft_engine_prefills_learned_total", {"worker": url}) == \
            rate.fit.samples
        assert registry.get_sample_value("kvgate_ttft_prediction_error_ratio_count") in (None, 0)


class Ticker:
    """An engine's steps stood in for: each `step_s` long (or longer, when this process is not run), each open
    stream sending a chunk at each step's end; the times the steps ended are kept. Not on absolute times: after a
    stall of the machine those would catch up with steps of no length at all, which no engine takes and whose
    chunks the gateway rightly sees as one batch (a loaded CI machine's kept steps went [0.0, 0.0, 0.0, ...])."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.ends: list[float] = []
        self.last_sent = -1  # the latest step (its index in `ends`) at whose end a chunk was sent
        self._tick = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.step_s)
            self.ends.append(loop.time())
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()

    async def stream(self, writer: asyncio.StreamWriter, tokens: int) -> None:
        writer.write(HEAD)
        await writer.drain()
        for _ in range(tokens):
            await self._tick.wait()
            self.last_sent = max(self.last_sent, len(self.ends) - 1)
            writer.write(chunked(text_event(" a")))
            await writer.drain()
        writer.write(chunked(event("[DONE]")) + b"0\r\n\r\n")


async def test_the_gateway_learns_a_workers_steps_from_the_chunks_it_relays(http: aiohttp.ClientSession) -> None:
    """A worker on loopback whose streams each send a chunk at the end of every 40 ms step; three streams at once
    through a `ttft` gateway: the worker's step clock learns the steps' duration (against the intervals the worker
    really kept, on a loaded machine) and its latest boundary is the latest step's end. The hook is the proxy's:
    without a call per relayed chunk, nothing would be learned."""
    ticker = Ticker(0.04)
    ticking = asyncio.create_task(ticker.run())

    async def answer(writer: asyncio.StreamWriter) -> None:
        await ticker.stream(writer, 15)

    try:
        async with raw_worker(answer) as url, running_gateway([url], strategy="ttft") as gw:
            await eventually(lambda: bool(gw.gateway.pool.healthy()))
            strategy: Any = gw.gateway.strategy

            async def one() -> None:
                body = {"model": "tiny", "prompt": "hello there", "stream": True}
                async with http.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()

            opened = len(ticker.ends)
            await asyncio.gather(*(one() for _ in range(3)))
            steps = strategy.steps[url]
            # the steps the streams were open for, not those of the gateway's start
            kept = sorted(b - a for a, b in itertools.pairwise(ticker.ends[opened:]))
            learned = sorted(steps.durations)
            assert len(learned) >= 10
            median, kept_median = learned[len(learned) // 2], kept[len(kept) // 2]
            assert abs(median - kept_median) < 0.2 * kept_median, (learned, kept)
            # the latest boundary is when the latest step's chunks reached the gateway: after that step's end, within
            # the step (how soon after depends on the machine's load: 25 ms at load 4 on 2 cores)
            latest = ticker.ends[ticker.last_sent]
            assert 0 <= steps.boundary - latest < ticker.step_s, (steps.boundary - latest, ticker.step_s)
            registry = gw.gateway.metrics.registry
            assert registry.get_sample_value("kvgate_ttft_step_seconds", {"worker": url}) == steps.mean_s > 0
    finally:
        ticking.cancel()


async def inter_token_latency(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with http.get(url + "/metrics") as resp:
        totals = sum_samples(await resp.text(), ("vllm:inter_token_latency_seconds_sum",
                                                 "vllm:inter_token_latency_seconds_count"))
    return tuple(totals.values())  # type: ignore[return-value]


async def test_the_step_clock_agrees_with_a_simulated_engines_own_step_timing(
        sim_fleet: Any, http: aiohttp.ClientSession) -> None:
    """A `kvgate sim` replica (the H100 profile's step times, slowed 4x so a step is some 30 ms) streams four
    answers at once through a `ttft` gateway: the mean step duration the gateway learned from the chunks it relayed
    is the engine's own mean inter-token latency (vLLM's histogram in its /metrics), within a quarter."""
    fleet = sim_fleet(1, speedup=0.25, extra_args=["--max-model-len", "4096"])
    url = fleet.urls[0]
    async with running_gateway(fleet.worker_specs, strategy="ttft") as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        strategy: Any = gw.gateway.strategy
        before = await inter_token_latency(http, url)
        rng = random.Random(7)

        async def one() -> None:
            ids = [rng.randrange(1, 4000) for _ in range(200)]
            body = {"model": "tiny", "prompt": ids, "max_tokens": 24, "stream": True, "ignore_eos": True}
            async with http.post(gw.url + "/v1/completions", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
                await resp.read()

        await asyncio.gather(*(one() for _ in range(4)))
        seconds, count = (a - b for a, b in zip(await inter_token_latency(http, url), before, strict=True))
        steps = strategy.steps[url]
        assert count > 0 and len(steps.durations) >= 10
        engine = seconds / count
        learned = sum(steps.durations) / len(steps.durations)
        assert abs(learned - engine) < 0.25 * engine, (learned, engine, list(steps.durations))


def test_its_decisions_keep_the_trie_within_its_budget_and_forget_expired_prefixes() -> None:
    """`ttft` remembers each decision in the balance's trie as `prefix` does, and so has what that puts past the
    trie's budget or TTL removed (here, without a running loop as in vsim, at once). Its inserts went around those
    removals: the trie stayed up to one longest prompt over its budget and expired prefixes stayed predicted (vsim's
    Mooncake window, 16 replicas without tiers: hit rate 0.251 -> 0.247, p90 1482 -> 1504 ms)."""
    budget = 600
    strategy, workers, _, clock = make(options=dataclasses.replace(OPTIONS, prefix_trie_max_nodes=budget,
                                                                   prefix_trie_ttl_s=60.0))
    trie = strategy.balance.trie
    trie.clock = lambda: clock[0]
    for i in range(12):
        strategy.choose(request(tokens(i, 100 * BS)), workers)
        clock[0] += 1.0
        assert len(trie) <= budget
    assert trie.evictions > 0
    clock[0] += 61.0
    strategy.choose(request(tokens(99, 4 * BS)), workers)
    assert len(trie) == 4 and trie.expirations > 0
    trie.check()
