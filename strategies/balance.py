"""The prefill balance `prefix` and `kv` share: send each request where its prefix is cached, unless the queue
there costs more than the prefix saves.

Every eligible worker gets one score, in prefill tokens (lower wins):

    score = prefill_weight * (prompt tokens - predicted saved tokens)    the prefill this request needs there
          + queued prefill tokens                                        what it waits behind (a draining estimate)
          + request_cost_tokens * (in-flight + engine-waiting)           everything else the worker is busy with

The prediction is the strategy's (`prefix`: the trie of recent routing decisions; `kv`: the KV block index, the
trie where the index cannot be trusted). Prefill weighs more than queue (`prefill_weight`, default 2) because it
costs twice: this request waits for it, and the fleet spends the compute (and the cache space) that every later
request on that worker waits behind. A match therefore wins exactly while the prefill it saves outweighs the
extra queue it joins: a hot prefix stays on its worker while that worker has headroom and spills to a second
(then third) worker when the queue there outgrows the saving; a prefix shared by the whole traffic (one global
system prompt) counts the same on every worker that has it, so load decides among them, and a short shared first
block saves too little to outweigh any queue. Misses go to the least-loaded worker. Ties go to the longest match,
then to the worker holding the least cached prefix state (so distinct prefix groups spread), then at random.
Every decision is remembered in the trie (with `--processes N`, every process's: router/sibling_routes.py). What
the trie must then remove (past its node budget, or its TTL) is removed in slices between other work on the event
loop, not inside the decision (`TRIM_WORK`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvcore.config import option
from router.metrics import Counter, Gauge, Histogram
from router.pool import Worker
from router.prefix_trie import PrefixTrie
from router.routing import Decision, Placement, RouteRequest

HIT, SPILL, MISS = "hit", "spill", "miss"
# the trie's removals run in slices, one per loop turn, each about TRIM_SLICE_S of work (in steps of TRIM_WORK nodes
# removed or leaves looked at, a step of two-block leaves about 0.1 ms of CPU in process): one cold 32,000-character
# prompt's 608 new nodes evicted ~300 two-block leaves of earlier questions inside its decision at the budget, 2.5
# ms of CPU, `/health` waiting behind them (issue 18); a slice must also keep up with cold prompts arriving, or the
# trie reaches its ceiling and inserts evict inline again
TRIM_WORK = 32
TRIM_SLICE_S = 0.001
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# (keys, workers, cacheable prompt tokens) -> per worker: tokens predicted cached there, prefill tokens saved
Prediction = Callable[[Sequence[int], Sequence[Worker], int], tuple[list[int], list[float]]]


@dataclass(frozen=True)
class PrefixOptions:
    """The settings of the prefill balance and its trie (`prefix`, and `kv` too)."""

    prefix_trie_max_nodes: int = option(500_000, "most prefix-trie nodes (one per block); LRU leaves go first")
    prefix_trie_ttl_s: float = option(600.0, "seconds a worker is assumed to keep a prefix it was sent")
    prefix_request_cost_tokens: float = option(
        128.0, "prefix: cost of each outstanding request on a worker, in prefill tokens"
    )
    prefix_prefill_weight: float = option(
        2.0, "prefix: weight of the prefill a request needs on a worker against the queue it joins there"
    )
    prefix_prefill_tokens_per_s: float = option(
        20000.0, "prefix: rate at which a worker's queued prefill tokens are assumed to drain"
    )


class PrefixMetrics:
    """What the balance exports, on the gateway's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.match_ratio = Histogram(
            "kvgate_prefix_match_ratio", "Share of the prompt's tokens predicted cached on the chosen worker",
            ["strategy"], buckets=RATIO_BUCKETS, registry=r,
        )
        self.predicted_cached_tokens = Counter(
            "kvgate_predicted_cached_tokens", "Prompt tokens predicted to be cached on the chosen worker",
            ["strategy"], registry=r,
        )
        self.routed_prompt_tokens = Counter(
            "kvgate_routed_prompt_tokens", "Prompt tokens of routed requests (the denominator of the hit rate)",
            ["strategy"], registry=r,
        )
        self.trie_nodes = Gauge("kvgate_prefix_trie_nodes", "Nodes (blocks) in the prefix trie", registry=r)
        self.trie_evictions = Counter(
            "kvgate_prefix_trie_evictions", "Prefix-trie nodes removed, by reason (capacity, ttl)", ["reason"],
            registry=r,
        )


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


class PrefillBalance:
    """Scores the workers for a request with a strategy's prediction, picks one, and remembers the choice."""

    def __init__(self, options: PrefixOptions, block_size: int, strategy: str) -> None:
        self.trie = PrefixTrie(options.prefix_trie_max_nodes, options.prefix_trie_ttl_s)
        # an insert may leave up to one longest prompt's nodes over the budget for the slices (`_trim`) to remove
        self.trie.slack = self.trie.max_path
        self._trimming = False  # a slice is scheduled on the event loop
        self.block_size = block_size
        self.strategy = strategy  # the metrics' label
        self.request_cost = options.prefix_request_cost_tokens
        self.prefill_weight = options.prefix_prefill_weight
        self._drain_rate = options.prefix_prefill_tokens_per_s
        self._queues: dict[str, PrefillQueue] = {}
        self._metrics: PrefixMetrics | None = None
        self._evictions = 0
        self._expirations = 0
        self.random = random.Random()
        self.clock: Callable[[], float] = time.monotonic  # injectable: tests and the virtual-time fleet set it

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self._metrics = metrics = PrefixMetrics(registry)
        # this strategy's children, bound once
        self._match_ratio = metrics.match_ratio.labels(self.strategy)
        self._routed_tokens = metrics.routed_prompt_tokens.labels(self.strategy)
        self._predicted_tokens = metrics.predicted_cached_tokens.labels(self.strategy)
        metrics.trie_nodes.set_function(lambda: len(self.trie))  # read when scraped

    def _queue(self, url: str) -> PrefillQueue:
        queue = self._queues.get(url)
        if queue is None:
            queue = self._queues[url] = PrefillQueue(self._drain_rate)
        return queue

    def choose(self, request: RouteRequest, workers: Sequence[Worker], predict: Prediction) -> Decision:
        now = self.clock()
        keys = request.block_keys
        bs = self.block_size
        prompt = max(request.prompt_tokens, len(keys) * bs)
        # vLLM always computes a prompt's last token, so a fully cached prompt still hits one block short
        cacheable = ((prompt - 1) // bs) * bs if prompt > 0 else 0
        cached, saved = predict(keys, workers, cacheable)
        # each worker's score (the module's docstring), written out: a method call per worker cost more than the sum
        # (`PrefillQueue.level` and `Worker.outstanding` inline: a call per worker cost more than the arithmetic)
        weight, cost, queues = self.prefill_weight, self.request_cost, self._queues
        scores = []
        for w, v in zip(workers, saved, strict=True):
            queue = queues.get(w.spec.url)
            queued = 0.0 if queue is None else queue.tokens - queue.rate * (now - queue.at)
            scores.append(weight * (prompt - round(v)) + (queued if queued > 0.0 else 0.0)
                          + cost * (w.in_flight + w.sibling_in_flight + w.waiting))
        best = min(scores)
        tied = [i for i, s in enumerate(scores) if s <= best + 1e-9]
        if len(tied) > 1:
            longest_tied = max(cached[i] for i in tied)
            tied = [i for i in tied if cached[i] == longest_tied]
        if len(tied) > 1:
            least_state = min(self.trie.worker_nodes(workers[i].url) for i in tied)
            tied = [i for i in tied if self.trie.worker_nodes(workers[i].url) == least_state]
        pick = tied[0] if len(tied) == 1 else self.random.choice(tied)
        worker, predicted = workers[pick], cached[pick]
        longest = max(cached)
        reason = MISS if longest == 0 else HIT if predicted >= longest else SPILL
        self.record(prompt, predicted)
        # the caller places it (`place`) once it knows the rank: recorded now rather than once the worker
        # answers, as a burst of one prefix must see its own first request, or every request of the burst would
        # be a miss
        placement = Placement(worker.spec.url, None, keys if isinstance(keys, list) else list(keys), prompt,
                              predicted, len(workers), request.stream, request.max_tokens)
        return Decision(worker, reason, predicted, placement=placement)

    def place(self, placement: Placement) -> None:
        """A request in flight on its worker (this process's choice, or a sibling's): its prefill queued there, its
        prefix remembered there."""
        now = self.clock()
        url = placement.worker
        # `_queue` and `PrefillQueue.add` written out: two calls per request
        queue = self._queues.get(url) or self._queue(url)
        level = queue.tokens - queue.rate * (now - queue.at)
        queue.tokens = (level if level > 0.0 else 0.0) + (placement.prompt - placement.cached)
        queue.at = now
        self.remember(placement.keys, url)

    def remember(self, keys: Sequence[int], worker: str) -> None:
        """Put a decision in the trie (`keys` sent to `worker`), and have what that puts past its budget or TTL
        removed: every strategy's inserts go through here, or the trie's slack would stay over its budget and its
        expired prefixes would stay predicted."""
        if keys:
            self.trie.insert(keys, worker)
            if self.trie.trim_due and not self._trimming:
                self._trim_soon()

    def _trim_soon(self) -> None:
        """Have the trie's removals done in slices on the running event loop; without one (a simulation calling
        `choose` directly), all of them now, as an insert without slack does."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.trie.trim()
            return
        self._trimming = True
        loop.call_soon(self._trim, loop)

    def _trim(self, loop: asyncio.AbstractEventLoop) -> None:
        """One slice of the trie's removals; the next one after the loop has polled for I/O again."""
        end = time.perf_counter() + TRIM_SLICE_S
        while self.trie.trim(TRIM_WORK):
            if time.perf_counter() >= end:
                loop.call_soon(self._trim, loop)
                return
        self._trimming = False

    def trie_prediction(self, keys: Sequence[int], workers: Sequence[Worker],
                        cacheable: int) -> tuple[list[int], list[float]]:
        """The trie's guess: the prompt tokens last sent to each worker are cached there, and save as much."""
        matched = self.trie.match(keys) if keys else None
        if not matched:
            return [0] * len(workers), [0.0] * len(workers)
        bs = self.block_size
        cached = [min(matched.get(w.spec.url, 0) * bs, cacheable) for w in workers]
        return cached, [float(c) for c in cached]

    def record(self, prompt: int, predicted: int) -> None:
        """Count one decision in the metrics (prompt and predicted cached tokens) and the trie's removals."""
        metrics = self._metrics
        if metrics is None:
            return
        if prompt:
            self._match_ratio.observe(predicted / prompt)
            self._routed_tokens.inc(prompt)
            self._predicted_tokens.inc(predicted)
        trie = self.trie
        if trie.evictions != self._evictions:
            metrics.trie_evictions.labels("capacity").inc(trie.evictions - self._evictions)
            self._evictions = trie.evictions
        if trie.expirations != self._expirations:
            metrics.trie_evictions.labels("ttl").inc(trie.expirations - self._expirations)
            self._expirations = trie.expirations

    def forget_worker(self, url: str) -> None:
        self.trie.forget_worker(url)
        self._queues.pop(url, None)
