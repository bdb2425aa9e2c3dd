"""`kv`: route by the blocks each worker really holds, as its engine's (and tier agent's) KV events say.

The score is the `prefix` strategy's (see strategies/prefix.py) — prefill a request needs on a worker against
the queue it joins there — with the saving taken from the KV block index instead of from past routing:

    saved tokens = block_size * ( GPU blocks * 1
                                + CPU blocks    * (1 - kv_cost_cpu)      the tier agent's DRAM
                                + DISK blocks   * (1 - kv_cost_disk)     its NVMe
                                + SHARED blocks * (1 - kv_cost_shared) ) the fleet-shared tier, reachable by all

counting the leading run of the prompt's blocks a worker holds (each block at the cheapest tier it is on).
Requests routed in the last `kv_pending_ttl_s` whose events have not arrived yet count as GPU blocks on their
worker (a short-TTL trie), so a burst of requests with one new prefix does not scatter before the first one's
events arrive. Workers without an event source, or whose event stream had a gap the replay could not repair,
are judged by the approximate trie of routing decisions, exactly as `prefix` judges them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.config import GatewayConfig
from router.kv_index import CPU, DISK, GPU, SHARED, KvBlockIndex
from router.pool import Worker
from router.prefix_trie import PrefixTrie
from strategies.prefix import PrefixAffinity


class KvAware(PrefixAffinity):
    name = "kv"
    uses_kv_events = True

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self.pending = PrefixTrie(max_nodes=200_000, ttl_s=config.kv_pending_ttl_s)
        self.saving = {GPU: 1.0, CPU: 1.0 - config.kv_cost_cpu, DISK: 1.0 - config.kv_cost_disk,
                       SHARED: 1.0 - config.kv_cost_shared}
        self.index: KvBlockIndex | None = None
        self._trusted: Callable[[str], bool] = lambda url: False

    def attach_kv(self, index: KvBlockIndex, trusted: Callable[[str], bool]) -> None:
        self.index = index
        self._trusted = trusted

    def predict(self, keys: Sequence[int], workers: Sequence[Worker], cacheable: int) -> tuple[list[int], list[float]]:
        if not keys:
            return [0] * len(workers), [0.0] * len(workers)
        bs = self.block_size
        known = [w.url for w in workers if self._trusted(w.url)]
        runs = self.index.lookup(keys, known) if self.index is not None and known else {}
        pending = self.pending.match(keys)
        guessed = self.trie.match(keys) if len(known) < len(workers) else {}
        cached: list[int] = []
        saved: list[float] = []
        for worker in workers:
            run = runs.get(worker.url)
            if run is None:  # no trustworthy events: the approximate trie, as `prefix` does
                blocks = max(guessed.get(worker.url, 0), pending.get(worker.url, 0))
                tokens = min(blocks * bs, cacheable)
                cached.append(tokens)
                saved.append(float(tokens))
                continue
            fresh = pending.get(worker.url, 0)
            if fresh > run.blocks:  # routed there just now: count the blocks its events will announce
                gain = {GPU: fresh - run.blocks}
                blocks, by_tier = fresh, {**run.by_tier, GPU: run.by_tier.get(GPU, 0) + gain[GPU]}
            else:
                blocks, by_tier = run.blocks, run.by_tier
            tokens = min(blocks * bs, cacheable)
            weight = sum(self.saving[tier] * n for tier, n in by_tier.items()) / blocks if blocks else 0.0
            cached.append(tokens)
            saved.append(tokens * weight)
        return cached, saved

    def remember(self, keys: Sequence[int], worker: str) -> None:
        super().remember(keys, worker)
        self.pending.insert(keys, worker)

    def forget_worker(self, url: str) -> None:
        super().forget_worker(url)
        self.pending.forget_worker(url)
