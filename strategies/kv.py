"""`kv`: route by the blocks each worker really holds, as its engine's (and tier agent's) KV events say.

The score is the prefill balance `prefix` uses too (strategies/balance.py) — prefill a request needs on a worker
against the queue it joins there — with the saving taken from the KV block index instead of from past routing:

    saved tokens = block_size * ( GPU blocks * 1
                                + CPU blocks    * (1 - kv_cost_cpu)      the tier agent's DRAM
                                + DISK blocks   * (1 - kv_cost_disk)     its NVMe
                                + SHARED blocks * (1 - kv_cost_shared) ) the fleet-shared tier, reachable by all

counting the leading run of the prompt's blocks a worker holds, of those that can hit (vLLM computes the last
prompt token), each block at the first of GPU, DRAM, NVMe and shared tier it is on (the cheapest at the default
costs). Requests in flight (and for `kv_pending_grace_s` after they finish, while their events travel) count as
GPU blocks on their worker past the run the index says it holds, so a burst of requests with one new prefix does
not scatter before the first one's events arrive; once their grace is over, only the index speaks. A worker a
prefix was sent to (the trie, within `prefix_trie_ttl_s`) keeps a pull of `kv_affinity` times what the prefix would
save there, which stands for what its engine holds of it where that saves less (evicted, or never announced).
Workers without an event source, or whose event stream had a gap the replay could not repair, are judged by
the approximate trie of routing decisions, exactly as `prefix` judges them. A data-parallel engine has a cache per
rank: it is judged by its best rank, and the decision names that rank (sent as vLLM's `X-data-parallel-rank`);
prompts no rank holds any of go to its ranks in turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
from prometheus_client import CollectorRegistry

from kvcore.config import option
from kvcore.kv_events import CPU, DISK, GPU, SHARED
from router.config import GatewayConfig, WorkerSpec
from router.kv_index import KvBlockIndex
from router.kv_transport import cache_name
from router.pool import Worker
from router.routing import Decision, Placement, RouteRequest, Strategy
from strategies.balance import PrefillBalance, PrefixOptions


@dataclass(frozen=True)
class KvOptions(PrefixOptions):
    """The prefill balance's settings (`prefix_*`) and kv's own."""

    kv_cost_cpu: float = option(0.1, "kv: cost of a block held in the agent's DRAM tier, as a share of recomputing it")
    kv_cost_disk: float = option(0.25, "kv: cost of a block on the agent's NVMe tier, as a share of recomputing it")
    kv_cost_shared: float = option(
        0.4, "kv: cost of a block in the fleet-shared tier (reachable from every worker), share of recomputing it"
    )
    kv_pending_grace_s: float = option(
        0.1, "kv: seconds a finished request's blocks still count as predicted on its worker, for its KV events "
        "to arrive (while it is in flight they always count)"
    )
    kv_affinity: float = option(
        0.5, "kv: pull of a worker a prefix was sent to (within prefix_trie_ttl_s) where its engine holds less of it, "
        "as a share of the prefill it would save if it held it all (keeps a group in one place instead of copying it "
        "around)"
    )


class KvAware(Strategy):
    name = "kv"
    Options = KvOptions
    needs_prompt_tokens = True
    uses_kv_events = True

    def __init__(self, config: GatewayConfig, options: KvOptions) -> None:
        super().__init__(config, options)
        self.balance = PrefillBalance(options, config.block_size, self.name)
        self.pending = PendingBlocks()
        self.saving = {GPU: 1.0, CPU: 1.0 - options.kv_cost_cpu, DISK: 1.0 - options.kv_cost_disk,
                       SHARED: 1.0 - options.kv_cost_shared}
        self.affinity = options.kv_affinity
        self.pending_grace_s = options.kv_pending_grace_s
        self.index: KvBlockIndex | None = None
        self._trusted: Callable[[str], bool] = lambda url: False
        self._any_sources: Callable[[], bool] = lambda: False  # false: no cache is trusted, none asked
        self._ranks: dict[str, int | None] = {}  # this decision's best rank per data-parallel worker
        self._next_rank: dict[str, int] = {}  # per data-parallel worker, the rank the next prompt none holds goes to
        self._turned: set[str] = set()  # this decision's data-parallel workers whose rank is their turn's
        self._spec_caches: dict[str, tuple[WorkerSpec, list[tuple[int | None, str]]]] = {}  # url -> (spec, caches)
        # finished requests whose pending blocks still count: (end of their grace, cache, keys), oldest first, and
        # the loop whose timer discards them (None: no timer armed)
        self._finished: deque[tuple[float, str, Sequence[int]]] = deque()
        self._sweeping: asyncio.AbstractEventLoop | None = None

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self.balance.register_metrics(registry)

    def attach_kv(self, index: KvBlockIndex, trusted: Callable[[str], bool],
                  any_sources: Callable[[], bool] | None = None) -> None:
        self.index = index
        self._trusted = trusted
        self._any_sources = any_sources if any_sources is not None else lambda: True

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        self._ranks.clear()
        self._turned.clear()
        decision = self.balance.choose(request, workers, self.predict)
        placement = decision.placement
        assert placement is not None
        url = decision.worker.spec.url
        rank = self._ranks.get(url)
        if rank is not None:
            placement = msgspec.structs.replace(placement, rank=rank)
            decision = dataclasses.replace(decision, dp_rank=rank, placement=placement)
            if url in self._turned:  # no rank held any of it: the next such prompt goes to the next rank
                self._next_rank[url] = (rank + 1) % decision.worker.spec.dp_ranks
        self.sibling_routed(id(request), placement)
        return decision

    def sibling_routed(self, key: int, placement: Placement) -> None:
        """A request placed on its worker, by this process (`choose`) or a sibling: its prefill queued there, its
        prefix remembered there and its blocks pending there until its KV events can have come."""
        self.balance.place(placement)
        if placement.keys:
            self.pending.add(cache_name(placement.worker, placement.rank), placement.keys)

    def predict(self, keys: Sequence[int], workers: Sequence[Worker], cacheable: int) -> tuple[list[int], list[float]]:
        """Per worker: the prompt tokens the index (or, untrusted, the trie) says are cached there, and the
        prefill tokens that saves given the tier each block is on. A data-parallel engine is judged by its best
        rank (which `choose` then names in the decision)."""
        if keys and not self._any_trusted(workers):
            # no worker's events can be trusted (none has a stream, or each stream has a gap): what `holdings` says
            # then, the trie and the requests in flight, without a Holding per worker
            bs = self.balance.block_size
            tokens = [min(blocks * bs, cacheable) for blocks in
                      self.pending.match_each(keys, [w.spec.url for w in workers], self.balance.trie.match(keys))]
            return tokens, [float(t) for t in tokens]
        cached: list[int] = []
        saved: list[float] = []
        for held in self.holdings(keys, workers, cacheable):
            cached.append(held.tokens)
            if not held.trusted:
                saved.append(float(held.tokens))
                continue
            saved.append(max(held.saved, held.affinity))
        return cached, saved

    def _any_trusted(self, workers: Sequence[Worker]) -> bool:
        if not self._any_sources():  # no event source at all (the one call instead of one per cache)
            return False
        trusted, known = self._trusted, self._spec_caches
        for worker in workers:  # written out (`_caches_of` too): a generator in any() cost more than the calls
            spec = worker.spec
            caches = known.get(spec.url)
            for _, cache in caches[1] if caches is not None and caches[0] is spec else self._caches_of(worker):
                if trusted(cache):
                    return True
        return False

    def holdings(self, keys: Sequence[int], workers: Sequence[Worker], cacheable: int) -> list[Holding]:
        """Per worker: the leading prompt tokens it holds, by tier, as the index (or, untrusted, the trie) says;
        a data-parallel engine's best rank, remembered for `choose`."""
        if not keys:
            return [Holding() for _ in workers]
        bs = self.balance.block_size
        trusted = self._trusted
        caches = [self._caches_of(w) for w in workers]
        known = [cache for worker_caches in caches for _, cache in worker_caches if trusted(cache)]
        # the blocks that can hit: none past the cacheable prompt (vLLM computes its last token), whatever its tier
        usable = keys if cacheable >= len(keys) * bs else keys[: cacheable // bs]
        runs = self.index.lookup(usable, known) if self.index is not None and known else {}
        guessed = self.balance.trie.match(keys)
        pending = self.pending
        saving = self.saving
        out: list[Holding] = []
        for worker, worker_caches in zip(workers, caches, strict=True):
            url = worker.url
            best: Holding | None = None  # the holding of its best cache (most tokens saved)
            if runs:
                # where the prefix was sent before keeps a weaker pull, in place of what its engine holds where that
                # saves less: it keeps a group on one worker when the engines have evicted it, instead of scattering
                # copies of it over the fleet (so it can outweigh a shorter hit elsewhere)
                affinity = self.affinity * min(guessed.get(url, 0) * bs, cacheable)
                for rank, cache in worker_caches:
                    run = runs.get(cache)
                    if run is None:
                        continue
                    fresh = pending.match(usable, cache)
                    if fresh > run.blocks:  # routed there just now: count the blocks its events will announce
                        blocks, by_tier = fresh, {**run.by_tier, GPU: run.by_tier.get(GPU, 0) + fresh - run.blocks}
                    else:
                        blocks, by_tier = run.blocks, run.by_tier
                    saved = 0.0  # what it saves: each block at its tier's share
                    for tier, n in by_tier.items():
                        saved += saving[tier] * n
                    saved *= bs
                    if best is None or saved > best.saved:
                        best = Holding(blocks * bs, {tier: n * bs for tier, n in by_tier.items() if n}, rank, saved,
                                       affinity, computed=run.blocks * bs)
                if best is not None and not best.tokens and len(worker_caches) > 1:
                    # no rank holds any of it: the ranks take such prompts in turn (the first of equals took all)
                    best.rank = self._next_rank.setdefault(url, 0)
                    self._turned.add(url)
            if best is None:  # no trustworthy events: the approximate trie, as `prefix` does
                blocks = pending.match(keys, url, guessed.get(url, 0))
                tokens = min(blocks * bs, cacheable)
                # a worker whose events are trusted announced none of it: only requests in flight put it there
                announced = bool(known) and any(cache in known for _, cache in worker_caches)
                out.append(Holding(tokens, {GPU: tokens} if tokens else {}, saved=float(tokens), trusted=False,
                                   computed=0 if announced else tokens))
                continue
            self._ranks[url] = best.rank
            out.append(best)
        return out

    def _caches_of(self, worker: Worker) -> Sequence[tuple[int | None, str]]:
        """The worker's caches (`WorkerSpec.caches`), built once per spec rather than once per request."""
        spec = worker.spec
        known = self._spec_caches.get(worker.url)
        if known is None or known[0] is not spec:
            known = self._spec_caches[worker.url] = (spec, spec.caches())
        return known[1]

    def on_finished(self, request: RouteRequest, decision: Decision) -> None:
        self.request_ended(request, decision)
        self._pending_until_grace(decision.worker.spec.url, decision.dp_rank, request.block_keys)

    def sibling_ended(self, key: int, placement: Placement) -> None:
        self.sibling_request_ended(key, placement)
        self._pending_until_grace(placement.worker, placement.rank, placement.keys)

    def _pending_until_grace(self, url: str, rank: int | None, keys: Sequence[int]) -> None:
        """A finished request's blocks stay pending on its cache for the grace, while its KV events travel."""
        if keys:
            # one timer for all finished requests, at the first one's end of grace (the grace is the same for all,
            # so they end in the order they finished), rather than one timer per request (2.3 us under uvloop)
            loop = asyncio.get_running_loop()
            self._finished.append((loop.time() + self.pending_grace_s, cache_name(url, rank), keys))
            if self._sweeping is not loop:
                self._sweeping = loop
                loop.call_at(self._finished[0][0], self._discard_finished)

    def request_ended(self, request: RouteRequest, decision: Decision) -> None:
        """What is kept of a request in flight besides its pending blocks goes (those stay for the grace period:
        `on_finished`). Called by `on_finished`; the virtual-time fleet, which times the grace itself, calls it
        directly. `kv` keeps nothing else."""

    def sibling_request_ended(self, key: int, placement: Placement) -> None:
        """`request_ended` for a sibling's request (its pending blocks stay for the grace: `sibling_ended`, which
        calls this; the virtual-time fleet calls it directly)."""

    def _discard_finished(self) -> None:
        """Discard the pending blocks of the requests whose grace has ended (to the timer's millisecond)."""
        loop = asyncio.get_running_loop()
        finished, until = self._finished, loop.time() + 0.001
        while finished and finished[0][0] <= until:
            _, cache, keys = finished.popleft()
            self.pending.discard(cache, keys)
        if finished:
            loop.call_at(finished[0][0], self._discard_finished)
        else:
            self._sweeping = None

    def forget_worker(self, url: str) -> None:
        self.balance.forget_worker(url)
        self._next_rank.pop(url, None)
        self.pending.forget_worker(url)
        self._spec_caches.pop(url, None)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 3x, and one is built per worker per request
class Holding:
    """The leading prompt tokens one worker holds for a request, of its cacheable part: in all, and by tier (GPU /
    CPU / DISK / SHARED); the data-parallel rank that holds them; the prefill tokens that saves at `kv`'s tier
    costs; the affinity pull of past routing; whether the KV events said so (else: the trie); of the tokens, those
    the worker is known to have computed (its events announced them, or, without events, the trie says they were
    sent there), not only routed there by requests still in flight."""

    tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    rank: int | None = None
    saved: float = 0.0
    affinity: float = 0.0
    trusted: bool = True
    computed: int = 0


class PendingBlocks:
    """Block keys of requests routed but not yet confirmed by KV events: per cache (a worker, or a data-parallel
    rank of it), a multiset of runs of chained keys.

    Keys are chained, so a request holding key i holds every key before it, and two runs that share a key share
    every key before it: a cache's runs are a tree of segments, each a stretch of keys that every run through it
    shares, with the count of runs through it and of runs ending at its last key. Requests mostly share a long
    prefix (a system prompt, a conversation) and part for their last few blocks, so adding, discarding or matching
    a run is a dict step and one key compared per segment (a binary search only where a run parts inside one),
    not a counter per key: with counters per key, adding and discarding a run of 65 blocks touched 130 entries of
    dicts of thousands, 20-25 us each at the server (where the caches are cold between requests) against 4 in a
    tight loop. A segment splits where a new run parts (or ends) inside it and is not joined again: it goes whole
    once no pending run passes through it. A run discarded that is not in flight on its cache changes nothing (one
    added before its cache was forgotten: the cache may be a new one for the same worker by then)."""

    def __init__(self) -> None:
        self._by_worker: dict[str, dict[int, _Segment]] = {}  # cache -> its first segments, by their first key

    def add(self, worker: str, keys: Sequence[int]) -> None:
        if not keys:
            return
        after = self._by_worker.get(worker)
        if after is None:
            after = self._by_worker[worker] = {}
        i, n = 0, len(keys)
        while True:
            seg = after.get(keys[i])
            if seg is None:
                after[keys[i]] = _Segment(list(keys[i:]), 1, 1)
                return
            head = seg.keys
            end = i + len(head)
            if end <= n and keys[end - 1] == head[-1]:  # the whole segment is shared
                seg.through += 1
                if end == n:
                    seg.ends += 1
                    return
                if seg.after is None:
                    seg.after = {}
                after, i = seg.after, end
                continue
            # the run parts from the segment (or ends) inside it: the segment splits there
            shared = _shared(keys, i, head, min(len(head), n - i))
            tail = _Segment(head[shared:], seg.through, seg.ends)
            tail.after = seg.after
            seg.keys, seg.after, seg.ends = head[:shared], {head[shared]: tail}, 0
            seg.through += 1
            if i + shared == n:
                seg.ends = 1
            else:
                seg.after[keys[i + shared]] = _Segment(list(keys[i + shared:]), 1, 1)
            return

    def discard(self, worker: str, keys: Sequence[int]) -> None:
        after = self._by_worker.get(worker)
        if after is None or not keys:
            return
        path: list[tuple[dict[int, _Segment], _Segment]] = []
        i, n = 0, len(keys)
        while True:
            seg = after.get(keys[i])
            if seg is None:
                return
            end = i + len(seg.keys)
            if end > n or keys[end - 1] != seg.keys[-1]:
                return  # no run parts or ends inside a segment: this one is not in flight
            path.append((after, seg))
            if end == n:
                break
            if seg.after is None:
                return
            after, i = seg.after, end
        if not seg.ends:
            return
        seg.ends -= 1
        for depth, (after, seg) in enumerate(path):
            seg.through -= 1
            if not seg.through:  # nothing passes here any more, nor further down
                del after[seg.keys[0]]
                if not depth:
                    if not after:
                        del self._by_worker[worker]
                    return
                break

    def match(self, keys: Sequence[int], worker: str, at_least: int = 0) -> int:
        """How many leading `keys` the cache has pending, or `at_least` if that is more (what the trie says it was
        sent)."""
        after = self._by_worker.get(worker)
        n = len(keys)
        if after is None or n <= at_least:
            return at_least
        i = 0
        while True:
            seg = after.get(keys[i])
            if seg is None:
                break
            head = seg.keys
            end = i + len(head)
            if end <= n and keys[end - 1] == head[-1]:
                i = end
                if i == n or seg.after is None:
                    break
                after = seg.after
                continue
            i += _shared(keys, i, head, min(len(head), n - i))
            break
        return i if i > at_least else at_least

    def match_each(self, keys: Sequence[int], caches: Sequence[str], at_least: Mapping[str, int]) -> list[int]:
        """`match` for each of `caches`, each at least its `at_least` (0 where absent): one call for all, the
        caches with no pending run starting like `keys` answered without a `match` each."""
        by_worker = self._by_worker
        out = []
        first = keys[0] if keys else None
        for cache in caches:
            floor = at_least.get(cache, 0)
            after = by_worker.get(cache)
            out.append(floor if after is None or first not in after else self.match(keys, cache, floor))
        return out

    def pending(self, worker: str) -> dict[int, int]:
        """A cache's pending keys with their counts (for tests)."""
        out: dict[int, int] = {}
        stack = list(self._by_worker.get(worker, {}).values())
        while stack:
            seg = stack.pop()
            out.update(dict.fromkeys(seg.keys, seg.through))
            if seg.after:
                stack.extend(seg.after.values())
        return out

    def forget_worker(self, worker: str) -> None:
        """Forget a worker's blocks, each data-parallel rank's too."""
        for cache in [c for c in self._by_worker if c == worker or c.startswith(worker + "#dp")]:
            del self._by_worker[cache]


class _Segment:
    """Keys every pending run through here shares; the segments after it, by their first key; how many pending
    runs pass through it, and how many end at its last key."""

    __slots__ = ("after", "ends", "keys", "through")

    def __init__(self, keys: list[int], through: int, ends: int) -> None:
        self.keys = keys
        self.after: dict[int, _Segment] | None = None
        self.through = through
        self.ends = ends


def _shared(keys: Sequence[int], start: int, head: list[int], limit: int) -> int:
    """How many of `head`'s keys `keys` repeats from `start` (at least the first, at most `limit`): a binary
    search, as chained keys that agree at one place agree at every place before it."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[start + mid - 1] == head[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
