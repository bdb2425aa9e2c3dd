"""The approximate prefix index: which workers were recently sent which block-key prefixes.

Without engine KV events the gateway can only remember its own routing decisions. `PrefixTrie` keeps them as a
trie whose path is a prompt's chained block keys and whose nodes hold the workers sent that prefix, with the time
each was last sent it. It is bounded twice — a node budget and a TTL — and evicts least-recently-used leaves first,
so a flood of unique prompts cannot grow it past its budget.

Because block keys are chained, one key names its whole prefix: a node is a key, with its parent's key and its
count of children. "Is this prefix known" is one probe, a lookup a binary search
over the prompt's keys. Times are kept in steps of `TOUCH_S` (or a hundredth of the TTL, if shorter), so sending a
prompt again touches only the nodes not yet touched in the current step: a node is never staler than its
descendants, so the nodes already touched lead the prompt's path and one binary search finds where they end. The
work per request follows what is new in it, or not touched yet in this step, not its length.

The node maps are split by key into `SHARDS` dicts each: a dict that outgrows its table is copied whole into a larger
one, with the GIL held, and four maps of one trie grew at the same insert — at 87,000 nodes 20-50 ms in one call,
the event loop (and `/health`) waiting; a shard holds a 64th of the nodes, and the shards outgrow their tables at
different inserts.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcore.dict_tables import TableTrim
from router.block_keys import BlockKey

TOUCH_S = 1.0  # step of the times kept (a node touched in the current step is not touched again)
SHARDS = 64  # dicts per node map, by the key's low bits (a power of two)


@dataclass(frozen=True, slots=True)
class TrieStats:
    nodes: int
    max_nodes: int
    evictions: int
    expirations: int
    workers: dict[str, int]


class PrefixTrie:
    """Block-key prefixes → workers recently sent them; bounded by `max_nodes` and `ttl_s`.

    A node is its last block's key, its fields kept in dicts keyed by it (parent key, child count, last use, the
    workers sent it with when), not an object of its own: dicts holding only numbers and strings are not tracked by
    Python's cycle collector, an object per node would be, and every full collection walks all tracked objects with
    the GIL held (35,000-67,000 nodes after 100 prompts of 32,000 characters cost 86-133 ms per collection, the
    event loop stalled meanwhile).

    Most nodes were only ever sent to one worker (routing by prefix keeps a prefix in one place): such a node's
    workers are that worker's URL alone, its time the node's last use, and a dict of URL -> time only once a
    second worker is sent it (a one-entry dict cost 200 bytes per node, half of a trie's memory)."""

    def __init__(self, max_nodes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_nodes < 1:
            raise ValueError("max_nodes must be at least 1")
        self.max_nodes = max_nodes
        self.max_path = max(64, max_nodes // 8)  # blocks of one prompt remembered
        self._step = min(TOUCH_S, ttl_s / 100) if ttl_s > 0 else 0.0
        self.ttl_s = ttl_s
        self.clock = clock  # injectable: the virtual-time fleet sets its own
        self._nodes = 0
        self._shard_maps(SHARDS)
        # the keys `match` looked up last and how many lead with nodes: `insert` of the same keys (the decision
        # that follows) takes it rather than search again; any removal forgets it (an insert only adds nodes)
        self._last_known: tuple[Sequence[BlockKey], int] | None = None
        # leaves by last use; entries go stale when a leaf is used again, gains a child or is removed
        self._leaves: list[tuple[float, BlockKey]] = []
        self._worker_nodes: dict[str, int] = {}
        self._trims: list[tuple[TableTrim, dict[Any, Any]]] = []  # see compact_tables
        self.evictions = 0  # nodes removed to stay under max_nodes
        self.expirations = 0  # nodes removed because nobody was sent them within ttl_s

    def _shard_maps(self, shards: int) -> None:
        """The node maps as `shards` dicts each (node `key` in dict `key & self._mask`), their nodes kept."""
        old = [getattr(self, name, [{}]) for name in ("_parent", "_children", "_used", "_workers")]
        self._mask = shards - 1
        maps: list[list[dict[Any, Any]]] = [[{} for _ in range(shards)] for _ in old]
        for shard_maps, old_maps in zip(maps, old, strict=True):
            for fields in old_maps:
                for key, value in fields.items():
                    shard_maps[key & self._mask][key] = value
        self._parent: list[dict[BlockKey, BlockKey | None]] = maps[0]  # every node; None for a first block
        self._children: list[dict[BlockKey, int]] = maps[1]
        self._used: list[dict[BlockKey, float]] = maps[2]  # last sent to any worker
        # the workers sent each node: the URL of the only one (last sent: the node's `_used`), or url -> last sent
        self._workers: list[dict[BlockKey, str | dict[str, float]]] = maps[3]

    def __len__(self) -> int:
        return self._nodes

    def compact_tables(self) -> None:
        """From now on keep the node maps at the table size a copy of them would have (`TableTrim`; nodes come and
        go, evicted at the budget or expired): half their memory, for copying a map into itself (tens of ms per
        100,000 nodes) whenever CPython would grow it. For long simulations (`kvgate bench vsim`); a live gateway
        would stall its event loop meanwhile. The maps become one dict each (a copy of each of 64 shards could not
        be told when it is due, and small dicts are left alone)."""
        self._shard_maps(1)
        self._trims = [(TableTrim(), fields[0])
                       for fields in (self._parent, self._children, self._used, self._workers)]

    def _known(self, keys: Sequence[BlockKey]) -> int:
        """How many leading keys are nodes (`leading_run` over the shards, written out)."""
        parents, mask = self._parent, self._mask
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            key = keys[mid - 1]
            if key in parents[key & mask]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # --- lookup -----------------------------------------------------------------------------------------------

    def match(self, keys: Sequence[BlockKey], workers: Sequence[str] | None = None) -> dict[str, int]:
        """For each worker sent a prefix of `keys` within the TTL: how many leading blocks it was sent.

        A worker sent a prefix was sent every shorter prefix too (insertion touches the whole path with one
        timestamp), so "fresh at depth d" is monotone in d and each worker's depth is one probe of the deepest known
        block, or else a binary search."""
        mask = self._mask
        if not keys or (root := keys[0]) not in self._parent[root & mask]:
            self._last_known = (keys, 0)
            return {}
        known = self._known(keys)
        self._last_known = (keys, known)
        fresh_after = self.clock() - self.ttl_s
        sent_to, used = self._workers, self._used
        first = sent_to[root & mask][root]
        if isinstance(first, str):
            wanted: Iterable[str] = [first] if workers is None or first in workers else []
            first = {first: used[root & mask][root]}
        else:
            wanted = first.keys() if workers is None else [w for w in workers if w in first]
        out: dict[str, int] = {}
        deepest = keys[known - 1]
        deepest_shard = deepest & mask
        deepest_sent = sent_to[deepest_shard][deepest]
        for url in wanted:
            if first[url] < fresh_after:
                continue
            # the deepest known block first: a prefix is mostly sent to one worker, whole (one probe, no search)
            sent = ((used[deepest_shard][deepest] if deepest_sent == url else None) if isinstance(deepest_sent, str)
                    else deepest_sent.get(url))
            if sent is not None and sent >= fresh_after:
                out[url] = known
                continue
            # blocks sent to `url` lately: at least the first, not the deepest known one
            out[url] = self._sent_since(keys, 1, known - 1, url, fresh_after)
        return out

    def _sent_since(self, keys: Sequence[BlockKey], lo: int, hi: int, worker: str, since: float) -> int:
        """How many leading `keys` (nodes all) were sent to `worker` at `since` or later, known to be between `lo`
        and `hi`: monotone in depth, as a node is marked with its ancestors, so a binary search (`leading_run`
        written out: a callback per probe would cost more than the whole lookup does)."""
        sent_to, used, mask = self._workers, self._used, self._mask
        while lo < hi:
            mid = (lo + hi + 1) // 2
            key = keys[mid - 1]
            shard = key & mask
            entry = sent_to[shard][key]
            sent = (used[shard][key] if entry == worker else None) if isinstance(entry, str) else entry.get(worker)
            if sent is not None and sent >= since:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # --- update -----------------------------------------------------------------------------------------------

    def insert(self, keys: Sequence[BlockKey], worker: str) -> None:
        """Record that `worker` was just sent the prompt whose block keys are `keys` (at most its first
        `max_nodes // 8` blocks, or 64: one huge prompt must not evict every other prefix)."""
        if not keys:
            return
        if len(keys) > self.max_path:
            keys = keys[: self.max_path]
        now = self.clock()
        if self._step:
            now -= now % self._step
        last = self._last_known
        depth = last[1] if last is not None and last[0] is keys else self._known(keys)
        self._last_known = None
        self._touch(keys, depth, worker, now)
        node = keys[depth - 1] if depth else None
        if depth < len(keys):
            for trim, fields in self._trims:  # the four maps take the same new keys: copied before, not after
                trim.make_room(fields, len(keys) - depth)
            node = self._grow(keys, depth, node, worker, now)
        assert node is not None
        shard = node & self._mask
        if self._children[shard][node] == 0 and self._used[shard][node] == now:
            heapq.heappush(self._leaves, (now, node))
        self._expire(now)
        self._shrink()

    def _touch(self, keys: Sequence[BlockKey], depth: int, worker: str, now: float) -> None:
        """Mark the nodes of keys[:depth] (a path from a first block: each node's parent is the key before it) as
        sent to `worker` at `now`. A node marked so had its ancestors marked with it, so the marked nodes lead the
        path: they are found by binary search, and only the nodes after them are marked (no walk up the parents,
        no check per node)."""
        counts, used, sent_to, mask = self._worker_nodes, self._used, self._workers, self._mask
        for node in keys[self._sent_since(keys, 0, depth, worker, now):depth]:
            shard = node & mask
            workers = sent_to[shard][node]
            if isinstance(workers, str):
                if workers != worker:  # a second worker: the node gets a dict, the first one's time its last use
                    counts[worker] = counts.get(worker, 0) + 1
                    sent_to[shard][node] = {workers: used[shard][node], worker: now}
            else:
                if worker not in workers:
                    counts[worker] = counts.get(worker, 0) + 1
                workers[worker] = now
            used[shard][node] = now

    def _grow(self, keys: Sequence[BlockKey], depth: int, parent: BlockKey | None, worker: str,
              now: float) -> BlockKey:
        """Add the nodes for keys[depth:] below `parent`; returns the deepest."""
        self._worker_nodes[worker] = self._worker_nodes.get(worker, 0) + len(keys) - depth
        self._nodes += len(keys) - depth
        parents, children, used, sent_to, mask = self._parent, self._children, self._used, self._workers, self._mask
        if parent is not None:
            children[parent & mask][parent] += 1
        node = parent
        for i in range(depth, len(keys)):
            key = keys[i]
            shard = key & mask
            parents[shard][key] = node
            children[shard][key] = 1  # the next one; the deepest gets 0 below
            used[shard][key] = now
            sent_to[shard][key] = worker
            node = key
        assert node is not None
        children[node & mask][node] = 0
        return node

    # --- eviction ---------------------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """Drop leaves nobody was sent within the TTL (their parents follow once they become leaves)."""
        limit = now - self.ttl_s
        while self._leaves and self._leaves[0][0] < limit:
            self.expirations += self._pop_leaf(limit, self._nodes)

    def _shrink(self) -> None:
        while self._nodes > self.max_nodes and self._leaves:
            self.evictions += self._pop_leaf(None, self._nodes - self.max_nodes)

    def _pop_leaf(self, limit: float | None, most: int) -> int:
        """Remove the least-recently-used leaf and, up to `most` nodes in all, the ancestors that would be the
        next leaves evicted anyway (an unbranched chain used at the same time, or expired). Returns the count
        removed (0 for a stale heap entry)."""
        last, key = heapq.heappop(self._leaves)
        self._last_known = None
        parents, children, used, sent_to, mask = self._parent, self._children, self._used, self._workers, self._mask
        shard = key & mask
        if used[shard].get(key) != last or children[shard][key]:
            return 0
        bound = last if limit is None else limit
        removed = [key]
        above = parents[shard][key]
        while (
            len(removed) < most and above is not None and children[above & mask][above] == 1
            and (used[above & mask][above] == bound if limit is None else used[above & mask][above] < bound)
        ):
            removed.append(above)
            above = parents[above & mask][above]
        counts = self._worker_nodes
        for gone in removed:  # the whole subtree of the last one: each had one child, the one removed before
            shard = gone & mask
            del parents[shard][gone], children[shard][gone], used[shard][gone]
            workers = sent_to[shard].pop(gone)
            if isinstance(workers, str):
                counts[workers] -= 1
            else:
                for url in workers:
                    counts[url] -= 1
        self._nodes -= len(removed)
        if above is not None:
            shard = above & mask
            children[shard][above] -= 1
            if children[shard][above] == 0:
                heapq.heappush(self._leaves, (used[shard][above], above))
        self._compact()
        return len(removed)

    def _compact(self) -> None:
        """Rebuild the leaf heap when stale entries outnumber live nodes (each insert pushes one)."""
        if len(self._leaves) > 2 * self._nodes + 64:
            self._leaves = [(used[key], key) for children, used in zip(self._children, self._used, strict=True)
                            for key, count in children.items() if count == 0]
            heapq.heapify(self._leaves)

    def expire(self) -> None:
        """Apply the TTL now (insertions do it as they go)."""
        self._expire(self.clock())

    def forget_worker(self, url: str) -> None:
        """Remove a worker from every node; prefixes no worker holds any more are removed with their subtrees."""
        parents, children, used, mask = self._parent, self._children, self._used, self._mask
        self._last_known = None
        # a node left with one worker keeps its dict: its last use may be the forgotten worker's time
        emptied = [key for sent_to in self._workers for key, workers in sent_to.items()
                   if (workers == url if isinstance(workers, str)
                       else workers.pop(url, None) is not None and not workers)]
        self._worker_nodes.pop(url, None)
        # a node's workers include its descendants': an emptied node's subtree is emptied; the top of one has a
        # parent still held (or none)
        gone = set(emptied)
        tops = [parent for key in emptied if (parent := parents[key & mask][key]) is not None and parent not in gone]
        for key in emptied:
            shard = key & mask
            del parents[shard][key], children[shard][key], used[shard][key], self._workers[shard][key]
        self._nodes -= len(emptied)
        for parent in tops:
            shard = parent & mask
            children[shard][parent] -= 1
            if children[shard][parent] == 0:
                heapq.heappush(self._leaves, (used[shard][parent], parent))

    def clear(self) -> None:
        self._last_known = None
        for maps in (self._parent, self._children, self._used, self._workers):
            for fields in maps:
                fields.clear()
        self._nodes = 0
        self._leaves.clear()
        self._worker_nodes.clear()

    def stats(self) -> TrieStats:
        return TrieStats(self._nodes, self.max_nodes, self.evictions, self.expirations, dict(self._worker_nodes))

    def worker_nodes(self, url: str) -> int:
        """How many prefixes (blocks) the trie believes `url` holds: its share of the fleet's cached state."""
        return self._worker_nodes.get(url, 0)

    def nodes(self) -> dict[BlockKey, BlockKey | None]:
        """Every node with its parent (for checks)."""
        return {key: parent for fields in self._parent for key, parent in fields.items()}

    def check(self) -> None:
        """Assert the nodes are a consistent tree (for tests)."""
        mask = self._mask
        for shard, fields in enumerate(self._parent):
            assert all(key & mask == shard for key in fields), "a node in another key's shard"
        parents = self.nodes()
        children = {key: n for fields in self._children for key, n in fields.items()}
        used = {key: t for fields in self._used for key, t in fields.items()}
        sent_to = {key: w for fields in self._workers for key, w in fields.items()}
        assert parents.keys() == children.keys() == used.keys() == sent_to.keys()
        assert len(parents) == self._nodes, "node count out of step"
        counts: dict[BlockKey, int] = {}
        for key, parent in parents.items():
            if parent is not None:
                assert parent in parents, "a node whose parent is gone"
                assert self._sent(key).keys() <= self._sent(parent).keys()
                assert used[key] <= used[parent]
                counts[parent] = counts.get(parent, 0) + 1
        for key, count in children.items():
            assert count == counts.get(key, 0), "child count out of step"
        held: dict[str, int] = {}
        for key in sent_to:
            for url in self._sent(key):
                held[url] = held.get(url, 0) + 1
        assert held == {url: n for url, n in self._worker_nodes.items() if n}, "worker node counts out of step"

    def _sent(self, key: BlockKey) -> dict[str, float]:
        """The workers sent node `key`, with when each last was (for checks)."""
        shard = key & self._mask
        workers = self._workers[shard][key]
        return {workers: self._used[shard][key]} if isinstance(workers, str) else dict(workers)

    def sent_to(self) -> list[str | dict[str, float]]:
        """Every node's workers as kept: a URL, or URL -> last sent (for checks)."""
        return [workers for fields in self._workers for workers in fields.values()]
