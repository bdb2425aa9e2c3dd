"""The approximate prefix index: which workers were recently sent which block-key prefixes.

Without engine KV events the gateway can only remember its own routing decisions. `PrefixTrie` keeps them as a
trie whose path is a prompt's chained block keys and whose nodes hold the workers sent that prefix, with the time
each was last sent it. It is bounded twice — a node budget and a TTL — and evicts least-recently-used leaves first,
so a flood of unique prompts cannot grow it past its budget.

A path is cut into segments, stretches of nodes one below the other whose workers and times are the same, and the
trie keeps segments, not nodes: each one's block keys packed into one bytes object, and its bookkeeping once (its
parent, the child count of its bottom, its workers and times). Because block keys are chained, one key names its
whole prefix, so a walk steps from segment top to segment top, one dict step per segment (and a search in the
segment's own keys only where a prompt parts from it or ends inside it). Sending a prompt again stamps each segment
of its path, not each block (a 4,000-character system prompt's 62 blocks are one segment, its questions one each);
growing a cold prompt packs its new keys once; evicting the bottom of a segment is one slice of its keys. The work
per request, and per removal, follows the segments it touches, not their length (issue 18: with three dict entries
per node, a cold 32,000-character prompt's 608 new nodes cost 0.66-0.80 ms of the event loop's CPU to add and as
much to evict; a prompt of 4,096 blocks now runs the Python lines of one of 64). A segment splits where a new
prompt parts from it or ends inside it, and grows where a prompt continues the one that made it in the same step.
Times are kept in steps of `TOUCH_S` (or a hundredth of the TTL, if shorter), so a segment stamped in the current
step for a worker is not stamped again.

The maps are split by key into `SHARDS` dicts each: a dict that outgrows its table is copied whole into a larger
one, with the GIL held, and the maps of one trie grew at the same insert — at 87,000 nodes 20-50 ms in one call,
the event loop (and `/health`) waiting; a shard holds a 64th of the segments, and the shards outgrow their tables
at different inserts.
"""

from __future__ import annotations

import heapq
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcore.dict_tables import TableTrim
from router.block_keys import BlockKey

TOUCH_S = 1.0  # step of the times kept (a segment stamped in the current step is not stamped again)
SHARDS = 64  # dicts per map, by the key's low bits (a power of two)
DROP_STEP = 256  # entries of a replaced leaf heap freed per unit of `trim`'s work

ORDER = sys.byteorder  # of the keys packed into a segment's bytes (as `array('Q')` packs them)

# a walk of a prompt's path: how many leading keys are nodes, and the segments they run through (each segment's
# top key and the index in the keys just past its last node on the path)
Path = tuple[int, list[BlockKey], list[int]]


def _last(run: bytes) -> BlockKey:
    """The last key of a segment's packed keys: its bottom."""
    return int.from_bytes(run[-8:], ORDER)


@dataclass(frozen=True, slots=True)
class TrieStats:
    nodes: int
    max_nodes: int
    evictions: int
    expirations: int
    workers: dict[str, int]


class PrefixTrie:
    """Block-key prefixes → workers recently sent them; bounded by `max_nodes` and `ttl_s`.

    A segment is kept by its top key, in dicts: its keys (top first, packed as `array('Q')` packs them: block keys
    are xxh3_64, unsigned 64-bit), its top's parent key, its bottom's child count, its last use and the workers sent
    it with when; and its bottom key names it too (`_ending`: the walk's test that a prompt runs through a segment
    to its bottom, and the way up from a leaf). No node has an entry of its own. Dicts holding only numbers, strings
    and bytes are not tracked by Python's cycle collector; an object per node or segment would be (an `array` too,
    hence bytes), and every full collection walks all tracked objects with the GIL held (35,000-67,000 nodes after
    100 prompts of 32,000 characters cost 86-133 ms per collection, the event loop stalled meanwhile).

    A segment's nodes above its bottom have one child each (the next key of its run): a branch, or the end of a
    prompt, is a segment's bottom, and a segment's top is a first block or a child of another segment's bottom.
    Every node of a segment has that segment's workers and times.

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
        # leaves (segment bottoms without children) by last use: (time, bottom key); entries go stale when a leaf
        # is used again, gains a child or is removed
        self._leaves: list[tuple[float, BlockKey]] = []
        # a rebuild of the leaf heap in slices (`_compact`, `trim`): the heap being built (every push goes to it too),
        # the next shard of the maps to scan and the segments of the last one scanned not yet looked at
        self._rebuild: list[tuple[float, BlockKey]] | None = None
        self._rebuild_shard = 0
        self._rebuild_keys: list[BlockKey] = []
        self._dropped: list[tuple[float, BlockKey]] = []  # the heap a rebuild replaced, freed a slice at a time
        self._slicing = False  # removals now are a slice of the owner's (`trim` with a bound): `_compact` slices too
        self._worker_nodes: dict[str, int] = {}
        self._trims: list[tuple[TableTrim, dict[Any, Any]]] = []  # see compact_tables
        self.evictions = 0  # nodes removed to stay under max_nodes
        # nodes `insert` may leave over `max_nodes`, with what the TTL removes, for its owner to remove in slices
        # (`trim`) between other work: 0, insert removes them itself. The gateway's strategies set it (issue 18: at
        # the budget, a cold 32,000-character prompt's 608 new nodes evicted 300 two-block leaves of earlier
        # questions, 2.5 ms of CPU on the event loop in one call)
        self.slack = 0
        self.trim_due = False  # with slack: something is due for `trim` (as of the last insert or trim)
        self.expirations = 0  # nodes removed because nobody was sent them within ttl_s

    _MAPS = ("_keys", "_parent", "_children", "_used", "_workers", "_ending")

    def _shard_maps(self, shards: int) -> None:
        """The maps as `shards` dicts each (`key` in dict `key & self._mask`), their entries kept."""
        old = [getattr(self, name, [{}]) for name in self._MAPS]
        self._mask = shards - 1
        maps: list[list[dict[Any, Any]]] = [[{} for _ in range(shards)] for _ in old]
        for shard_maps, old_maps in zip(maps, old, strict=True):
            for fields in old_maps:
                for key, value in fields.items():
                    shard_maps[key & self._mask][key] = value
        # per segment, by its top key: its keys (top first), its top's parent (None for a first block), its
        # bottom's child count, when last sent to any worker, and the workers sent it: the URL of the only one
        # (last sent: the segment's `_used`), or url -> last sent
        self._keys: list[dict[BlockKey, bytes]] = maps[0]
        self._parent: list[dict[BlockKey, BlockKey | None]] = maps[1]
        self._children: list[dict[BlockKey, int]] = maps[2]
        self._used: list[dict[BlockKey, float]] = maps[3]
        self._workers: list[dict[BlockKey, str | dict[str, float]]] = maps[4]
        # per segment, by its bottom key: its top key
        self._ending: list[dict[BlockKey, BlockKey]] = maps[5]

    def __len__(self) -> int:
        return self._nodes

    def compact_tables(self) -> None:
        """From now on keep the maps at the table size a copy of them would have (`TableTrim`; segments come and
        go, evicted at the budget or expired): half their memory, for copying a map into itself (tens of ms per
        100,000 entries) whenever CPython would grow it. For long simulations (`kvgate bench vsim`); a live gateway
        would stall its event loop meanwhile. The maps become one dict each (a copy of each of 64 shards could not
        be told when it is due, and small dicts are left alone)."""
        self._rebuild, self._rebuild_keys = None, []  # (its shard numbers would change; the old heap is whole)
        self._shard_maps(1)
        self._trims = [(TableTrim(), getattr(self, name)[0]) for name in self._MAPS]

    # --- lookup -----------------------------------------------------------------------------------------------

    def _walk(self, keys: Sequence[BlockKey]) -> Path:
        """How many leading `keys` are nodes, and the segments they run through: three dict steps per segment (its
        top, the top's parent, and its bottom among the keys), and a binary search in the segment's own keys only
        where the keys part from it or end inside it."""
        segments, parents, ending, mask = self._keys, self._parent, self._ending, self._mask
        tops: list[BlockKey] = []
        ends: list[int] = []
        i, n = 0, len(keys)
        above: BlockKey | None = None
        while i < n:
            top = keys[i]
            # a node after a segment's bottom is a segment's top (the first one too): not a top, not a node; nor is
            # a top below another key (the same key elsewhere in the trie: a collision of chained keys)
            run = segments[top & mask].get(top)
            if run is None or parents[top & mask][top] != above:
                break
            tops.append(top)
            length = len(run) >> 3
            end = i + length
            if end <= n and ending[(key := keys[end - 1]) & mask].get(key) == top:  # (its bottom)
                ends.append(end)
                i = end
                above = key
                continue
            # the keys part from the segment (or end) inside it: chained, they equal its keys up to where they part
            view = memoryview(run).cast("Q")
            lo, hi = 1, min(length, n - i)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if keys[i + mid - 1] == view[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            ends.append(i + lo)
            return i + lo, tops, ends
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
        segments, sent_to, used = self._keys, self._workers, self._used
        start = 0
        for top, end in zip(tops, ends, strict=True):
            shard = top & mask
            sent = sent_to[shard][top]
            stamped = (used[shard][top] == now and sent == worker) if isinstance(sent, str) else sent.get(worker) == now
            # the path ends (or parts, new nodes to grow there) inside the segment: it splits at that point (if
            # refused, a key of the segment already elsewhere, the prompt is not remembered past here)
            if ((end - start) << 3 < len(segments[shard][top]) and (grows or not stamped)
                    and not self._split(top, end - start)):
                return
            if not stamped:
                self._stamp(top, worker, now)
            start = end
        node = keys[depth - 1] if depth else None
        if grows:
            for trim, fields in self._trims:  # the maps take a segment or two: copied before, not after
                trim.make_room(fields, 2)
            grown = self._grow(keys, depth, node, worker, now)
            if grown is not None:  # (else nothing new remembered, a key already elsewhere: the path ends above)
                node = grown
        if node is None:
            return
        # the path's end is a leaf (a segment's bottom without children) used now: onto the heap
        at = self._ending[node & mask].get(node)
        if at is not None and self._children[at & mask][at] == 0 and used[at & mask][at] == now:
            self._push((now, node))
            if len(self._leaves) > 2 * self._nodes + 64:  # stale entries of leaves used again, with nothing removed
                self._slicing = bool(self.slack)  # (with slack, in the owner's trim slices)
                try:
                    self._compact()
                finally:
                    self._slicing = False
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
                counts[worker] = counts.get(worker, 0) + (len(self._keys[shard][top]) >> 3)
                sent_to[top] = {workers: used[top], worker: now}
        else:
            if worker not in workers:
                counts[worker] = counts.get(worker, 0) + (len(self._keys[shard][top]) >> 3)
            workers[worker] = now
        used[top] = now

    def _split(self, top: BlockKey, head: int) -> bool:
        """Cut segment `top` after its first `head` nodes: the nodes below become a segment of their own (its
        keys a slice of this one's), with the same workers and times. Refused (False, nothing changed) where the
        new top is a segment's top already, or the new bottom a segment's bottom: the same key at two places (a
        collision of chained keys, or a key repeated in one prompt) must not overwrite another segment's entry."""
        mask = self._mask
        shard = top & mask
        run = self._keys[shard][top]
        above, below = run[: head << 3], run[head << 3:]
        new, last, bottom = int.from_bytes(below[:8], ORDER), int.from_bytes(above[-8:], ORDER), _last(below)
        new_shard = new & mask
        if new in self._keys[new_shard] or last in self._ending[last & mask]:
            return False
        self._keys[shard][top] = above
        self._keys[new_shard][new] = below
        self._parent[new_shard][new] = last
        self._children[new_shard][new] = self._children[shard][top]
        self._children[shard][top] = 1
        self._used[new_shard][new] = self._used[shard][top]
        workers = self._workers[shard][top]
        self._workers[new_shard][new] = workers if isinstance(workers, str) else dict(workers)
        self._ending[bottom & mask][bottom] = new
        self._ending[last & mask][last] = top
        self._last_walk = None
        return True

    def _grow(self, keys: Sequence[BlockKey], depth: int, parent: BlockKey | None, worker: str,
              now: float) -> BlockKey | None:
        """Add the nodes for keys[depth:] below `parent` (a segment's bottom); returns the deepest. They continue
        `parent`'s segment where it ends there, childless, sent only to `worker` at `now` (its keys extended);
        else they are a segment of their own (its keys packed at once). None, nothing added, where the new bottom
        is another segment's bottom already or the new top a segment's top (see `_split`)."""
        mask, ending = self._mask, self._ending
        bottom, top = keys[-1], keys[depth]
        above: BlockKey | None = None
        if parent is not None:
            above = ending[parent & mask][parent]
            shard = above & mask
            if (self._children[shard][above] == 0 and self._used[shard][above] == now
                    and self._workers[shard][above] == worker):
                # the same stamps: one segment, longer
                if bottom != parent and bottom in ending[bottom & mask]:
                    return None
                new = len(keys) - depth
                self._worker_nodes[worker] = self._worker_nodes.get(worker, 0) + new
                self._nodes += new
                self._keys[shard][above] += array("Q", keys[depth:]).tobytes()
                del ending[parent & mask][parent]
                ending[bottom & mask][bottom] = above
                return bottom
        shard = top & mask
        if top in self._keys[shard] or bottom in ending[bottom & mask]:
            return None
        if above is not None:
            self._children[above & mask][above] += 1
        new = len(keys) - depth
        self._worker_nodes[worker] = self._worker_nodes.get(worker, 0) + new
        self._nodes += new
        self._keys[shard][top] = array("Q", keys[depth:]).tobytes()
        self._parent[shard][top] = parent
        self._children[shard][top] = 0
        self._used[shard][top] = now
        self._workers[shard][top] = worker
        ending[bottom & mask][bottom] = top
        return bottom

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
        whether more is due (a later call goes on).

        A unit is still a node, though a node no longer costs a unit's work: removing a segment, or cutting the
        bottom off one, costs the same few lines whatever its length, so the owner's slices (`PrefillBalance`, in
        steps of 32) remove the nodes of a cold prompt 32 at a time at a fraction of a microsecond each, and a slice
        ends on its clock, not on a count. Kept a node so a slice removes what the same slice of `insert` without
        slack would (the counters step by at most `work`)."""
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
        above its bottom, so the chain is removed a segment at a time: a whole segment is its entries in the maps,
        the bottom of one is a slice of its keys. At the budget each cold 32,000-character prompt (one segment of
        608 blocks) evicts as many nodes on the event loop: node by node that took about 0.85 ms of the insert's
        1.65 (CPU, in process), 0.5 with the segment's bookkeeping once and the nodes' entries one by one (issue
        18), and now the same few lines whatever the segment's length."""
        last, key = heapq.heappop(self._leaves)
        mask, ending = self._mask, self._ending
        top = ending[key & mask].get(key)
        if top is None:
            return 0
        shard = top & mask
        segments, parents, children, used, sent_to = self._keys, self._parent, self._children, self._used, self._workers
        if used[shard][top] != last or children[shard][top]:
            return 0
        self._last_walk = None
        bound = last if limit is None else limit
        counts = self._worker_nodes
        removed = 0
        while True:
            # segment `top`, from its bottom `key` up: as many nodes as `most` leaves, the whole segment if it can
            run = segments[shard][top]
            length = len(run) >> 3
            take = min(length, most - removed)
            assert take > 0
            if take < length:  # the bottom left must not be another segment's bottom already (see `_split`)
                cut = (length - take) << 3
                kept = int.from_bytes(run[cut - 8:cut], ORDER)
                if kept != key and kept in ending[kept & mask]:
                    take = length
            removed += take
            workers = sent_to[shard][top]
            if isinstance(workers, str):
                counts[workers] -= take
            else:
                for url in workers:
                    counts[url] -= take
            del ending[key & mask][key]
            if take < length:  # `most` reached inside it: the rest of the segment stays, a leaf now
                segments[shard][top] = run = run[: (length - take) << 3]
                bottom = _last(run)
                ending[bottom & mask][bottom] = top
                children[shard][top] = 0  # (its child, if any, was removed above)
                self._nodes -= removed
                self._push((used[shard][top], bottom))
                self._compact()
                return removed
            above = parents[shard].pop(top)
            del segments[shard][top], children[shard][top], used[shard][top], sent_to[shard][top]
            # the segment above (`above` is its bottom) goes too if this was its only child and it is as old
            if removed >= most or above is None:
                break
            up = ending[above & mask][above]
            up_shard = up & mask
            if children[up_shard][up] != 1:
                break
            at = used[up_shard][up]
            if not (at == bound if limit is None else at < bound):
                break
            key, top, shard = above, up, up_shard
        self._nodes -= removed
        if above is not None:
            up = ending[above & mask][above]
            up_shard = up & mask
            children[up_shard][up] -= 1
            if children[up_shard][up] == 0:
                self._push((used[up_shard][up], above))
        self._compact()
        return removed

    def _compact(self) -> None:
        """Rebuild the leaf heap when stale entries outnumber live nodes (each insert pushes one; checked at each
        removal, and at each push, so a trie that removes nothing does not keep an entry per insert). In one call, or,
        inside a slice of the owner's removals (`trim` with a bound, or `insert` at the ceiling with `slack`), in the
        slices that follow (`_rebuild_step`): a rebuild of 1.66 million entries took 224 ms of CPU in one call, the
        event loop waiting (issue 18)."""
        if len(self._leaves) > 2 * self._nodes + 64 and self._rebuild is None:
            if self._slicing:
                self._rebuild, self._rebuild_shard, self._rebuild_keys = [], 0, []
                self.trim_due = True
                return
            self._leaves = [(used[top], _last(segments[top]))
                            for children, used, segments in zip(self._children, self._used, self._keys, strict=True)
                            for top, count in children.items() if count == 0]
            heapq.heapify(self._leaves)

    def _rebuild_step(self, work: int) -> int:
        """Go on with a rebuild of the leaf heap for `work` units (a segment looked at is one, and so is scanning a
        shard of the maps for its leaf segments; -1: to the end); returns the work left. The old heap serves
        meanwhile; every entry pushed goes to both, so a leaf that appears after its shard was scanned is in the new
        one too, and entries that go stale meanwhile are skipped when popped, as on the old one. Once every shard is
        scanned the new heap replaces the old: the same live entries, the stale ones left behind."""
        new = self._rebuild
        assert new is not None
        mask, used, segments, children = self._mask, self._used, self._keys, self._children
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
                pending = self._rebuild_keys = [top for top, count in children[shard].items() if count == 0]
                continue
            top = pending.pop()
            shard = top & mask
            run = segments[shard].get(top)
            if run is not None and children[shard][top] == 0:  # (still a leaf segment)
                heapq.heappush(new, (used[shard][top], _last(run)))
        return work

    def expire(self) -> None:
        """Apply the TTL now (insertions do it as they go)."""
        self._expire(self.clock())

    def forget_worker(self, url: str) -> None:
        """Remove a worker from every node; prefixes no worker holds any more are removed with their subtrees."""
        self._last_walk = None
        # a segment left with one worker keeps its dict: its last use may be the forgotten worker's time
        emptied = [top for sent_to in self._workers for top, workers in sent_to.items()
                   if (workers == url if isinstance(workers, str)
                       else workers.pop(url, None) is not None and not workers)]
        self._worker_nodes.pop(url, None)
        if not emptied:
            return
        # a segment's workers include those of the segments below it: an emptied segment's subtree is emptied
        mask, ending, children = self._mask, self._ending, self._children
        above: list[BlockKey] = []
        for top in emptied:
            shard = top & mask
            run = self._keys[shard].pop(top)
            parent = self._parent[shard].pop(top)
            del children[shard][top], self._used[shard][top], self._workers[shard][top]
            bottom = _last(run)
            del ending[bottom & mask][bottom]
            self._nodes -= len(run) >> 3
            if parent is not None:
                above.append(parent)
        for parent in above:
            up = ending[parent & mask].get(parent)
            if up is None:  # its segment emptied too
                continue
            shard = up & mask
            children[shard][up] -= 1
            if children[shard][up] == 0:
                self._push((self._used[shard][up], parent))

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
        out: dict[BlockKey, BlockKey | None] = {}
        for segments, parents in zip(self._keys, self._parent, strict=True):
            for top, run in segments.items():
                parent = parents[top]
                for key in array("Q", run):
                    out[key] = parent
                    parent = key
        return out

    def segments(self) -> int:
        """How many segments the nodes are cut into (for checks)."""
        return sum(len(fields) for fields in self._keys)

    def check(self, distinct: bool = True) -> None:
        """Assert the segments are a consistent tree of nodes, with consistent bookkeeping (for tests). `distinct`:
        every key at one place only (no two keys of the trie's prompts collided)."""
        mask = self._mask
        for name in self._MAPS:
            for shard, fields in enumerate(getattr(self, name)):
                assert all(key & mask == shard for key in fields), "an entry in another key's shard"
        runs = {top: run for fields in self._keys for top, run in fields.items()}
        parents = {top: p for fields in self._parent for top, p in fields.items()}
        children = {top: n for fields in self._children for top, n in fields.items()}
        used = {top: t for fields in self._used for top, t in fields.items()}
        sent_to = {top: w for fields in self._workers for top, w in fields.items()}
        ending = {bottom: top for fields in self._ending for bottom, top in fields.items()}
        assert runs.keys() == parents.keys() == children.keys() == used.keys() == sent_to.keys()
        for top, run in runs.items():
            assert type(run) is bytes and run and len(run) % 8 == 0, "a segment's keys not packed"
            assert int.from_bytes(run[:8], ORDER) == top, "a segment's keys not from its top"
        assert ending == {_last(run): top for top, run in runs.items()}, "a segment's bottom out of step"
        nodes = self.nodes()
        assert sum(len(run) >> 3 for run in runs.values()) == self._nodes, "node count off"
        assert len(nodes) == self._nodes or not distinct, "a node twice"
        counts: dict[BlockKey, int] = {}
        for top, parent in parents.items():
            if parent is None:
                continue
            # a segment's top is the child of another's bottom, never of a node in the middle of one
            assert parent in ending, "a segment below the middle of another, or below nothing"
            above = ending[parent]
            counts[above] = counts.get(above, 0) + 1
            sent, sent_above = self._sent(top), self._sent(above)
            assert sent.keys() <= sent_above.keys(), "a worker sent a node but not its parent"
            assert all(at <= sent_above[url] for url, at in sent.items())
            assert used[top] <= used[above]
        for top, count in children.items():
            assert count == counts.get(top, 0), "child count out of step"
        for top in runs:  # up from every segment to a first block: no cycle
            seen = 0
            parent = parents[top]
            while parent is not None:
                seen += 1
                assert seen <= len(runs), "a cycle of segments"
                parent = parents[ending[parent]]
        for top, workers in sent_to.items():
            assert isinstance(workers, str) or (workers and used[top] >= max(workers.values()))
        held: dict[str, int] = {}
        for top, run in runs.items():
            for url in self._sent(top):
                held[url] = held.get(url, 0) + (len(run) >> 3)
        assert held == {url: n for url, n in self._worker_nodes.items() if n}, "worker node counts out of step"
        leaves = {(used[top], _last(runs[top])) for top, count in children.items() if count == 0}
        assert leaves <= set(self._leaves), "a leaf not on the heap"
        if self._rebuild is not None:  # the shards scanned so far, but for the segments still to look at
            scanned = {(used[top], _last(runs[top])) for top, count in children.items()
                       if count == 0 and top & mask < self._rebuild_shard}
            pending = {(used[top], _last(runs[top])) for top in self._rebuild_keys if top in runs}
            assert scanned - set(self._rebuild) <= pending, "a leaf not on the heap being built"

    def _sent(self, top: BlockKey) -> dict[str, float]:
        """The workers sent segment `top`, with when each last was (for checks)."""
        shard = top & self._mask
        workers = self._workers[shard][top]
        return {workers: self._used[shard][top]} if isinstance(workers, str) else dict(workers)

    def sent_to(self) -> list[str | dict[str, float]]:
        """Every node's workers as kept, in the order of the nodes' keys: a URL, or URL -> last sent (for
        checks)."""
        nodes = sorted((key, top) for fields in self._keys for top, run in fields.items() for key in array("Q", run))
        mask = self._mask
        return [self._workers[top & mask][top] for _, top in nodes]
