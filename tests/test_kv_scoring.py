"""`kv`'s own scoring, decision by decision: what each tier's blocks save, that only the leading run counts, how
requests in flight stand in for KV events not yet arrived, how untrusted workers fall back to the trie, and which
data-parallel rank a decision names. The strategy as `kvgate serve` assembles it, over the real in-process index."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from kvcore.kv_events import CPU, DISK, GPU, SHARED
from kvgate.serve import assemble
from router.config import WorkerSpec
from router.kv_index import InMemoryKvIndex
from router.kv_transport import cache_name
from router.pool import Worker
from router.routing import RouteRequest
from strategies.kv import KvAware

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
