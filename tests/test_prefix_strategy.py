"""The `prefix` strategy's balance rule, on real Worker objects: hits, spills, misses, spreading, a shared head."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.metrics import GatewayMetrics
from router.pool import Worker
from router.routing import RouteRequest
from strategies import STRATEGIES, create_strategy
from strategies.balance import HIT, MISS, SPILL
from strategies.prefix import PrefixAffinity

BS = 16
ROOT = root_key("tiny")


def make(n: int = 4, **options: Any) -> tuple[PrefixAffinity, list[Worker]]:
    config = GatewayConfig(strategy="prefix", block_size=BS)
    strategy = create_strategy(config, **options)
    assert isinstance(strategy, PrefixAffinity)
    strategy.balance.clock = lambda: 1000.0  # frozen: queued prefill drains only when a test moves time
    workers = [Worker(spec=WorkerSpec(f"http://127.0.0.1:{9000 + i}"), healthy=True, models=frozenset({"tiny"}))
               for i in range(n)]
    return strategy, workers


def request(tokens: list[int]) -> RouteRequest:
    return RouteRequest(model="tiny", path="/v1/completions",
                        token_ids=tokens, block_keys=block_keys(tokens, BS, ROOT), prompt_tokens=len(tokens))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def test_registered() -> None:
    assert STRATEGIES["prefix"] == "strategies.prefix:PrefixAffinity"
    assert PrefixAffinity.needs_prompt_tokens


def test_repeat_goes_back_to_the_worker_that_has_the_prefix() -> None:
    strategy, workers = make()
    system = tokens(1, 800)
    first = strategy.choose(request(system + tokens(2, 50)), workers)
    assert first.reason == MISS and first.predicted_cached_tokens == 0
    second = strategy.choose(request(system + tokens(3, 50)), workers)
    assert second.reason == HIT and second.worker is first.worker
    assert second.predicted_cached_tokens == 800


def test_predicted_tokens_leave_the_last_token_to_compute() -> None:
    strategy, workers = make()
    prompt = tokens(1, 4 * BS)
    strategy.choose(request(prompt), workers)
    again = strategy.choose(request(prompt), workers)
    assert again.predicted_cached_tokens == 3 * BS  # vLLM recomputes the final block of a fully cached prompt


def test_hot_prefix_stays_while_there_is_headroom_then_spills_to_more_workers() -> None:
    strategy, workers = make()
    system = tokens(1, 2000)
    placed: list[Worker] = []
    reasons: list[str] = []
    for i in range(48):  # a burst: nothing finishes, so every request adds to its worker's load
        decision = strategy.choose(request(system + tokens(100 + i, 40)), workers)
        decision.worker.in_flight += 1
        placed.append(decision.worker)
        reasons.append(decision.reason)
    # the first few stay on the first worker, which holds the prefix
    assert len(set(placed[:4])) == 1
    # under the burst it spills to every worker, then each of them is a hit
    assert len(set(placed)) == 4
    assert SPILL in reasons
    counts = Counter(w.url for w in placed)
    assert max(counts.values()) - min(counts.values()) <= 6, counts
    assert reasons[-8:].count(HIT) >= 6


def test_light_load_keeps_the_hot_prefix_on_one_worker() -> None:
    strategy, workers = make()
    system = tokens(1, 2000)
    placed = set()
    for i in range(30):  # one at a time: each request finished before the next arrives
        decision = strategy.choose(request(system + tokens(100 + i, 40)), workers)
        placed.add(decision.worker.url)
    assert len(placed) == 1


def test_distinct_prefix_groups_spread_over_the_fleet() -> None:
    strategy, workers = make()
    groups = [tokens(g, 1000) for g in range(8)]
    owner: dict[int, str] = {}
    for g, prefix in enumerate(groups):  # sequential, idle fleet: only cached state tells workers apart
        owner[g] = strategy.choose(request(prefix + tokens(50 + g, 30)), workers).worker.url
    assert Counter(owner.values()) == Counter({w.url: 2 for w in workers})
    for g, prefix in enumerate(groups):  # and each group sticks to its worker
        decision = strategy.choose(request(prefix + tokens(500 + g, 30)), workers)
        assert decision.reason == HIT and decision.worker.url == owner[g]


def test_one_shared_first_block_does_not_pull_everything_to_one_worker() -> None:
    strategy, workers = make()
    head = tokens(1, BS)  # the global system prompt fills one block; the rest is unique per request
    placed: list[str] = []
    for i in range(40):
        decision = strategy.choose(request(head + tokens(1000 + i, 600)), workers)
        decision.worker.in_flight += 1
        placed.append(decision.worker.url)
    counts = Counter(placed)
    assert len(counts) == 4 and max(counts.values()) <= 11, counts


def test_misses_go_to_the_least_loaded_and_break_ties_at_random() -> None:
    _, workers = make()
    workers[0].in_flight, workers[1].in_flight, workers[2].waiting, workers[3].in_flight = 3, 1, 1, 2
    seen: Counter[str] = Counter()
    for i in range(60):
        strategy, _ = make()  # a fresh gateway each time: no cached state, no queued prefill
        seen[strategy.choose(request(tokens(i, 100)), workers).worker.url] += 1
    assert set(seen) == {workers[1].url, workers[2].url}  # the two with one outstanding request
    assert min(seen.values()) >= 15  # both picked: ties are random, not "first in the list"


def test_queue_cost_outweighs_a_short_match() -> None:
    strategy, workers = make(2)
    prompt = tokens(1, 64)
    first = strategy.choose(request(prompt + tokens(2, 10)), workers)
    first.worker.in_flight = 3  # 3 x 128 tokens of queue cost > 64 tokens saved
    decision = strategy.choose(request(prompt + tokens(3, 10)), workers)
    assert decision.worker is not first.worker and decision.reason == SPILL


def test_forget_worker_purges_and_metrics_are_recorded() -> None:
    strategy, workers = make()
    registry = GatewayMetrics().registry
    strategy.register_metrics(registry)
    prompt = tokens(1, 320)
    first = strategy.choose(request(prompt), workers)
    strategy.choose(request(prompt), workers)
    assert registry.get_sample_value("kvgate_prefix_trie_nodes") == 20
    assert registry.get_sample_value("kvgate_predicted_cached_tokens_total", {"strategy": "prefix"}) == 19 * BS
    strategy.forget_worker(first.worker.url)
    assert len(strategy.balance.trie) == 0
    assert registry.get_sample_value("kvgate_prefix_trie_nodes") == 0
    rest = [w for w in workers if w is not first.worker]
    assert strategy.choose(request(prompt), rest).reason == MISS


def test_queued_prefill_drains_with_time() -> None:
    strategy, workers = make(2)
    now = [1000.0]
    strategy.balance.clock = lambda: now[0]
    system = tokens(1, 1000)
    first = strategy.choose(request(system + tokens(2, 40)), workers)
    for _ in range(3):  # three cold prompts queued behind it on the same worker...
        strategy.balance._queue(first.worker.url).add(2000, now[0])
    assert strategy.choose(request(system + tokens(3, 40)), workers).reason == SPILL  # ...so it spills
    now[0] += 1.0  # a second later the 20,000 tokens/s estimate has drained both queues
    decision = strategy.choose(request(system + tokens(4, 40)), workers)
    assert decision.reason == HIT and decision.predicted_cached_tokens >= 992


def _questions_under_system_prompts(strategy: PrefixAffinity, workers: list[Worker], budget: int) -> None:
    """Fill the trie to its budget as chat traffic does: shared system prompts, each request's question a two-block
    leaf of its own under one."""
    systems = [tokens(s, 4 * BS) for s in range(8)]
    i = 0
    while len(strategy.balance.trie) < budget:
        strategy.choose(request(systems[i % 8] + tokens(1000 + i, 2 * BS)), workers)
        i += 1


def test_a_cold_long_prompt_at_the_budget_evicts_in_slices_between_loop_turns(monkeypatch: Any) -> None:
    """Issue 18: at the node budget a cold 32,000-character prompt's 608 new nodes evicted about 300 two-block leaves
    inside its decision (2.5 ms of CPU in process, the event loop and `/health` waiting). They are removed in slices,
    one per loop turn, so other callbacks (a `/health` request's) run between them; each slice takes steps of
    TRIM_WORK until its time is up (no time at all here: one step a turn)."""
    import asyncio

    from strategies import balance
    from strategies.balance import TRIM_WORK

    monkeypatch.setattr(balance, "TRIM_SLICE_S", 0.0)
    budget = 8 * 608  # a prompt may take an eighth of it
    strategy, workers = make(prefix_trie_max_nodes=budget)
    trie = strategy.balance.trie

    async def main() -> list[int]:
        _questions_under_system_prompts(strategy, workers, budget)
        assert len(trie) <= budget
        evicted = trie.evictions
        strategy.choose(request(tokens(99, 608 * BS)), workers)  # cold: 608 blocks, none in the trie
        assert trie.evictions == evicted and len(trie) > budget  # nothing removed inside the decision
        per_turn: list[int] = []
        while len(trie) > budget:  # what each loop turn removed: one slice between other callbacks
            before = trie.evictions
            await asyncio.sleep(0)
            per_turn.append(trie.evictions - before)
        return per_turn

    per_turn = asyncio.run(main())
    assert sum(per_turn) >= 608 and len(per_turn) >= 608 // TRIM_WORK
    assert max(per_turn) <= TRIM_WORK, per_turn
    trie.check()


def test_without_an_event_loop_the_decision_evicts_as_it_goes() -> None:
    """A simulation calls `choose` with no loop running: the trie stays within its budget after every decision."""
    budget = 2000
    strategy, workers = make(prefix_trie_max_nodes=budget)
    _questions_under_system_prompts(strategy, workers, budget)
    for i in range(5):
        strategy.choose(request(tokens(200 + i, 300 * BS)), workers)
        assert len(strategy.balance.trie) <= budget
    strategy.balance.trie.check()
