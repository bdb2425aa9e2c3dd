"""The approximate prefix index: which workers were recently sent which block-key prefixes.

Without engine KV events the gateway can only remember its own routing decisions. `PrefixTrie` keeps them as a
trie whose path is a prompt's chained block keys and whose nodes hold the workers sent that prefix, with the time
each was last sent it. It is bounded twice — a node budget and a TTL — and evicts least-recently-used leaves first,
so a flood of unique prompts cannot grow it past its budget.

Because block keys are chained, one key names its whole prefix: a node is a key, with its parent's key and its
count of children. A path is cut into segments, stretches of nodes one below the other whose workers and times are
the same, and those are kept once per segment: sending a prompt again stamps each segment of its path, not each
block (a 4,000-character system prompt's 62 blocks are one segment, its questions one each), so the work per
request follows the segments of its path and what is new in it, not its length. A segment splits where a new
prompt parts from it or ends inside it, and grows where a prompt continues the one that made it in the same step.
Times are kept in steps of `TOUCH_S` (or a hundredth of the TTL, if shorter), so a segment stamped in the current
step for a worker is not stamped again.

The maps are split by key into `SHARDS` dicts each: a dict that outgrows its table is copied whole into a larger
one, with the GIL held, and the maps of one trie grew at the same insert — at 87,000 nodes 20-50 ms in one call,
the event loop (and `/health`) waiting; a shard holds a 64th of the nodes, and the shards outgrow their tables at
different inserts.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcore.dict_tables import TableTrim
from router.block_keys import BlockKey

TOUCH_S = 1.0  # step of the times kept (a segment stamped in the current step is not stamped again)
SHARDS = 64  # dicts per map, by the key's low bits (a power of two)
DROP_STEP = 256  # entries of a replaced leaf heap freed per unit of `trim`'s work

# a walk of a prompt's path: how many leading keys are nodes, and the segments they run through (each segment's
# top key and the index in the keys just past its last node on the path)
Path = tuple[int, list[BlockKey], list[int]]


@dataclass(frozen=True, slots=True)
class TrieStats:
    nodes: int
    max_nodes: int
    evictions: int
    expirations: int
    workers: dict[str, int]


class PrefixTrie:
    """Block-key prefixes → workers recently sent them; bounded by `max_nodes` and `ttl_s`.

    A node is its last block's key, its fields kept in dicts keyed by it (parent key, child count, its segment's
    top key), not an object of its own, and so is a segment, by its top key (its bottom key, length, last use, the
    workers sent it with when): dicts holding only numbers and strings are not tracked by Python's cycle collector,
    an object per node would be, and every full collection walks all tracked objects with the GIL held (35,000-67,000
    nodes after 100 prompts of 32,000 characters cost 86-133 ms per collection, the event loop stalled meanwhile).

    A segment's nodes above its bottom have one child each (the next node of the segment): a branch, or the end of
    a prompt, is a segment's bottom. Every node of a segment has that segment's workers and times.

    Most segments were only ever sent to one worker (routing by prefix keeps a prefix in one place): such a
    segment's workers are that worker's URL alone, its time the segment's last use, and a dict of URL -> time only
    once a second worker is sent it."""

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
        # the keys `match` walked last and their path: `insert` of the same keys (the decision that follows) takes
        # it rather than walk again; any removal or split forgets it
        self._last_walk: tuple[Sequence[BlockKey], Path] | None = None
        # leaves by last use; entries go stale when a leaf is used again, gains a child or is removed
        self._leaves: list[tuple[float, BlockKey]] = []
        # a rebuild of the leaf heap in slices (`_compact`, `trim`): the heap being built (every push goes to it too),
        # the next shard of the maps to scan and the leaves of the last one scanned not yet pushed
        self._rebuild: list[tuple[float, BlockKey]] | None = None
        self._rebuild_shard = 0
        self._rebuild_keys: list[BlockKey] = []
        self._dropped: list[tuple[float, BlockKey]] = []  # the heap a rebuild replaced, freed a slice at a time
        self._slicing = False  # removals now are a slice of the owner's (`trim` with a bound): `_compact` slices too
        self._worker_nodes: dict[str, int] = {}
        self._trims: list[tuple[TableTrim, dict[Any, Any], bool]] = []  # see compact_tables
        self.evictions = 0  # nodes removed to stay under max_nodes
        # nodes `insert` may leave over `max_nodes`, with what the TTL removes, for its owner to remove in slices
        # (`trim`) between other work: 0, insert removes them itself. The gateway's strategies set it (issue 18: at
        # the budget, a cold 32,000-character prompt's 608 new nodes evicted 300 two-block leaves of earlier
        # questions, 2.5 ms of CPU on the event loop in one call)
        self.slack = 0
        self.trim_due = False  # with slack: something is due for `trim` (as of the last insert or trim)
        self.expirations = 0  # nodes removed because nobody was sent them within ttl_s

    _MAPS = ("_parent", "_children", "_top", "_bottom", "_length", "_used", "_workers")

    def _shard_maps(self, shards: int) -> None:
        """The maps as `shards` dicts each (`key` in dict `key & self._mask`), their entries kept."""
        old = [getattr(self, name, [{}]) for name in self._MAPS]
        self._mask = shards - 1
        maps: list[list[dict[Any, Any]]] = [[{} for _ in range(shards)] for _ in old]
        for shard_maps, old_maps in zip(maps, old, strict=True):
            for fields in old_maps:
                for key, value in fields.items():
                    shard_maps[key & self._mask][key] = value
        # per node: every node's parent (None for a first block), its child count and its segment's top key
        self._parent: list[dict[BlockKey, BlockKey | None]] = maps[0]
        self._children: list[dict[BlockKey, int]] = maps[1]
        self._top: list[dict[BlockKey, BlockKey]] = maps[2]
        # per segment, by its top key: its deepest node, its node count, when last sent to any worker, and the
        # workers sent it: the URL of the only one (last sent: the segment's `_used`), or url -> last sent
        self._bottom: list[dict[BlockKey, BlockKey]] = maps[3]
        self._length: list[dict[BlockKey, int]] = maps[4]
        self._used: list[dict[BlockKey, float]] = maps[5]
        self._workers: list[dict[BlockKey, str | dict[str, float]]] = maps[6]

    def __len__(self) -> int:
        return self._nodes

    def compact_tables(self) -> None:
        """From now on keep the maps at the table size a copy of them would have (`TableTrim`; nodes come and
        go, evicted at the budget or expired): half their memory, for copying a map into itself (tens of ms per
        100,000 nodes) whenever CPython would grow it. For long simulations (`kvgate bench vsim`); a live gateway
        would stall its event loop meanwhile. The maps become one dict each (a copy of each of 64 shards could not
        be told when it is due, and small dicts are left alone)."""
        self._rebuild, self._rebuild_keys = None, []  # (its shard numbers would change; the old heap is whole)
        self._shard_maps(1)
        self._trims = [(TableTrim(), getattr(self, name)[0], name in ("_parent", "_children", "_top"))
                       for name in self._MAPS]

    # --- lookup -----------------------------------------------------------------------------------------------

    def _walk(self, keys: Sequence[BlockKey]) -> Path:
        """How many leading `keys` are nodes, and the segments they run through: a dict step and one key
        compared per segment (a binary search only where the keys part from a segment or end inside it)."""
        lengths, bottoms, mask = self._length, self._bottom, self._mask
        tops: list[BlockKey] = []
        ends: list[int] = []
        i, n = 0, len(keys)
        while i < n:
            top = keys[i]
            # a node after a segment's bottom is a segment's top (the first one too): not a top, not a node
            length = lengths[top & mask].get(top)
            if length is None:
                break
            tops.append(top)
            end = i + length
            if end <= n and keys[end - 1] == bottoms[top & mask][top]:
                ends.append(end)
                i = end
                continue
            # the keys part from the segment (or end) inside it: its nodes lead them, chained, to where they part
            parents = self._parent
            lo, hi = i + 1, min(end, n)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                key = keys[mid - 1]
                if key in parents[key & mask]:
                    lo = mid
                else:
                    hi = mid - 1
            ends.append(lo)
            return lo, tops, ends
        return i, tops, ends

    def match(self, keys: Sequence[BlockKey], workers: Sequence[str] | None = None) -> dict[str, int]:
        """For each worker sent a prefix of `keys` within the TTL: how many leading blocks it was sent.

        A worker sent a prefix was sent every shorter prefix too (insertion stamps the whole path with one
        time), so "fresh at depth d" is monotone in d: each worker's depth is the end of the deepest segment on
        the path where it is fresh."""
        path = self._walk(keys)
        self._last_walk = (keys, path)
        _, tops, ends = path
        if not tops:
            return {}
        fresh_after = self.clock() - self.ttl_s
        sent_to, used, mask = self._workers, self._used, self._mask
        out: dict[str, int] = {}
        for top, end in zip(tops, ends, strict=True):
            shard = top & mask
            sent = sent_to[shard][top]
            if isinstance(sent, str):
                if used[shard][top] < fresh_after:
                    break  # not fresh here, so nowhere deeper
                out[sent] = end
            else:
                fresh = False
                for url, at in sent.items():
                    if at >= fresh_after:
                        out[url] = end
                        fresh = True
                if not fresh:
                    break
        if workers is not None and out:
            return {url: out[url] for url in workers if url in out}
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
        last = self._last_walk
        depth, tops, ends = last[1] if last is not None and last[0] is keys else self._walk(keys)
        self._last_walk = None
        grows = depth < len(keys)
        mask = self._mask
        lengths, sent_to, used = self._length, self._workers, self._used
        start = 0
        for top, end in zip(tops, ends, strict=True):
            shard = top & mask
            sent = sent_to[shard][top]
            stamped = (used[shard][top] == now and sent == worker) if isinstance(sent, str) else sent.get(worker) == now
            if end - start < lengths[shard][top] and (grows or not stamped):
                # the path ends (or parts, new nodes to grow there) inside the segment: it splits at that point
                self._split(top, end - start, keys[end - 1])
            if not stamped:
                self._stamp(top, worker, now)
            start = end
        node = keys[depth - 1] if depth else None
        if grows:
            for trim, fields, per_node in self._trims:  # the maps take the new keys: copied before, not after
                trim.make_room(fields, len(keys) - depth if per_node else 2)
            node = self._grow(keys, depth, node, worker, now)
        assert node is not None
        shard = node & mask
        top = self._top[shard][node]
        if self._children[shard][node] == 0 and self._used[top & mask][top] == now:
            self._push((now, node))
        leaves = self._leaves
        expired = bool(leaves) and leaves[0][0] < now - self.ttl_s  # (`_expire`'s own test, without a call)
        if self.slack:  # the owner removes what is due in slices (`trim`); here only what passes the ceiling
            if self._nodes > self.max_nodes + self.slack:
                self._slicing = True  # a rebuild of the heap this starts is left to the slices
                try:
                    self._shrink(self.max_nodes + self.slack)
                finally:
                    self._slicing = False
            self.trim_due = (expired or self._nodes > self.max_nodes or self._rebuild is not None
                             or bool(self._dropped))
            return
        if expired:
            self._expire(now)
        if self._nodes > self.max_nodes:
            self._shrink(self.max_nodes)

    def _push(self, entry: tuple[float, BlockKey]) -> None:
        """A leaf's entry onto the heap (and onto the one a rebuild is building)."""
        heapq.heappush(self._leaves, entry)
        if self._rebuild is not None:
            heapq.heappush(self._rebuild, entry)

    def _stamp(self, top: BlockKey, worker: str, now: float) -> None:
        """Mark segment `top` as sent to `worker` at `now`."""
        shard = top & self._mask
        sent_to, used, counts = self._workers[shard], self._used[shard], self._worker_nodes
        workers = sent_to[top]
        if isinstance(workers, str):
            if workers != worker:  # a second worker: the segment gets a dict, the first one's time its last use
                counts[worker] = counts.get(worker, 0) + self._length[shard][top]
                sent_to[top] = {workers: used[top], worker: now}
        else:
            if worker not in workers:
                counts[worker] = counts.get(worker, 0) + self._length[shard][top]
            workers[worker] = now
        used[top] = now

    def _split(self, top: BlockKey, head: int, last: BlockKey) -> None:
        """Cut segment `top` after its first `head` nodes (the last of them `last`): the nodes below become a
        segment of their own, with the same workers and times."""
        mask = self._mask
        shard = top & mask
        parents, tops = self._parent, self._top
        bottom, length = self._bottom[shard][top], self._length[shard][top]
        below: list[BlockKey] = []
        key = bottom
        for _ in range(length - head):  # up from the bottom, to the node under `last`
            below.append(key)
            key = parents[key & mask][key]  # type: ignore[assignment]
        assert key == last
        new = below[-1]
        for key in below:
            tops[key & mask][key] = new
        workers = self._workers[shard][top]
        new_shard = new & mask
        self._bottom[new_shard][new] = bottom
        self._length[new_shard][new] = length - head
        self._used[new_shard][new] = self._used[shard][top]
        self._workers[new_shard][new] = workers if isinstance(workers, str) else dict(workers)
        self._bottom[shard][top] = last
        self._length[shard][top] = head
        self._last_walk = None

    def _grow(self, keys: Sequence[BlockKey], depth: int, parent: BlockKey | None, worker: str,
              now: float) -> BlockKey:
        """Add the nodes for keys[depth:] below `parent`; returns the deepest. They continue `parent`'s segment
        where it ends there, childless, sent only to `worker` at `now`; else they are a segment of their own."""
        new = len(keys) - depth
        self._worker_nodes[worker] = self._worker_nodes.get(worker, 0) + new
        self._nodes += new
        parents, children, tops, mask = self._parent, self._children, self._top, self._mask
        top = keys[depth]
        if parent is not None:
            shard = parent & mask
            children[shard][parent] += 1
            above = tops[shard][parent]
            above_shard = above & mask
            if (children[shard][parent] == 1 and self._used[above_shard][above] == now
                    and self._workers[above_shard][above] == worker):
                top = above  # the same stamps: one segment, longer
        node = parent
        for i in range(depth, len(keys)):
            key = keys[i]
            shard = key & mask
            parents[shard][key] = node
            children[shard][key] = 1  # the next one; the deepest gets 0 below
            tops[shard][key] = top
            node = key
        assert node is not None
        children[node & mask][node] = 0
        shard = top & mask
        if top == keys[depth]:
            self._length[shard][top] = new
            self._used[shard][top] = now
            self._workers[shard][top] = worker
        else:
            self._length[shard][top] += new
        self._bottom[shard][top] = node
        return node

    # --- eviction ---------------------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """Drop leaves nobody was sent within the TTL (their parents follow once they become leaves)."""
        limit = now - self.ttl_s
        while self._leaves and self._leaves[0][0] < limit:
            self.expirations += self._pop_leaf(limit, self._nodes)

    def _shrink(self, ceiling: int) -> None:
        while self._nodes > ceiling and self._leaves:
            self.evictions += self._pop_leaf(None, self._nodes - ceiling)

    def trim(self, work: int | None = None) -> bool:
        """Remove what `insert` left due with `slack` set: leaves past the TTL, then least-recently-used leaves down to
        `max_nodes`; at most `work` units (a node removed, or a leaf looked at, is one), all of it when None. Returns
        whether more is due (a later call goes on)."""
        now = self.clock()
        if self._step:
            now -= now % self._step
        limit = now - self.ttl_s
        left = -1 if work is None else work  # (`self._leaves` read anew each time: `_compact` may replace it)
        self._slicing = work is not None
        try:
            if self._rebuild is not None:  # a rebuild of the heap first, or the removals could starve it
                left = self._rebuild_step(left)
            dropped = self._dropped
            while left and dropped:  # the old heap freed: 1.1 million entries took 40-60 ms at once
                del dropped[-DROP_STEP:]
                left = left if left < 0 else left - 1
            while left and self._leaves and self._leaves[0][0] < limit:
                removed = self._pop_leaf(limit, self._nodes if left < 0 else left)
                self.expirations += removed
                left = left if left < 0 else max(0, left - max(1, removed))
            while left and self._nodes > self.max_nodes and self._leaves:
                excess = self._nodes - self.max_nodes
                removed = self._pop_leaf(None, excess if left < 0 else min(excess, left))
                self.evictions += removed
                left = left if left < 0 else max(0, left - max(1, removed))
        finally:
            self._slicing = False
        leaves = self._leaves
        self.trim_due = self._rebuild is not None or bool(self._dropped) or (
            bool(leaves) and (leaves[0][0] < limit or self._nodes > self.max_nodes))
        return self.trim_due

    def _pop_leaf(self, limit: float | None, most: int) -> int:
        """Remove the least-recently-used leaf and, up to `most` nodes in all, the ancestors that would be the
        next leaves evicted anyway (an unbranched chain used at the same time, or expired). Returns the count
        removed (0 for a stale heap entry).

        A leaf is its segment's bottom, and a segment's nodes share its workers and time and have one child each
        above its bottom, so the chain is removed a segment at a time: its nodes' three entries each, the
        segment's bookkeeping once. At the budget each cold 32,000-character prompt (one segment of 608 blocks)
        evicts as many nodes on the event loop: node by node that took about 0.85 ms of the insert's 1.65 (CPU,
        in process), 0.5 a segment at a time (issue 18)."""
        last, key = heapq.heappop(self._leaves)
        parents, children, tops, mask = self._parent, self._children, self._top, self._mask
        used, sent_to = self._used, self._workers
        shard = key & mask
        top = tops[shard].get(key)
        if top is None or used[top & mask][top] != last or children[shard][key]:
            return 0
        self._last_walk = None
        bound = last if limit is None else limit
        counts, lengths, bottoms = self._worker_nodes, self._length, self._bottom
        removed = 0
        while True:
            # segment `top`, from its bottom `key` up: as many nodes as `most` leaves, the whole segment if it can
            top_shard = top & mask
            length = lengths[top_shard][top]
            take = min(length, most - removed)
            node = key
            for _ in range(take - 1):  # every node taken below the last has a parent: the next one up
                shard = node & mask
                del children[shard][node], tops[shard][node]
                node = parents[shard].pop(node)  # type: ignore[assignment]
            shard = node & mask
            del children[shard][node], tops[shard][node]
            above = parents[shard].pop(node)
            removed += take
            workers = sent_to[top_shard][top]
            if isinstance(workers, str):
                counts[workers] -= take
            else:
                for url in workers:
                    counts[url] -= take
            if take < length:  # `most` reached inside it: the rest of the segment stays, `above` its bottom
                lengths[top_shard][top] = length - take
                bottoms[top_shard][top] = above  # type: ignore[assignment]
                break
            del bottoms[top_shard][top], lengths[top_shard][top], used[top_shard][top], sent_to[top_shard][top]
            # the segment above (`above` is its bottom) goes too if this was its only child and it is as old
            if removed >= most or above is None or children[above & mask][above] != 1:
                break
            top = tops[above & mask][above]
            at = used[top & mask][top]
            if not (at == bound if limit is None else at < bound):
                break
            key = above
        self._nodes -= removed
        if above is not None:
            shard = above & mask
            children[shard][above] -= 1
            if children[shard][above] == 0:
                top = tops[shard][above]
                self._push((used[top & mask][top], above))
        self._compact()
        return removed

    def _compact(self) -> None:
        """Rebuild the leaf heap when stale entries outnumber live nodes (each insert pushes one). In one call, or,
        inside a slice of the owner's removals (`trim` with a bound, or `insert` at the ceiling with `slack`), in the
        slices that follow (`_rebuild_step`): a rebuild of 1.66 million entries took 224 ms of CPU in one call, the
        event loop waiting (issue 18)."""
        if len(self._leaves) > 2 * self._nodes + 64 and self._rebuild is None:
            if self._slicing:
                self._rebuild, self._rebuild_shard, self._rebuild_keys = [], 0, []
                self.trim_due = True
                return
            mask, used = self._mask, self._used
            self._leaves = [(used[top & mask][top], key)
                            for children, tops in zip(self._children, self._top, strict=True)
                            for key, count in children.items() if count == 0 for top in (tops[key],)]
            heapq.heapify(self._leaves)

    def _rebuild_step(self, work: int) -> int:
        """Go on with a rebuild of the leaf heap for `work` units (a leaf looked at is one, and so is scanning a
        shard of the maps for its leaves; -1: to the end); returns the work left. The old heap serves meanwhile; every
        entry pushed goes to both, so a leaf that appears after its shard was scanned is in the new one too, and
        entries that go stale meanwhile are skipped when popped, as on the old one. Once every shard is scanned the
        new heap replaces the old: the same live entries, the stale ones left behind."""
        new = self._rebuild
        assert new is not None
        mask, used, tops, children = self._mask, self._used, self._top, self._children
        pending = self._rebuild_keys
        while work:
            if work > 0:
                work -= 1
            if not pending:
                shard = self._rebuild_shard
                if shard > mask:  # every shard scanned; the old heap is freed in later steps
                    self._dropped, self._leaves, self._rebuild = self._leaves, new, None
                    return work
                self._rebuild_shard = shard + 1
                pending = self._rebuild_keys = [key for key, count in children[shard].items() if count == 0]
                continue
            key = pending.pop()
            shard = key & mask
            top = tops[shard].get(key)
            if top is not None and children[shard][key] == 0:  # (still a leaf)
                heapq.heappush(new, (used[top & mask][top], key))
        return work

    def expire(self) -> None:
        """Apply the TTL now (insertions do it as they go)."""
        self._expire(self.clock())

    def forget_worker(self, url: str) -> None:
        """Remove a worker from every node; prefixes no worker holds any more are removed with their subtrees."""
        parents, children, tops, mask = self._parent, self._children, self._top, self._mask
        self._last_walk = None
        # a segment left with one worker keeps its dict: its last use may be the forgotten worker's time
        emptied = {top for sent_to in self._workers for top, workers in sent_to.items()
                   if (workers == url if isinstance(workers, str)
                       else workers.pop(url, None) is not None and not workers)}
        self._worker_nodes.pop(url, None)
        if not emptied:
            return
        for top in emptied:
            shard = top & mask
            del self._bottom[shard][top], self._length[shard][top], self._used[shard][top]
            del self._workers[shard][top]
        # a segment's workers include those of the segments below it: an emptied segment's subtree is emptied; the
        # top of one has a parent still held (or none)
        above = [parent for top in emptied
                 if (parent := parents[top & mask][top]) is not None and tops[parent & mask][parent] not in emptied]
        gone = [key for fields in tops for key, top in fields.items() if top in emptied]
        for key in gone:
            shard = key & mask
            del parents[shard][key], children[shard][key], tops[shard][key]
        self._nodes -= len(gone)
        for parent in above:
            shard = parent & mask
            children[shard][parent] -= 1
            if children[shard][parent] == 0:
                top = tops[shard][parent]
                self._push((self._used[top & mask][top], parent))

    def clear(self) -> None:
        self._last_walk = None
        for name in self._MAPS:
            for fields in getattr(self, name):
                fields.clear()
        self._nodes = 0
        self._leaves.clear()
        self._rebuild, self._rebuild_keys, self._dropped = None, [], []
        self._worker_nodes.clear()

    def stats(self) -> TrieStats:
        return TrieStats(self._nodes, self.max_nodes, self.evictions, self.expirations, dict(self._worker_nodes))

    def worker_nodes(self, url: str) -> int:
        """How many prefixes (blocks) the trie believes `url` holds: its share of the fleet's cached state."""
        return self._worker_nodes.get(url, 0)

    def nodes(self) -> dict[BlockKey, BlockKey | None]:
        """Every node with its parent (for checks)."""
        return {key: parent for fields in self._parent for key, parent in fields.items()}

    def segments(self) -> int:
        """How many segments the nodes are cut into (for checks)."""
        return sum(len(fields) for fields in self._length)

    def check(self) -> None:
        """Assert the nodes are a consistent tree, cut into consistent segments (for tests)."""
        mask = self._mask
        for name in self._MAPS:
            for shard, fields in enumerate(getattr(self, name)):
                assert all(key & mask == shard for key in fields), "an entry in another key's shard"
        parents = self.nodes()
        children = {key: n for fields in self._children for key, n in fields.items()}
        tops = {key: top for fields in self._top for key, top in fields.items()}
        assert parents.keys() == children.keys() == tops.keys()
        assert len(parents) == self._nodes, "node count out of step"
        bottoms = {top: key for fields in self._bottom for top, key in fields.items()}
        lengths = {top: n for fields in self._length for top, n in fields.items()}
        used = {top: t for fields in self._used for top, t in fields.items()}
        sent_to = {top: w for fields in self._workers for top, w in fields.items()}
        assert bottoms.keys() == lengths.keys() == used.keys() == sent_to.keys() == set(tops.values())
        for top, bottom in bottoms.items():
            chain = self._chain(bottom, top)
            assert len(chain) == lengths[top], "segment length out of step"
            assert all(tops[key] == top for key in chain), "a segment's node in another segment"
            assert all(children[key] == 1 for key in chain[1:]), "a branch inside a segment"
            parent = parents[top]
            assert parent is None or bottoms[tops[parent]] == parent, "a segment below the middle of another"
            workers = sent_to[top]
            assert isinstance(workers, str) or (workers and used[top] >= max(workers.values()))
        counts: dict[BlockKey, int] = {}
        for key, parent in parents.items():
            if parent is not None:
                assert parent in parents, "a node whose parent is gone"
                assert self._sent(key).keys() <= self._sent(parent).keys()
                assert all(at <= self._sent(parent)[url] for url, at in self._sent(key).items())
                assert used[tops[key]] <= used[tops[parent]]
                counts[parent] = counts.get(parent, 0) + 1
        for key, count in children.items():
            assert count == counts.get(key, 0), "child count out of step"
        held: dict[str, int] = {}
        for key in parents:
            for url in self._sent(key):
                held[url] = held.get(url, 0) + 1
        assert held == {url: n for url, n in self._worker_nodes.items() if n}, "worker node counts out of step"
        leaves = {(used[tops[key]], key) for key, count in children.items() if count == 0}
        assert leaves <= set(self._leaves), "a leaf not on the heap"
        if self._rebuild is not None:  # the shards scanned so far, but for the leaves still to push
            scanned = {(at, key) for at, key in leaves if key & mask < self._rebuild_shard}
            assert scanned - set(self._rebuild) <= {(used[tops[key]], key) for key in self._rebuild_keys}, \
                "a leaf not on the heap being built"

    def _chain(self, bottom: BlockKey, top: BlockKey) -> list[BlockKey]:
        """The nodes from `bottom` up to `top`, both included (one chain; for checks)."""
        parents, mask = self._parent, self._mask
        out = [bottom]
        key = bottom
        while key != top:
            up = parents[key & mask][key]
            assert up is not None, "a segment's bottom not below its top"
            key = up
            out.append(key)
        return out

    def _sent(self, key: BlockKey) -> dict[str, float]:
        """The workers sent node `key`, with when each last was (for checks)."""
        top = self._top[key & self._mask][key]
        shard = top & self._mask
        workers = self._workers[shard][top]
        return {workers: self._used[shard][top]} if isinstance(workers, str) else dict(workers)

    def sent_to(self) -> list[str | dict[str, float]]:
        """Every node's workers as kept: a URL, or URL -> last sent (for checks)."""
        mask = self._mask
        return [self._workers[top & mask][top] for fields in self._top for top in fields.values()]
