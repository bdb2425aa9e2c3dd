"""The approximate prefix index: which workers were recently sent which block-key prefixes.

Without engine KV events the gateway can only remember its own routing decisions. `PrefixTrie` keeps them as a
trie whose path is a prompt's chained block keys and whose nodes hold the workers sent that prefix, with the time
each was last sent it. It is bounded twice — a node budget and a TTL — and evicts least-recently-used leaves first,
so a flood of unique prompts cannot grow it past its budget.

Because block keys are chained, one key names its whole prefix: the trie is a dict from key to node, each node
pointing to its parent and counting its children. "Is this prefix known" is one probe, a lookup a binary search
over the prompt's keys. Times are kept in steps of `TOUCH_S` (or a hundredth of the TTL, if shorter), so sending a
prompt again touches only the nodes not yet touched in the current step: a node is never staler than its
descendants, so the walk up from the deepest known node stops at the first one already touched. The work per
request follows what is new in it, not its length.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.block_keys import BlockKey, longest_run

TOUCH_S = 1.0  # step of the times kept (a node touched in the current step is not touched again)


class _Node:
    """One prefix: its last block's key, its place in the tree and the workers sent it (url -> last sent)."""

    __slots__ = ("children", "depth", "key", "last_used", "parent", "workers")

    def __init__(self, key: BlockKey, parent: _Node | None, depth: int, now: float) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth  # number of blocks in the prefix (1 for a first block)
        self.children = 0
        self.last_used = now
        self.workers: dict[str, float] = {}

    def path(self) -> tuple[BlockKey, ...]:
        keys: list[BlockKey] = []
        node: _Node | None = self
        while node is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(reversed(keys))


@dataclass(frozen=True, slots=True)
class TrieStats:
    nodes: int
    max_nodes: int
    evictions: int
    expirations: int
    workers: dict[str, int]


class PrefixTrie:
    """Block-key prefixes → workers recently sent them; bounded by `max_nodes` and `ttl_s`."""

    def __init__(self, max_nodes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_nodes < 1:
            raise ValueError("max_nodes must be at least 1")
        self.max_nodes = max_nodes
        self.max_path = max(64, max_nodes // 8)  # blocks of one prompt remembered
        self._step = min(TOUCH_S, ttl_s / 100) if ttl_s > 0 else 0.0
        self.ttl_s = ttl_s
        self.clock = clock  # injectable: the virtual-time fleet sets its own
        self._index: dict[BlockKey, _Node] = {}
        # leaves by last use; entries go stale when a leaf is used again, gains a child or is removed
        self._leaves: list[tuple[float, BlockKey]] = []
        self._worker_nodes: dict[str, int] = {}
        self.evictions = 0  # nodes removed to stay under max_nodes
        self.expirations = 0  # nodes removed because nobody was sent them within ttl_s

    def __len__(self) -> int:
        return len(self._index)

    # --- lookup -----------------------------------------------------------------------------------------------

    def match(self, keys: Sequence[BlockKey], workers: Sequence[str] | None = None) -> dict[str, int]:
        """For each worker sent a prefix of `keys` within the TTL: how many leading blocks it was sent.

        A worker sent a prefix was sent every shorter prefix too (insertion touches the whole path with one
        timestamp), so "fresh at depth d" is monotone in d and each worker's depth is a binary search."""
        index = self._index
        if not keys or keys[0] not in index:
            return {}
        known = longest_run(len(keys), lambda i: keys[i] in index)
        fresh_after = self.clock() - self.ttl_s
        first = index[keys[0]].workers
        wanted = first.keys() if workers is None else [w for w in workers if w in first]
        out: dict[str, int] = {}
        for url in wanted:
            if first[url] < fresh_after:
                continue
            # `longest_run` written out: a callback per probe would cost more than the whole lookup does
            lo, hi = 1, known  # blocks sent to `url` lately: at least the first, at most every known one
            while lo < hi:
                mid = (lo + hi + 1) // 2
                sent = index[keys[mid - 1]].workers.get(url)
                if sent is not None and sent >= fresh_after:
                    lo = mid
                else:
                    hi = mid - 1
            out[url] = lo
        return out

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
        index = self._index
        depth = longest_run(len(keys), lambda i: keys[i] in index) if keys[0] in index else 0
        node = index[keys[depth - 1]] if depth else None
        self._touch(node, worker, now)
        if depth < len(keys):
            node = self._grow(keys, depth, node, worker, now)
        assert node is not None
        if node.children == 0 and node.last_used == now:
            heapq.heappush(self._leaves, (now, node.key))
        self._expire(now)
        self._shrink()

    def _touch(self, node: _Node | None, worker: str, now: float) -> None:
        """Mark `node` and its ancestors as sent to `worker` at `now`, up to the first already marked so (whose
        ancestors were marked when it was)."""
        counts = self._worker_nodes
        while node is not None:
            sent = node.workers.get(worker)
            if sent is not None and sent >= now:
                return
            if sent is None:
                counts[worker] = counts.get(worker, 0) + 1
            node.workers[worker] = now
            node.last_used = now
            node = node.parent

    def _grow(self, keys: Sequence[BlockKey], depth: int, parent: _Node | None, worker: str, now: float) -> _Node:
        """Add the nodes for keys[depth:] below `parent`."""
        self._worker_nodes[worker] = self._worker_nodes.get(worker, 0) + len(keys) - depth
        if parent is not None:
            parent.children += 1
        index = self._index
        node = parent
        for i in range(depth, len(keys)):
            child = _Node(keys[i], node, i + 1, now)
            child.workers[worker] = now
            if node is not None and i > depth:
                node.children = 1
            index[keys[i]] = child
            node = child
        assert node is not None
        return node

    # --- eviction ---------------------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """Drop leaves nobody was sent within the TTL (their parents follow once they become leaves)."""
        limit = now - self.ttl_s
        while self._leaves and self._leaves[0][0] < limit:
            self.expirations += self._pop_leaf(limit, len(self._index))

    def _shrink(self) -> None:
        while len(self._index) > self.max_nodes and self._leaves:
            self.evictions += self._pop_leaf(None, len(self._index) - self.max_nodes)

    def _pop_leaf(self, limit: float | None, most: int) -> int:
        """Remove the least-recently-used leaf and, up to `most` nodes in all, the ancestors that would be the
        next leaves evicted anyway (an unbranched chain used at the same time, or expired). Returns the count
        removed (0 for a stale heap entry)."""
        used, key = heapq.heappop(self._leaves)
        node = self._index.get(key)
        if node is None or node.children or node.last_used != used:
            return 0
        bound = used if limit is None else limit
        removed = [node]
        top = node
        while (
            len(removed) < most and top.parent is not None and top.parent.children == 1
            and (top.parent.last_used == bound if limit is None else top.parent.last_used < bound)
        ):
            top = top.parent
            removed.append(top)
        for gone in removed:  # the whole subtree of `top`: each removed node had one child, the one removed before
            del self._index[gone.key]
            for url in gone.workers:
                self._worker_nodes[url] -= 1
        parent = top.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0:
                heapq.heappush(self._leaves, (parent.last_used, parent.key))
        self._compact()
        return len(removed)

    def _compact(self) -> None:
        """Rebuild the leaf heap when stale entries outnumber live nodes (each insert pushes one)."""
        if len(self._leaves) > 2 * len(self._index) + 64:
            self._leaves = [(n.last_used, n.key) for n in self._index.values() if n.children == 0]
            heapq.heapify(self._leaves)

    def expire(self) -> None:
        """Apply the TTL now (insertions do it as they go)."""
        self._expire(self.clock())

    def forget_worker(self, url: str) -> None:
        """Remove a worker from every node; prefixes no worker holds any more are removed with their subtrees."""
        emptied: list[_Node] = []
        for node in self._index.values():
            if node.workers.pop(url, None) is not None and not node.workers:
                emptied.append(node)
        self._worker_nodes.pop(url, None)
        for node in emptied:
            del self._index[node.key]
        for node in emptied:  # a node's workers include its descendants': an emptied node's subtree is emptied
            parent = node.parent
            if parent is not None and parent.workers:  # the top of an emptied subtree
                parent.children -= 1
                if parent.children == 0:
                    heapq.heappush(self._leaves, (parent.last_used, parent.key))

    def clear(self) -> None:
        self._index.clear()
        self._leaves.clear()
        self._worker_nodes.clear()

    def stats(self) -> TrieStats:
        return TrieStats(len(self._index), self.max_nodes, self.evictions, self.expirations,
                         dict(self._worker_nodes))

    def worker_nodes(self, url: str) -> int:
        """How many prefixes (blocks) the trie believes `url` holds: its share of the fleet's cached state."""
        return self._worker_nodes.get(url, 0)

    def check(self) -> None:
        """Assert the nodes are a consistent tree (for tests)."""
        counts: dict[int, int] = {}
        for key, node in self._index.items():
            assert node.key == key
            parent = node.parent
            if parent is None:
                assert node.depth == 1
            else:
                assert self._index.get(parent.key) is parent, "a node whose parent is gone"
                assert node.depth == parent.depth + 1
                assert set(node.workers) <= set(parent.workers)
                assert node.last_used <= parent.last_used
                counts[id(parent)] = counts.get(id(parent), 0) + 1
        for node in self._index.values():
            assert node.children == counts.get(id(node), 0), "child count out of step"
