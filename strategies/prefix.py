"""`prefix`: send each request where its prefix was sent before, unless the queue there costs more than the
prefix saves.

Every eligible worker gets one score, in prefill tokens (lower wins):

    score = prefill_weight * (prompt tokens - predicted cached tokens)   the prefill this request needs there
          + queued prefill tokens                                        what it waits behind (a draining estimate)
          + request_cost_tokens * (in-flight + engine-waiting)           everything else the worker is busy with

The predicted cached tokens come from the `PrefixTrie` of recent routing decisions (approximate mode). Prefill
weighs more than queue (`prefill_weight`, default 2) because it costs twice: this request waits for it, and the
fleet spends the compute (and the cache space) that every later request on that worker waits behind. A match
therefore wins exactly while the prefill it saves outweighs the extra queue it joins: a hot prefix stays on its
worker while that worker has headroom and spills to a second (then third) worker when the queue there outgrows
the saving; a prefix shared by the whole traffic (one global system prompt) counts the same on every worker that
has it, so load decides among them, and a short shared first block saves too little to outweigh any queue.
Misses go to the least-loaded worker. Ties go to the longest match, then to the worker holding the least cached
prefix state (so distinct prefix groups spread), then at random.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from collections.abc import Callable, Sequence

from router.config import GatewayConfig
from router.metrics import GatewayMetrics
from router.pool import Worker
from router.prefix_trie import PrefixTrie
from router.routing import Decision, RouteRequest, Strategy

HIT, SPILL, MISS = "hit", "spill", "miss"


class PrefillQueue:
    """Prefill tokens sent to one worker and not yet worked off, drained at an assumed constant rate."""

    __slots__ = ("at", "rate", "tokens")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = 0.0
        self.at = 0.0

    def level(self, now: float) -> float:
        return max(0.0, self.tokens - self.rate * (now - self.at))

    def add(self, tokens: float, now: float) -> None:
        self.tokens = self.level(now) + tokens
        self.at = now


class PrefixAffinity(Strategy):
    name = "prefix"
    needs_prompt_tokens = True

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self.trie = PrefixTrie(config.prefix_trie_max_nodes, config.prefix_trie_ttl_s)
        self.block_size = config.block_size
        self.request_cost = config.prefix_request_cost_tokens
        self.prefill_weight = config.prefix_prefill_weight
        self._queues: dict[str, PrefillQueue] = {}
        self._metrics: GatewayMetrics | None = None
        self._evictions = 0
        self._expirations = 0
        self._random = random.Random()
        self.clock: Callable[[], float] = time.monotonic  # injectable: tests freeze it

    def attach_metrics(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        metrics.trie_node_bytes.set(measure_node_bytes())

    def _queue(self, url: str) -> PrefillQueue:
        queue = self._queues.get(url)
        if queue is None:
            queue = self._queues[url] = PrefillQueue(self.config.prefix_prefill_tokens_per_s)
        return queue

    def score(self, worker: Worker, uncached_tokens: int, now: float) -> float:
        return (self.prefill_weight * uncached_tokens + self._queue(worker.url).level(now)
                + self.request_cost * worker.outstanding)

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        now = self.clock()
        keys = request.block_keys
        bs = self.block_size
        prompt = max(request.prompt_tokens, len(keys) * bs)
        # vLLM always computes a prompt's last token, so a fully cached prompt still hits one block short
        cacheable = ((prompt - 1) // bs) * bs if prompt > 0 else 0
        cached, saved = self.predict(keys, workers, cacheable)
        scores = [self.score(w, prompt - round(v), now) for w, v in zip(workers, saved, strict=True)]
        best = min(scores)
        tied = [i for i, s in enumerate(scores) if s <= best + 1e-9]
        if len(tied) > 1:
            longest_tied = max(cached[i] for i in tied)
            tied = [i for i in tied if cached[i] == longest_tied]
        if len(tied) > 1:
            least_state = min(self.trie.worker_nodes(workers[i].url) for i in tied)
            tied = [i for i in tied if self.trie.worker_nodes(workers[i].url) == least_state]
        pick = tied[0] if len(tied) == 1 else self._random.choice(tied)
        worker, predicted = workers[pick], cached[pick]
        longest = max(cached)
        reason = MISS if longest == 0 else HIT if predicted >= longest else SPILL
        # Recorded now rather than once the worker answers: a burst of one prefix must see its own first
        # request, or every request of the burst would be a miss.
        self._queue(worker.url).add(prompt - predicted, now)
        if keys:
            self.remember(keys, worker.url)
        self._record(prompt, predicted)
        return Decision(worker, reason, predicted)

    def predict(self, keys: Sequence[int], workers: Sequence[Worker], cacheable: int) -> tuple[list[int], list[float]]:
        """Per worker: the prompt tokens predicted cached there, and the prefill tokens that saves."""
        matched = self.trie.match(keys) if keys else {}
        cached = [min(matched.get(w.url, 0) * self.block_size, cacheable) for w in workers]
        return cached, [float(c) for c in cached]

    def remember(self, keys: Sequence[int], worker: str) -> None:
        """The request with these block keys was sent to `worker`."""
        self.trie.insert(keys, worker)

    def _record(self, prompt: int, predicted: int) -> None:
        metrics = self._metrics
        if metrics is None:
            return
        if prompt:
            metrics.prefix_match_ratio.labels(self.name).observe(predicted / prompt)
            metrics.routed_prompt_tokens.labels(self.name).inc(prompt)
            metrics.predicted_cached_tokens.labels(self.name).inc(predicted)
        trie = self.trie
        metrics.trie_nodes.set(len(trie))
        if trie.evictions != self._evictions:
            metrics.trie_evictions.labels("capacity").inc(trie.evictions - self._evictions)
            self._evictions = trie.evictions
        if trie.expirations != self._expirations:
            metrics.trie_evictions.labels("ttl").inc(trie.expirations - self._expirations)
            self._expirations = trie.expirations

    def forget_worker(self, url: str) -> None:
        self.trie.forget_worker(url)
        self._queues.pop(url, None)
        if self._metrics is not None:
            self._metrics.trie_nodes.set(len(self.trie))


def measure_node_bytes(prompts: int = 40, blocks: int = 100, workers: int = 4) -> float:
    """Memory one trie node takes (trie node, index entry, worker map), measured with tracemalloc on a
    throwaway trie; skipped (0) when something else is already tracing."""
    if tracemalloc.is_tracing():
        return 0.0
    rng = random.Random(0)
    prompt_keys = [[rng.getrandbits(64) for _ in range(blocks)] for _ in range(prompts)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trie = PrefixTrie(max_nodes=prompts * blocks, ttl_s=3600.0)
        for i, keys in enumerate(prompt_keys):
            for w in range(workers if i % 2 == 0 else 1):
                trie.insert(keys, f"http://worker-{w}:8000")
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / max(1, len(trie))
