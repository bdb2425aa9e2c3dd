"""`kv`'s own scoring, decision by decision: what each tier's blocks save, that only the leading run counts, how
requests in flight stand in for KV events not yet arrived, how untrusted workers fall back to the trie, and which
data-parallel rank a decision names. The strategy as `kvgate serve` assembles it, over the real in-process index."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from kvcore.kv_events import CPU, DISK, GPU, SHARED, BlockHash, BlockRemoved, BlockStored, KvEvent, encode_batch
from kvgate.serve import assemble
from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.kv_index import InMemoryKvIndex
from router.kv_subscriber import EventSource, KvEventHub
from router.kv_transport import cache_name
from router.metrics import GatewayMetrics
from router.pool import Worker, WorkerPool
from router.routing import Decision, RouteRequest
from router.upstream import UpstreamPool
from strategies.kv import Holding, KvAware

BS = 16
A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"
KEYS = list(range(1000, 1012))  # twelve blocks' keys (chained in the gateway; any distinct ints here)


def strategy(workers: Sequence[str], *, trusted: Sequence[str] | None = None,
             **options: Any) -> tuple[KvAware, InMemoryKvIndex, list[Worker]]:
    """`kv` with an empty index whose event streams are trusted for `trusted` caches (default: every worker)."""
    specs = [WorkerSpec.parse(w) for w in workers]
    _, kv = assemble({"strategy": "kv", "block_size": BS, "worker": specs, **options})
    assert isinstance(kv, KvAware)
    kv.balance.random.seed(0)
    index = InMemoryKvIndex()
    allowed = None if trusted is None else set(trusted)
    kv.attach_kv(index, lambda cache: allowed is None or cache.split("#")[0] in allowed)
    pool = [Worker(spec, models=frozenset({"m"}), healthy=True) for spec in specs]
    return kv, index, pool


def request(blocks: int = 10, extra: int = 8) -> RouteRequest:
    """A prompt of `blocks` full blocks and `extra` more tokens (so every full block is cacheable)."""
    tokens = blocks * BS + extra
    return RouteRequest("m", "/v1/completions", token_ids=list(range(tokens)), block_keys=KEYS[:blocks],
                        prompt_tokens=tokens)


@pytest.mark.parametrize(("tier", "cost", "winner"), [
    (CPU, 0.1, A), (CPU, 0.5, B), (DISK, 0.25, A), (DISK, 0.5, B),
])
def test_each_tier_saves_its_share_of_a_recompute(tier: str, cost: float, winner: str) -> None:
    """A holds 8 blocks on a lower tier, B 6 on its GPU: A saves 8 * (1 - cost) blocks of prefill, B 6."""
    option: dict[str, Any] = {{CPU: "kv_cost_cpu", DISK: "kv_cost_disk"}[tier]: cost}
    kv, index, pool = strategy([A, B], **option)
    index.add(A, KEYS[:8], tier)
    index.add(B, KEYS[:6], GPU)
    decision = kv.choose(request(), pool)
    assert decision.worker.url == winner
    assert decision.predicted_cached_tokens == (8 if winner == A else 6) * BS


def test_the_fleet_shared_tier_saves_on_every_worker() -> None:
    kv, index, pool = strategy([A, B], kv_cost_shared=0.4)
    index.add(A, KEYS[:10], SHARED)
    [a, b] = kv.holdings(KEYS[:10], pool, 10 * BS)
    assert a.by_tier == b.by_tier == {SHARED: 10 * BS}
    assert a.saved == b.saved == pytest.approx(10 * BS * 0.6)


def test_only_the_leading_run_counts() -> None:
    """Blocks after a gap are no prefix hit: A holds all but the first block, B the first three."""
    kv, index, pool = strategy([A, B])
    index.add(A, KEYS[1:10], GPU)
    index.add(B, KEYS[:3], GPU)
    [a, b] = kv.holdings(KEYS[:10], pool, 10 * BS)
    assert (a.tokens, b.tokens) == (0, 3 * BS)
    decision = kv.choose(request(), pool)
    assert (decision.worker.url, decision.predicted_cached_tokens, decision.reason) == (B, 3 * BS, "hit")


def test_a_run_longer_than_the_cacheable_prompt_saves_what_its_cacheable_part_saves() -> None:
    """vLLM computes a prompt's last token, so of a prompt of exactly ten blocks nine can hit. Held: nine blocks
    on the GPU and the tenth only in the shared tier. The shared block is trimmed, and the nine save all their
    prefill (the average over all ten blocks' tiers had it 4% lower)."""
    kv, index, pool = strategy([A], kv_cost_shared=0.4, kv_cost_cpu=0.1)
    index.add(A, KEYS[:9], GPU)
    index.add(A, KEYS[9:10], SHARED)
    [a] = kv.holdings(KEYS[:10], pool, 9 * BS)
    assert a.tokens == 9 * BS and a.by_tier == {GPU: 9 * BS}
    assert a.saved == pytest.approx(9 * BS)
    index.add(A, KEYS[:7], CPU)  # a trimmed run over several tiers: each block at its own tier
    index.remove(A, KEYS[:7], GPU)
    [a] = kv.holdings(KEYS[:10], pool, 9 * BS)
    assert a.by_tier == {CPU: 7 * BS, GPU: 2 * BS}
    assert a.saved == pytest.approx(7 * BS * 0.9 + 2 * BS)


async def test_requests_in_flight_stand_in_for_events_until_the_grace_ends() -> None:
    """A burst with a new prefix stays on one worker before its KV events arrive; once the requests finished and
    the grace passed with no event, only the index speaks (nothing cached), and the trie's affinity keeps the
    group's next request where the group went."""
    kv, _, pool = strategy([A, B], kv_pending_grace_s=0.05)
    first = kv.choose(request(), pool)
    assert first.predicted_cached_tokens == 0 and first.reason == "miss"
    second = kv.choose(request(), pool)
    assert second.worker is first.worker and second.predicted_cached_tokens == 10 * BS
    for decision in (first, second):
        kv.on_finished(request(), decision)
    [held] = [h for w, h in zip(pool, kv.holdings(KEYS[:10], pool, 10 * BS), strict=True) if w is first.worker]
    assert held.tokens == 10 * BS  # within the grace
    await asyncio.sleep(0.2)
    third = kv.choose(request(), pool)
    assert third.worker is first.worker and third.predicted_cached_tokens == 0


def test_an_untrusted_worker_is_judged_by_the_trie_a_trusted_one_by_its_events() -> None:
    """B's event stream cannot be trusted (a gap the replay did not repair): the prefix once sent there counts
    as cached. A trusted worker the same prefix was sent to, whose events never announced it, does not."""
    kv, _, pool = strategy([A, B], trusted=[A])
    kv.balance.trie.insert(KEYS[:10], B)
    decision = kv.choose(request(), pool)
    assert (decision.worker.url, decision.predicted_cached_tokens) == (B, 10 * BS)

    kv, _, pool = strategy([A, B], trusted=[A, B])
    kv.balance.trie.insert(KEYS[:10], B)
    [_, b] = kv.holdings(KEYS[:10], pool, 10 * BS)
    assert b.tokens == 0 and b.affinity == pytest.approx(kv.affinity * 10 * BS)


def test_a_data_parallel_engine_is_judged_by_its_best_rank_and_the_decision_names_it() -> None:
    dp = A + ";dp_ranks=4"
    kv, index, pool = strategy([dp, B])
    index.add(cache_name(A, 1), KEYS[:4], GPU)
    index.add(cache_name(A, 2), KEYS[:9], GPU)
    index.add(B, KEYS[:6], GPU)
    decision = kv.choose(request(), pool)
    assert (decision.worker.url, decision.dp_rank, decision.predicted_cached_tokens) == (A, 2, 9 * BS)
    assert kv.choose(request(), [pool[1]]).dp_rank is None


def test_a_data_parallel_engines_ranks_take_prompts_none_of_them_holds_in_turn() -> None:
    """No rank holds any of the prompt: the ranks take such prompts in turn. The first of equals, rank 0, took
    every one, so every new prefix on a data-parallel engine was computed by its rank 0. A prompt a rank holds goes
    there, and does not move the turn."""
    dp = A + ";dp_ranks=3"
    kv, index, pool = strategy([dp])
    ranks = []
    for i in range(4):
        keys = list(range(5000 + 100 * i, 5010 + 100 * i))
        ranks.append(kv.choose(RouteRequest("tiny", "/v1/completions", token_ids=[1] * 168, block_keys=keys,
                                            prompt_tokens=168), pool).dp_rank)
    assert ranks == [0, 1, 2, 0]
    index.add(cache_name(A, 2), KEYS[:4], GPU)
    assert kv.choose(request(), pool).dp_rank == 2
    fresh = RouteRequest("tiny", "/v1/completions", token_ids=[1] * 168, block_keys=list(range(9000, 9010)),
                         prompt_tokens=168)
    assert kv.choose(fresh, pool).dp_rank == 1


def test_a_hot_prefix_spills_when_the_queue_outweighs_the_saving() -> None:
    """Both saving and queue are in prefill tokens: A holds the prefix, but with enough requests outstanding there
    the prefill saved no longer pays for the wait, and B (a miss) wins."""
    kv, index, pool = strategy([A, B], prefix_request_cost_tokens=128.0, prefix_prefill_weight=2.0)
    index.add(A, KEYS[:10], GPU)
    a = pool[0]
    a.in_flight = 2  # 256 tokens of queue against 2 * 160 saved: stays
    assert kv.choose(request(), pool).worker is a
    a.in_flight = 4  # 512 against 320: spills
    decision = kv.choose(request(), pool)
    assert decision.worker.url == B and decision.reason == "spill"


def test_pending_blocks_are_the_multiset_of_the_runs_in_flight() -> None:
    """`PendingBlocks` against a plain multiset of runs: random chained runs added and discarded (later, in any
    order), caches forgotten with runs still in flight (their discards, coming later, change nothing, unless the
    same run is in flight on the cache again), runs parting from each other at every depth."""
    import random
    from collections import Counter

    from router.block_keys import leading_run
    from strategies.kv import PendingBlocks

    rng = random.Random(7)
    pending = PendingBlocks()
    reference: dict[str, Counter[int]] = {}
    epoch = {cache: 0 for cache in ("http://a", "http://b", "http://b#dp1")}
    prefixes = [[rng.getrandbits(63) for _ in range(rng.randint(1, 12))] for _ in range(20)]
    in_flight: list[tuple[str, list[int], int]] = []
    caches = ["http://a", "http://b", "http://b#dp1"]
    for step in range(6000):
        roll = rng.random()
        if roll < 0.5 or not in_flight:
            cache = rng.choice(caches)
            keys = rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.getrandbits(63) for _ in range(rng.randint(0, 3))]
            pending.add(cache, keys)
            reference.setdefault(cache, Counter()).update(keys)
            in_flight.append((cache, keys, epoch[cache]))
        elif roll < 0.995:
            cache, keys, added_in = in_flight.pop(rng.randrange(len(in_flight)))
            pending.discard(cache, keys)
            # a run added before its cache was forgotten changes nothing, unless the same run is in flight again
            same = [i for i, (c, k, e) in enumerate(in_flight) if c == cache and k == keys and e == epoch[cache]]
            if added_in == epoch[cache] or same:
                if added_in != epoch[cache]:  # stands for the one in flight, whose own discard then changes nothing
                    c, k, _ = in_flight[same[0]]
                    in_flight[same[0]] = (c, k, -1)
                reference[cache].subtract(keys)
        else:
            pending.forget_worker("http://b")
            for cache in ("http://b", "http://b#dp1"):
                reference.pop(cache, None)
                epoch[cache] += 1
        if step % 50 == 0 or step > 5900:
            for cache in caches:
                want = {k: n for k, n in reference.get(cache, Counter()).items() if n > 0}
                assert pending.pending(cache) == want, step
                for prefix in prefixes:  # the binary search over the multiset, as before the two counters
                    held = leading_run(prefix, want)
                    assert pending.match(prefix, cache) == held
                    for at_least in range(len(prefix) + 2):  # what the trie says, one probe past it
                        assert pending.match(prefix, cache, at_least) == max(held, at_least)


def test_pending_runs_keep_a_shared_prefix_once_and_nothing_once_discarded() -> None:
    """Runs sharing a system prompt keep its keys once, each run's own tail beside it (what makes adding and
    discarding a run a step per segment, not a counter per key); a run parting inside a segment splits it, and
    once every run is discarded, the cache keeps nothing."""
    from strategies.kv import PendingBlocks

    prompt = list(range(1000, 1062))
    runs = [prompt + [i * 10 + j for j in range(3)] for i in range(50)] + [prompt[:40], [*prompt[:40], 7]]
    pending = PendingBlocks()
    for keys in runs:
        pending.add(A, keys)
    stored = [len(seg.keys) for seg in _segments(pending, A)]
    assert sum(stored) == 62 + 50 * 3 + 1 and len(stored) == 1 + 1 + 50 + 1  # prompt[:40], prompt[40:], 50 tails, [7]
    assert pending.match([*prompt, 0, 1], A) == 64 and pending.match([*prompt[:40], 7, 8], A) == 41
    assert pending.pending(A)[prompt[0]] == 52 and pending.pending(A)[prompt[50]] == 50
    for keys in runs:
        pending.discard(A, keys)
        pending.discard(A, keys)  # not in flight any more: nothing changes
    assert pending.pending(A) == {} and pending.match(prompt, A) == 0 and not _segments(pending, A)


def _segments(pending: Any, cache: str) -> list[Any]:
    stack, out = list(pending._by_worker.get(cache, {}).values()), []
    while stack:
        seg = stack.pop()
        out.append(seg)
        stack.extend((seg.after or {}).values())
    return out


def test_without_trusted_events_the_prediction_is_the_holdings_of_trie_and_requests_in_flight() -> None:
    """With no worker's events trusted, `predict` takes a short way (no Holding per worker): its figures are
    still those of `holdings`, from the trie and the pending blocks alike."""
    kv, _, pool = strategy([A, B, "http://127.0.0.1:9003"], trusted=[])
    kv.balance.trie.insert(KEYS[:6], A)
    kv.balance.trie.insert(KEYS[:3], B)
    kv.pending.add(B, KEYS[:9])
    kv.pending.add(A, KEYS[:2])
    for blocks, cacheable in ((10, 10 * BS), (10, 4 * BS), (1, BS), (12, 12 * BS)):
        cached, saved = kv.predict(KEYS[:blocks], pool, cacheable)
        held = kv.holdings(KEYS[:blocks], pool, cacheable)
        assert cached == [h.tokens for h in held] and saved == [float(h.tokens) for h in held]
        assert not all(c == 0 for c in cached)


async def test_finished_requests_stop_counting_each_at_the_end_of_its_own_grace() -> None:
    """One timer serves every finished request (not one each): requests finished 150 ms apart stop counting as
    pending one after the other, each once its own grace has passed, and the timer is not left armed."""
    kv, _, pool = strategy([A], trusted=[], kv_pending_grace_s=0.25)
    runs = [KEYS[:4], KEYS[:8], KEYS[:12]]
    decisions = [kv.choose(RouteRequest("m", "/v1/completions", block_keys=keys, prompt_tokens=len(keys) * BS), pool)
                 for keys in runs]
    for i, (keys, decision) in enumerate(zip(runs, decisions, strict=True)):
        if i:
            await asyncio.sleep(0.15)
        kv.on_finished(RouteRequest("m", "/v1/completions", block_keys=keys), decision)
    # 300 ms after the first finished: its grace is over, the others' not yet
    assert kv.pending.match(KEYS, A) == 12 and kv.pending.pending(A)[KEYS[0]] == 2
    await asyncio.sleep(0.15)  # 450 ms: the second's grace over too
    assert kv.pending.match(KEYS, A) == 12 and kv.pending.pending(A)[KEYS[0]] == 1
    await asyncio.sleep(0.2)
    assert kv.pending.match(KEYS, A) == 0 and kv._sweeping is None


def test_without_event_sources_the_one_question_decides_as_asking_each_cache() -> None:
    """`any_sources` false (the gateway's hub has no source) skips asking `trusted` per cache: the decisions, with
    requests in flight and a prefix routed before, are those of the strategy that asks every cache (all untrusted),
    and `trusted` is never asked."""
    asked: list[str] = []

    def untrusted(cache: str) -> bool:
        asked.append(cache)
        return False

    plain, _, pool_a = strategy([A, B, "http://127.0.0.1:9003"])
    plain.attach_kv(InMemoryKvIndex(), lambda cache: False)
    fast, _, pool_b = strategy([A, B, "http://127.0.0.1:9003"])
    fast.attach_kv(InMemoryKvIndex(), untrusted, lambda: False)
    # one fixed time for both: the queues drain with the clock, and the two decisions are made microseconds apart
    plain.balance.clock = fast.balance.clock = lambda: 1000.0
    prompts = [KEYS[:10], KEYS[:6], [*KEYS[:4], 7, 8], KEYS[:10], [9, 10, 11], KEYS[:12]]
    for round_ in range(3):
        for i, keys in enumerate(prompts):
            route = RouteRequest("m", "/v1/completions", token_ids=list(range(len(keys) * BS + 3)),
                                 block_keys=keys, prompt_tokens=len(keys) * BS + 3)
            a, b = plain.choose(route, pool_a), fast.choose(route, pool_b)
            assert (a.worker.url, a.reason, a.predicted_cached_tokens) == (
                b.worker.url, b.reason, b.predicted_cached_tokens), (round_, i)
            if i % 2:  # every other request stays in flight
                a.worker.in_flight += 1
                b.worker.in_flight += 1
    assert not asked


def test_pending_match_each_is_match_per_cache() -> None:
    """`PendingBlocks.match_each` answers what `match` answers for each cache, with each cache's floor."""
    from strategies.kv import PendingBlocks
    pending = PendingBlocks()
    pending.add(A, KEYS[:10])
    pending.add(A, [*KEYS[:4], 7, 8])
    pending.add(B, KEYS[:3])
    caches = [A, B, "http://127.0.0.1:9003"]
    for keys in (KEYS[:12], KEYS[:2], [*KEYS[:4], 7], [5, 6], []):
        for floors in ({}, {A: 2}, {B: 5, A: 11}, {"http://127.0.0.1:9003": 1}):
            assert pending.match_each(keys, caches, floors) == [
                pending.match(keys, cache, floors.get(cache, 0)) for cache in caches], (keys, floors)


# --- exact figures, the index fed as the gateway feeds it -------------------------------------------------------
# Each worker's engine (and tier agent) publishes batches in vLLM's wire format (msgpack, sequence-numbered frames)
# into the hub's own stream recovery and applier; the request's keys are the gateway's chained keys of its tokens.

C = "http://127.0.0.1:9003"
MODEL = "m"
TOKENS = list(range(1000, 1000 + 12 * BS))  # twelve blocks of a prompt
HASHES: dict[str | None, list[BlockHash]] = {  # engine hashes of each root's blocks (alike on every worker)
    None: list(range(100, 112)), "ad": list(range(200, 212)), "tenant-a": list(range(300, 312))}


class Fleet:
    """`kv` as `kvgate serve` assembles it, over a real pool of healthy workers serving MODEL (and the LoRA adapter
    "ad") whose events (engine and agent, each its own source) go through a real `KvEventHub`. The balance's clock
    stands still (`tick` moves it), and its tie-breaking random is seeded."""

    def __init__(self, workers: Sequence[str] = (A, B), seed: int = 0, **options: Any) -> None:
        specs = [WorkerSpec.parse(w) for w in workers]
        _, kv = assemble({"strategy": "kv", "block_size": BS, "worker": specs, **options})
        assert isinstance(kv, KvAware)
        self.kv = kv
        self.now = 1000.0
        kv.balance.clock = lambda: self.now
        kv.balance.random.seed(seed)
        self.upstream = UpstreamPool(limit_per_host=4, connect_timeout=1)
        self.pool = WorkerPool(GatewayConfig(), self.upstream, GatewayMetrics())
        for spec in specs:
            worker = self.pool.add(spec)
            worker.take_listing({MODEL: {}, "ad": {"parent": MODEL}})
            worker.healthy = True
        self.hub = KvEventHub(InMemoryKvIndex(), GatewayMetrics(), self._model_of, block_size=BS)
        kv.attach_kv(self.hub.index, self.hub.trusted, self.hub.any_sources)
        self._seq: dict[EventSource, int] = {}

    def _model_of(self, url: str) -> str | None:
        worker = self.pool.get(url)
        return worker.base_model if worker is not None else None

    @property
    def workers(self) -> list[Worker]:
        return self.pool.eligible(MODEL)

    def worker(self, url: str) -> Worker:
        worker = self.pool.get(url)
        assert worker is not None
        return worker

    async def start(self) -> Fleet:
        """Every worker's engine heard from (an empty first batch): its events are trusted."""
        for w in self.pool.all():
            for rank, _ in w.spec.caches():
                await self.engine(w.url, rank=rank)
        return self

    async def engine(self, url: str, *events: KvEvent, lost: int = 0, rank: int | None = None) -> None:
        """A batch from the engine (of data-parallel rank `rank`)."""
        await self._publish(EventSource(url, "tcp://127.0.0.1:1", dp_rank=rank), events, lost)

    async def agent(self, url: str, *events: KvEvent) -> None:
        await self._publish(EventSource(url, "tcp://127.0.0.1:2", None, "agent"), events, 0)

    async def _publish(self, source: EventSource, events: Sequence[KvEvent], lost: int) -> None:
        """One batch on the wire; `lost`: batches before it that never arrived (no replay can bring them)."""
        seq = self._seq.get(source, 0) + lost
        self._seq[source] = seq + 1
        await self.hub.stream(source).received([b"kv-events", seq.to_bytes(8, "big"), encode_batch(list(events))])

    def tick(self, seconds: float) -> None:
        self.now += seconds

    def holdings(self, tokens: int, lora: str | None = None, salt: str | None = None) -> list[Holding]:
        """Each worker's holding for a prompt of TOKENS[:tokens], its cacheable part as the balance computes it."""
        route = prompt(tokens, lora, salt)
        cacheable = ((tokens - 1) // BS) * BS
        return self.kv.holdings(route.block_keys, self.workers, cacheable)

    def choose(self, tokens: int, lora: str | None = None, salt: str | None = None) -> Decision:
        return self.kv.choose(prompt(tokens, lora, salt), self.workers)

    def close(self) -> None:
        self.upstream.close()


def prompt(tokens: int, lora: str | None = None, salt: str | None = None) -> RouteRequest:
    """A request for TOKENS[:tokens] (of the adapter `lora`, under the tenant's cache salt `salt`), keyed as the
    gateway keys it."""
    ids = TOKENS[:tokens]
    keys = block_keys(ids, BS, root_key(MODEL, lora, salt))
    return RouteRequest(lora or MODEL, "/v1/completions", token_ids=ids, block_keys=keys, prompt_tokens=tokens)


def stored(first: int, last: int, medium: str = GPU, lora: str | None = None, salt: str | None = None) -> BlockStored:
    """Blocks first..last-1 of TOKENS as the engine announces them: token ids, chained to the block before."""
    hashes = HASHES[lora or salt]
    return BlockStored(block_hashes=hashes[first:last], parent_block_hash=hashes[first - 1] if first else None,
                       token_ids=TOKENS[first * BS:last * BS], block_size=BS, medium=medium, lora_name=lora,
                       extra_keys=[[salt]] + [None] * (last - first - 1) if salt else None)


def copied(first: int, last: int, medium: str) -> BlockStored:
    """Blocks first..last-1 as the tier agent announces a copy of them: by the engine's hashes, no token ids."""
    return BlockStored(block_hashes=HASHES[None][first:last], medium=medium, token_ids=[], block_size=BS)


def removed(first: int, last: int, medium: str = GPU) -> BlockRemoved:
    return BlockRemoved(block_hashes=HASHES[None][first:last], medium=medium)


def figures(held: Holding) -> tuple[int, dict[str, int], float, int]:
    """(tokens, by tier, saved rounded to 1e-6, computed)"""
    return held.tokens, held.by_tier, round(held.saved, 6), held.computed


@pytest.mark.parametrize(("costs", "saved"), [
    ({}, 136.0),  # 64 + 32 * 0.9 + 32 * 0.75 + 32 * 0.6
    ({"kv_cost_cpu": 0.2, "kv_cost_disk": 0.5, "kv_cost_shared": 0.75}, 113.6),  # 64 + 32 * (0.8 + 0.5 + 0.25)
])
async def test_a_run_from_the_gpu_down_the_tiers_saves_each_block_at_its_tiers_share(
    costs: dict[str, Any], saved: float,
) -> None:
    """A computed ten blocks; its agent copied 4-5 to DRAM, 6-7 to NVMe, 8-9 to the shared tier, and the engine
    evicted 4-9. Of a prompt of ten blocks and 8 tokens all ten can hit: four at no cost, the rest each at its
    tier's. B holds none of the first block: the shared tier's 8-9 are no leading run of its."""
    fleet = await Fleet(**costs).start()
    await fleet.engine(A, stored(0, 10))
    await fleet.agent(A, copied(4, 6, CPU), copied(6, 8, DISK), copied(8, 10, SHARED))
    await fleet.engine(A, removed(4, 10))
    a, b = fleet.holdings(10 * BS + 8)
    assert figures(a) == (160, {GPU: 64, CPU: 32, DISK: 32, SHARED: 32}, saved, 160)
    assert figures(b) == (0, {}, 0.0, 0) and a.trusted and b.trusted
    assert fleet.kv.predict(prompt(10 * BS + 8).block_keys, fleet.workers, 160) == ([160, 0], [a.saved, 0.0])
    decision = fleet.choose(10 * BS + 8)
    assert (decision.worker.url, decision.reason, decision.predicted_cached_tokens) == (A, "hit", 160)
    fleet.close()


async def test_a_block_on_several_tiers_counts_once_at_its_cheapest() -> None:
    """A's engine holds ten blocks and its agent copies of all ten in DRAM, on NVMe and in the shared tier: they
    save what ten GPU blocks save, not four times that. As the copies go, each block counts at the best tier left;
    B reaches the shared copies only."""
    fleet = await Fleet().start()
    await fleet.engine(A, stored(0, 10))
    await fleet.agent(A, copied(0, 10, CPU), copied(0, 10, DISK), copied(0, 10, SHARED))
    a, b = fleet.holdings(10 * BS + 8)
    assert figures(a) == (160, {GPU: 160}, 160.0, 160)
    assert figures(b) == (160, {SHARED: 160}, 96.0, 160)
    await fleet.engine(A, removed(5, 10))
    assert figures(fleet.holdings(10 * BS + 8)[0]) == (160, {GPU: 80, CPU: 80}, 152.0, 160)
    await fleet.agent(A, removed(7, 10, CPU))
    assert figures(fleet.holdings(10 * BS + 8)[0]) == (160, {GPU: 80, CPU: 32, DISK: 48}, 144.8, 160)
    await fleet.agent(A, removed(7, 10, DISK))
    assert figures(fleet.holdings(10 * BS + 8)[0]) == (160, {GPU: 80, CPU: 32, SHARED: 48}, 137.6, 160)
    fleet.close()


async def test_the_run_ends_at_the_first_block_held_nowhere_and_the_shared_tier_can_bridge_it() -> None:
    """A holds blocks 0-2 on the GPU, 4-9 in DRAM, block 3 nowhere: only the three count. Once B's agent puts block
    3 in the shared tier (reachable from every worker), A's run goes on through its DRAM blocks."""
    fleet = await Fleet().start()
    await fleet.engine(A, stored(0, 10))
    await fleet.agent(A, copied(4, 10, CPU))
    await fleet.engine(A, removed(3, 10))
    a, b = fleet.holdings(10 * BS + 8)
    assert figures(a) == (48, {GPU: 48}, 48.0, 48) and figures(b) == (0, {}, 0.0, 0)
    await fleet.agent(B, copied(3, 4, SHARED))
    a, b = fleet.holdings(10 * BS + 8)
    assert figures(a) == (160, {GPU: 48, SHARED: 16, CPU: 96}, 144.0, 160)
    assert figures(b) == (0, {}, 0.0, 0)
    fleet.close()


async def test_requests_in_flight_count_as_gpu_blocks_on_their_own_worker_until_their_grace_ends() -> None:
    """A holds six blocks in DRAM only; a prompt of ten blocks goes there. While it is in flight (and its grace
    after) its four new blocks count on A as GPU blocks beside the six the index places in DRAM, as computed only by
    the six; B's figures do not move. Once the engine announces the ten, the index speaks for them; blocks it evicts
    while the request is in flight still count (pending), and after the grace only the index speaks."""
    fleet = await Fleet(kv_pending_grace_s=0.05).start()
    await fleet.engine(A, stored(0, 6))
    await fleet.agent(A, copied(0, 6, CPU))
    await fleet.engine(A, removed(0, 6))
    assert figures(fleet.holdings(10 * BS + 8)[0]) == (96, {CPU: 96}, 86.4, 96)
    decision = fleet.choose(10 * BS + 8)
    assert (decision.worker.url, decision.reason, decision.predicted_cached_tokens) == (A, "hit", 96)
    a, b = fleet.holdings(10 * BS + 8)
    assert figures(a) == (160, {CPU: 96, GPU: 64}, 150.4, 96) and figures(b) == (0, {}, 0.0, 0)
    assert figures(fleet.holdings(7 * BS + 8)[0]) == (112, {CPU: 96, GPU: 16}, 102.4, 96)
    await fleet.engine(A, stored(0, 10))
    assert figures(fleet.holdings(10 * BS + 8)[0]) == (160, {GPU: 160}, 160.0, 160)
    await fleet.engine(A, removed(8, 10))
    assert figures(fleet.holdings(10 * BS + 8)[0]) == (160, {GPU: 160}, 160.0, 128)
    fleet.kv.on_finished(prompt(10 * BS + 8), decision)
    assert figures(fleet.holdings(10 * BS + 8)[0]) == (160, {GPU: 160}, 160.0, 128)  # within its grace
    await asyncio.sleep(0.2)
    assert figures(fleet.holdings(10 * BS + 8)[0]) == (128, {GPU: 128}, 128.0, 128)
    fleet.close()


async def test_a_run_longer_than_the_cacheable_prompt_loses_its_last_blocks_not_its_lowest_tier() -> None:
    """vLLM computes a prompt's last token: of a prompt of exactly ten blocks, nine can hit. What does not count is
    the run's tenth block, whatever its tier. The run was trimmed from its lowest tier instead, as if that were
    always its tail: A's DRAM blocks 0-6 before its GPU blocks 7-9 counted as 6 + 3 (134.4 saved, not 132.8), and
    DRAM blocks 0-7 with a request in flight for all ten as 7 + 2 (132.8, not 131.2)."""
    fleet = await Fleet().start()
    await fleet.engine(A, stored(0, 10))
    await fleet.agent(A, copied(0, 7, CPU))
    await fleet.engine(A, removed(0, 7))
    assert figures(fleet.holdings(10 * BS)[0]) == (144, {CPU: 112, GPU: 32}, 132.8, 144)
    assert figures(fleet.holdings(10 * BS + 1)[0]) == (160, {CPU: 112, GPU: 48}, 148.8, 160)
    fleet.close()

    fleet = await Fleet().start()
    await fleet.engine(A, stored(0, 8))
    await fleet.agent(A, copied(0, 8, CPU))
    await fleet.engine(A, removed(0, 8))
    assert fleet.choose(10 * BS).worker.url == A
    assert figures(fleet.holdings(10 * BS)[0]) == (144, {CPU: 128, GPU: 16}, 131.2, 128)
    fleet.close()


@pytest.mark.parametrize(("tokens", "hit"), [
    (10 * BS, 9 * BS), (10 * BS + 1, 10 * BS), (10 * BS + 8, 10 * BS), (11 * BS, 10 * BS), (11 * BS + 1, 11 * BS),
    (12 * BS, 11 * BS), (BS + 1, BS), (BS, 0), (BS - 1, 0), (1, 0),
])
async def test_the_last_prompt_token_is_never_a_hit(tokens: int, hit: int) -> None:
    """A holds all twelve blocks on the GPU: a prompt of n tokens hits (n - 1) // 16 full blocks (vLLM computes the
    last token), a prompt of at most one block none at all."""
    fleet = await Fleet().start()
    await fleet.engine(A, stored(0, 12))
    a, b = fleet.holdings(tokens)
    assert figures(a) == (hit, {GPU: hit} if hit else {}, float(hit), hit) and figures(b) == (0, {}, 0.0, 0)
    decision = fleet.choose(tokens)
    assert decision.predicted_cached_tokens == hit and decision.reason == ("hit" if hit else "miss")
    fleet.close()


async def test_a_prompt_shorter_than_a_block_goes_by_load_and_leaves_nothing_pending() -> None:
    fleet = await Fleet().start()
    await fleet.engine(A, stored(0, 12))
    fleet.worker(A).in_flight = 1
    decision = fleet.choose(BS - 1)
    assert (decision.worker.url, decision.reason, decision.predicted_cached_tokens) == (B, "miss", 0)
    assert fleet.kv.pending.pending(B) == {} and fleet.kv.pending.pending(A) == {}
    fleet.close()


async def test_an_untrusted_worker_is_judged_by_the_trie_and_its_requests_in_flight() -> None:
    """B's stream lost a batch no replay can bring: what it said is dropped and it is judged by the routing trie
    (six blocks sent there), its prediction saving as much as GPU blocks; A (trusted) by its four GPU blocks. B
    wins; the request's ten blocks then count on B as pending."""
    fleet = await Fleet().start()
    await fleet.engine(A, stored(0, 4))
    await fleet.engine(B, stored(0, 10))
    await fleet.engine(B, lost=1)
    assert fleet.hub.trusted(A) and not fleet.hub.trusted(B)
    assert fleet.hub.index.lookup(prompt(10 * BS + 8).block_keys, [B])[B].blocks == 0
    fleet.kv.balance.remember(prompt(6 * BS).block_keys, B)
    a, b = fleet.holdings(10 * BS + 8)
    assert figures(a) == (64, {GPU: 64}, 64.0, 64) and a.trusted
    assert figures(b) == (96, {GPU: 96}, 96.0, 96) and not b.trusted
    decision = fleet.choose(10 * BS + 8)
    assert (decision.worker.url, decision.reason, decision.predicted_cached_tokens) == (B, "hit", 96)
    assert figures(fleet.holdings(10 * BS + 8)[1]) == (160, {GPU: 160}, 160.0, 160)
    fleet.close()


async def test_lora_and_salted_prompts_hit_only_blocks_of_their_own_root() -> None:
    """The same tokens on three workers: A's as the base model's, B's as the adapter "ad"'s, C's under tenant-a's
    cache salt. Each request hits all ten blocks on its own worker and none elsewhere."""
    fleet = await Fleet([A, B, C]).start()
    await fleet.engine(A, stored(0, 10))
    await fleet.engine(B, stored(0, 10, lora="ad"))
    await fleet.engine(C, stored(0, 10, salt="tenant-a"))
    assert fleet.worker(B).key_names("ad") == (MODEL, "ad")
    for (lora, salt), holder in {(None, None): A, ("ad", None): B, (None, "tenant-a"): C,
                                 ("ad", "tenant-a"): None}.items():
        held = fleet.holdings(10 * BS + 8, lora, salt)
        assert [h.tokens for h in held] == [160 if w.url == holder else 0 for w in fleet.workers], (lora, salt)
        if holder is not None:
            decision = fleet.choose(10 * BS + 8, lora, salt)
            assert (decision.worker.url, decision.predicted_cached_tokens) == (holder, 160)
    fleet.close()


@pytest.mark.parametrize("seed", range(4))
async def test_of_equal_scores_the_longer_match_wins_whatever_the_seed(seed: int) -> None:
    """A: eight DRAM blocks at half cost (64 saved), B: four GPU blocks (64 saved): equal scores, and A's match is
    the longer one."""
    fleet = await Fleet(seed=seed, kv_cost_cpu=0.5).start()
    await fleet.engine(A, stored(0, 8))
    await fleet.agent(A, copied(0, 8, CPU))
    await fleet.engine(A, removed(0, 8))
    await fleet.engine(B, stored(0, 4))
    a, b = fleet.holdings(10 * BS + 8)
    assert (a.tokens, a.saved, b.tokens, b.saved) == (128, 64.0, 64, 64.0)
    decision = fleet.choose(10 * BS + 8)
    assert (decision.worker.url, decision.reason, decision.predicted_cached_tokens) == (A, "hit", 128)
    fleet.close()


async def test_of_equal_scores_and_matches_the_worker_with_less_routed_state_wins_then_chance() -> None:
    """A and B hold the same ten blocks. With another prefix routed to A before, B (less state) wins for every seed;
    without, the seeded random decides, and over eight seeds each wins some."""
    other = block_keys(list(range(50_000, 50_000 + 4 * BS)), BS, root_key(MODEL))
    winners = set()
    for seed in range(8):
        for routed_before in (True, False):
            fleet = await Fleet(seed=seed).start()
            await fleet.engine(A, stored(0, 10))
            await fleet.engine(B, stored(0, 10))
            if routed_before:
                fleet.kv.balance.remember(other, A)
            decision = fleet.choose(10 * BS + 8)
            assert (decision.reason, decision.predicted_cached_tokens) == ("hit", 160)
            if routed_before:
                assert decision.worker.url == B, seed
            else:
                winners.add(decision.worker.url)
            fleet.close()
    assert winners == {A, B}


async def test_the_score_is_prefill_queue_and_outstanding_requests_in_prefill_tokens() -> None:
    """A holds the prompt's ten blocks and has two requests outstanding (one in flight, one waiting in its engine):
    A's score is 2 * (168 - 160) + 8 per earlier decision (its queued prefill) + 128 * 2, B's 2 * 168 = 336. A takes
    the first nine requests (the ninth on a tie: 16 + 64 + 256 = 336, the longer match), B the tenth (344 > 336).
    The tenth's blocks then count on B (pending): the eleventh is a hit there (16 + 168 queued against 344)."""
    fleet = await Fleet().start()
    await fleet.engine(A, stored(0, 10))
    a = fleet.worker(A)
    a.in_flight, a.waiting = 1, 1.0
    chosen = [fleet.choose(10 * BS + 8) for _ in range(11)]
    assert [(d.worker.url, d.reason, d.predicted_cached_tokens) for d in chosen] == (
        [(A, "hit", 160)] * 9 + [(B, "spill", 0), (B, "hit", 160)])
    fleet.close()


async def test_a_trusted_worker_the_prefix_was_sent_to_keeps_its_affinity_when_evicted() -> None:
    """A was sent the prefix, and its engine evicted it: A pulls with half (kv_affinity) of the 160 tokens it would
    save, 80, more than B's four GPU blocks save (64): A gets it, a spill (B holds more). Every worker the prefix was
    sent to pulls, each by what it was sent, and the pull stands for what its engine holds only where that saves
    less."""
    fleet = await Fleet().start()
    await fleet.engine(B, stored(0, 4))
    fleet.kv.balance.remember(prompt(10 * BS + 8).block_keys, A)
    a, b = fleet.holdings(10 * BS + 8)
    assert (a.tokens, a.saved, a.affinity, b.tokens, b.saved, b.affinity) == (0, 0.0, 80.0, 64, 64.0, 0.0)
    assert fleet.kv.predict(prompt(10 * BS + 8).block_keys, fleet.workers, 160) == ([0, 64], [80.0, 64.0])
    fleet.kv.balance.remember(prompt(7 * BS).block_keys, B)  # B was sent seven blocks: a pull of 56, under its 64
    a, b = fleet.holdings(10 * BS + 8)
    assert (a.saved, a.affinity, b.saved, b.affinity) == (0.0, 80.0, 64.0, 56.0)
    assert fleet.kv.predict(prompt(10 * BS + 8).block_keys, fleet.workers, 160) == ([0, 64], [80.0, 64.0])
    decision = fleet.choose(10 * BS + 8)
    assert (decision.worker.url, decision.reason, decision.predicted_cached_tokens) == (A, "spill", 0)
    fleet.close()


async def test_a_data_parallel_rank_holding_the_prefix_is_named_and_its_requests_pend_on_it_alone() -> None:
    """A's rank 1 announced four blocks, B six: B wins (96 against 64). A's rank 0, then, six (of ten it had): A
    wins as rank 0, and the request's blocks pend on A#dp0 only, until their grace ends."""
    fleet = await Fleet([A + ";dp_ranks=2", B], kv_pending_grace_s=0.05).start()
    assert fleet.hub.trusted(cache_name(A, 0)) and fleet.hub.trusted(cache_name(A, 1))
    await fleet.engine(A, stored(0, 4), rank=1)
    await fleet.engine(B, stored(0, 6))
    decision = fleet.choose(10 * BS + 8)
    assert (decision.worker.url, decision.dp_rank, decision.predicted_cached_tokens) == (B, None, 96)
    await fleet.engine(A, stored(0, 10), rank=0)
    await fleet.engine(A, removed(6, 10), rank=0)
    a, _ = fleet.holdings(10 * BS + 8)
    assert (a.rank, a.tokens) == (0, 96)
    fleet.worker(B).in_flight = 1  # B: 2 * 8 (the first request pends there) + 72 queued + 128; A: 2 * 72
    decision = fleet.choose(10 * BS + 8)
    assert (decision.worker.url, decision.dp_rank, decision.predicted_cached_tokens) == (A, 0, 96)
    held = {cache: fleet.kv.pending.match(prompt(10 * BS + 8).block_keys, cache)
            for cache in (cache_name(A, 0), cache_name(A, 1), A)}
    assert held == {cache_name(A, 0): 10, cache_name(A, 1): 0, A: 0}
    fleet.kv.on_finished(prompt(10 * BS + 8), decision)
    await asyncio.sleep(0.2)
    assert fleet.kv.pending.match(prompt(10 * BS + 8).block_keys, cache_name(A, 0)) == 0
    fleet.close()


async def test_only_the_workers_the_pool_lets_take_requests_are_scored() -> None:
    """A holds the prompt; drained (removed with a request in flight), then unhealthy, it is not among the workers
    `kv` scores, and the request is a miss elsewhere."""
    fleet = await Fleet([A, B, C]).start()
    await fleet.engine(A, stored(0, 10))
    assert fleet.choose(10 * BS + 8).worker.url == A
    fleet.pool.acquire(fleet.worker(A))
    fleet.pool.remove(A)
    assert [w.url for w in fleet.workers] == [B, C]
    decision = fleet.choose(10 * BS + 8)
    assert decision.worker.url in (B, C) and (decision.reason, decision.predicted_cached_tokens) == ("miss", 0)
    fleet.worker(A).draining, fleet.worker(A).healthy = False, False
    assert A not in [w.url for w in fleet.workers]
    fleet.pool.release(fleet.worker(A))
    fleet.close()
