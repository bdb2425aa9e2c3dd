"""DRAM tier: blocks in this process's memory under a byte bound, LRU eviction in prefix order.

Prefix order: a block whose child (the next block of the same prefix) is resident is never evicted before that
child, so what survives pressure is always a usable leading run of blocks. Only leaves are eviction candidates;
reads touch a chain child-first so parents sit on the recent side of the LRU order. The victim is the least
recently used leaf, found in a heap of leaves by last use: a scan of the LRU order from its old end would pass
every parent older than its children first -- the heads of prefixes whose rest was saved in later steps, which
pile up at the old end -- for every block evicted.
The checksum is computed lazily (when a block leaves for NVMe or the shared tier): memory of this process is
trusted like the rest of it, and skipping the hash keeps stores at memcpy speed. A block's buffer comes from the
tier's pool (agent/tiers/buffers.py): the buffer of a block that left, once nothing reads it any more, or one
pre-faulted by `prefault`, so a store is a copy into pages already mapped.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from agent.block import BlockKey
from agent.tiers.base import Buffer, HeldBlock, RemovalListener, Removed, StoreItem, TierName, TierStats, TierUsage
from agent.tiers.buffers import PAGE, BlockBuffers, BufferStats, touch, unfilled
from agent.tiers.copies import LARGE_BYTES, ParallelCopier

# what a block costs this process besides its bytes: its DramBlock, its key (a tuple and the hash), its entry in the
# dict of blocks and in the heap of leaves. tracemalloc over 200,000 blocks stored into a DramTier: 313-371 bytes a
# block in chains, 378-435 unchained (each block a leaf), from int hashes of 64 bits (the connector's) to 64-byte
# hashes (the longest a request may name), 37-58 bytes more with 16 KiB payloads (their buffers' allocation). Not
# charged, an 8 MiB tier took 2 million empty blocks, the agent +653 MB (/tmp script, 0-byte blocks stored inline)
BLOCK_BOOKKEEPING = 512


def block_charge(size: int, bookkeeping: int = BLOCK_BOOKKEEPING) -> int:
    """What a block of `size` bytes counts against a DRAM tier's capacity: under a page, its bytes and its
    bookkeeping, a page at most; from a page on, its bytes alone, as ever (its bookkeeping is at most 12% of it,
    3% of vLLM's smallest blocks, 16 KiB: a capacity holds as many of them as before)."""
    return size if size >= PAGE else min(size + bookkeeping, PAGE)


@dataclass(slots=True, eq=False)
class DramBlock(HeldBlock):
    children: int = 0  # resident blocks whose parent this is: while any, this block is not evicted
    used: int = 0  # when it was last stored or read (a tick of the tier's clock)
    counted_by: DramBlock | None = None  # the parent block whose `children` counts this one


class DramTier:
    """`prefix_order=False` makes it plain LRU (the simulator's model of an LRU medium). `bookkeeping`: what each
    block under a page is charged besides its bytes (`block_charge`; the agent's tier: BLOCK_BOOKKEEPING); 0, its
    bytes alone (a model of a medium, whose capacity is in blocks' bytes)."""

    name = TierName.DRAM

    def __init__(self, capacity: int, high_watermark: float = 0.95, low_watermark: float = 0.85,
                 prefix_order: bool = True, copier: ParallelCopier | None = None, bookkeeping: int = 0) -> None:
        self.capacity = capacity
        self.bookkeeping = bookkeeping
        self.prefix_order = prefix_order
        self.high_bytes = int(capacity * high_watermark)
        self.low_bytes = int(capacity * low_watermark)
        self.stats = TierStats()
        self.on_removed: RemovalListener | None = None
        self._blocks: dict[BlockKey, DramBlock] = {}
        # (last use, key) of leaves; an entry is stale once the block is gone, used again or a parent again
        self._leaves: list[tuple[int, BlockKey]] = []
        self._ticks = itertools.count()
        self._used = 0  # blocks' charges (block_charge): their bytes, and the bookkeeping of those under a page
        self._unentered: DramBlock | None = None  # see _store_locked
        self._buffers = BlockBuffers(capacity)
        self.prefaulting = False
        self._lock = threading.Lock()
        # large blocks' copies on several threads (agent/tiers/copies.py); None: slice assignments
        self._copier = copier
        # while `store_many` holds the lock: the copies of the large blocks it entered, made together before it
        # lets go of the lock (or before anything is evicted): (key, block, payload); small ones are copied at once
        self._pending: list[tuple[BlockKey, DramBlock, Buffer]] | None = None

    # -- interface -------------------------------------------------------------------------------------------

    def store(self, key: BlockKey, payload: Buffer, digest: int | None = None,
              parent: BlockKey | None = None) -> bool:
        evicted: list[Removed] = []
        held = self._store(key, payload, digest, parent, evicted)
        self._report(evicted)
        return held

    def store_many(self, items: Sequence[StoreItem]) -> int:
        """Copy blocks in; what is evicted for them is reported once, so it can move down together.

        A new block whose child is the next item is not entered as a leaf (that entry would be stale as soon as
        the child is in): it is entered afterwards only if it is still a leaf then. Storing the child cannot
        evict it either way (the parent of the block being stored is spared).

        With a copier, the blocks' bytes are copied together at the end (large ones on several threads), still
        under the lock: a reader of a block takes the lock, so it never sees one whose bytes are not in yet."""
        evicted: list[Removed] = []
        with self._lock:  # once for the chain
            self._pending = [] if self._copier is not None else None
            try:
                held = self._store_chain_locked(items, evicted)
            finally:
                self._flush_locked()
                self._pending = None
        self._report(evicted)
        return held

    def _store_chain_locked(self, items: Sequence[StoreItem], evicted: list[Removed]) -> int:
        held = 0
        refused: BlockKey | None = None
        last = len(items) - 1
        deferred: tuple[DramBlock, BlockKey] | None = None  # the block stored just before, without its leaf entry
        for i, (key, payload, digest, parent) in enumerate(items):
            if parent is not None and parent == refused:  # the rest of a chain the tier cannot hold whole
                self.stats.add("refused")
                refused = key
            elif self._store_locked(key, payload, digest, parent, evicted,
                                    leaf=i == last or items[i + 1].parent != key or not self.prefix_order):
                held += 1
            else:
                refused = key
            if deferred is not None:
                block, block_key = deferred
                if block.children == 0 and self._blocks.get(block_key) is block:
                    heapq.heappush(self._leaves, (block.used, block_key))
                deferred = None
            if self._unentered is not None:
                deferred, self._unentered = (self._unentered, key), None
        return held

    def _flush_locked(self) -> None:
        """Make the copies `store_many` put off (all at once: large ones on several threads); a block whose copy
        failed leaves the tier again, never held with bytes that are not its own."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        try:
            self._copy([(block.data, payload) for _key, block, payload in pending])
        except BaseException:
            for key, block, _payload in pending:
                if self._blocks.get(key) is block:
                    self._remove_locked(key, block)
            raise

    def _copy(self, pairs: list[tuple[Buffer, Buffer]]) -> None:
        if self._copier is not None:
            self._copier.copy(pairs)
        else:
            for dst, src in pairs:
                dst[:] = src  # type: ignore[index]

    def _store(self, key: BlockKey, payload: Buffer, digest: int | None, parent: BlockKey | None,
               evicted: list[Removed]) -> bool:
        with self._lock:
            return self._store_locked(key, payload, digest, parent, evicted)

    def _store_locked(self, key: BlockKey, payload: Buffer, digest: int | None, parent: BlockKey | None,
                      evicted: list[Removed], leaf: bool = True) -> bool:
        """Copy a block in, evicting least recently used leaves to make room (added to `evicted`, with their bytes);
        a block bigger than the whole tier is refused. The DRAM tier's counters are only touched under its own
        lock. `leaf=False`: a new block is not entered as a leaf, and left in `_unentered` for the caller."""
        size = len(payload)
        charge = size if size >= PAGE else min(size + self.bookkeeping, PAGE)  # (block_charge, inline: per block)
        if charge > self.capacity:
            self.stats.add("refused")
            return False
        if not self.prefix_order:
            parent = None
        blocks = self._blocks
        existing = blocks.get(key)
        if existing is not None:
            self._use_locked(key, existing)
            return True
        if self._used + charge > self.capacity:
            evicted += self._evict_locked(self.capacity - charge, protect=parent)
            if self._used + charge > self.capacity:
                # what is left is this block's own ancestors (a chain longer than the tier): keep the chain's
                # head, which is what a lookup can use, and refuse its tail
                self.stats.refused += 1
                return False
        data = self._buffers.take(size, self._used)
        block = DramBlock(data, None, digest)
        if self._pending is not None and size >= LARGE_BYTES:  # copied before the lock is let go (`store_many`)
            self._pending.append((key, block, payload))
        else:
            data[:] = payload  # (the same length: a copy in place)
        if parent is not None:
            parent_block = blocks.get(parent)
            if parent_block is not None:
                parent_block.children += 1
                block.parent = parent
                block.counted_by = parent_block
        blocks[key] = block
        if leaf:
            self._use_locked(key, block)
        else:
            block.used = next(self._ticks)
            self._unentered = block
        self._used += charge
        self.stats.stores += 1
        return True

    def read_into(self, key: BlockKey, out: memoryview, touch: bool = True) -> int | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is None or len(block.data) > len(out):
                self.stats.misses += 1
                return None
            size = len(block.data)
            out[:size] = block.data
            if touch:
                self._use_locked(key, block)
            self.stats.hits += 1
            return size

    def read_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview], touch: bool = True) -> list[int | None]:
        return [self.read_into(key, out, touch) for key, out in zip(keys, outs, strict=True)]

    def read_run(self, keys: Sequence[BlockKey], outs: Sequence[memoryview], touch: bool = True) -> list[int]:
        """The leading run of `keys` this tier holds, copied into `outs` (under one lock, large blocks on several
        threads); their lengths. The block that ends the run, if any, counts as a miss, as `read_into` counts it."""
        lengths: list[int] = []
        pairs: list[tuple[Buffer, Buffer]] = []
        with self._lock:
            for key, out in zip(keys, outs, strict=True):
                block = self._blocks.get(key)
                if block is None or len(block.data) > len(out):
                    self.stats.misses += 1
                    break
                size = len(block.data)
                if size >= LARGE_BYTES and self._copier is not None:
                    pairs.append((out[:size], block.data))
                else:
                    out[:size] = block.data
                if touch:
                    self._use_locked(key, block)
                lengths.append(size)
            if pairs:
                self._copy(pairs)
            self.stats.hits += len(lengths)
        return lengths

    def held(self, key: BlockKey) -> DramBlock | None:
        """The resident block itself (no copy), for demotion and write-through; does not touch LRU order. Under the
        lock: a block `store_many` entered has its bytes once the lock is free."""
        with self._lock:
            return self._blocks.get(key)

    def contains(self, key: BlockKey) -> bool:
        return key in self._blocks

    def delete(self, key: BlockKey) -> bool:
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                return False
            # its children stay (leaves or not, they are evictable by their own count); a block stored later
            # under this key does not count them (they are counted by the object, `counted_by`)
            self._remove_locked(key, block)
        self._report([Removed(key)])
        return True

    def usage(self) -> TierUsage:
        return TierUsage(self._used, len(self._blocks), self.capacity)

    def block_keys(self) -> Iterable[BlockKey]:
        with self._lock:
            return list(self._blocks)

    def upkeep(self) -> None:
        pass

    def prefault(self, size: int, stop: threading.Event | None = None, batch: int = 64) -> int:
        """Fill the pool with free buffers of `size` bytes whose pages are mapped, until they and the resident
        blocks reach the capacity; blocks of that size are then stored with a plain copy. Slow (the kernel maps
        every page: seconds per GiB here): run it off the event loop; `stop` ends it early. Bytes added."""
        added = 0
        self.prefaulting = True
        try:
            while size > 0 and not (stop is not None and stop.is_set()):
                with self._lock:
                    buffers = self._buffers
                    fits = (self.capacity - self._used - buffers.free_bytes - buffers.returned_bytes) // size
                n = min(batch, fits)
                if n <= 0:
                    break
                fresh = [unfilled(size) for _ in range(n)]
                for buf in fresh:  # outside the lock: stores go on meanwhile
                    touch(buf)
                with self._lock:
                    for buf in fresh:
                        if not self._buffers.room(size, self._used):
                            break
                        self._buffers.add_free(buf)
                        added += size
        finally:
            self.prefaulting = False
        return added

    def buffer_stats(self) -> BufferStats:
        with self._lock:
            return self._buffers.stats()

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()

    # -- ordering and pressure -------------------------------------------------------------------------------

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark a prefix chain as used: children first, so each parent ends up more recent than its child."""
        with self._lock:
            for key in reversed(keys):
                block = self._blocks.get(key)
                if block is not None:
                    self._use_locked(key, block)

    def above_high_watermark(self) -> bool:
        return self._used > self.high_bytes

    def evict_to_low_watermark(self, offered: Collection[BlockKey] | None = None) -> None:
        """(`offered` is ignored: what goes is reported with its bytes, to move down.)"""
        with self._lock:
            evicted = self._evict_locked(self.low_bytes)
        self._report(evicted)

    def demotion_candidates(self) -> list[tuple[BlockKey, int]]:
        return []  # an eviction reports the evicted blocks with their bytes

    def _use_locked(self, key: BlockKey, block: DramBlock) -> None:
        block.used = next(self._ticks)
        if block.children == 0:
            heapq.heappush(self._leaves, (block.used, key))
            if len(self._leaves) > 2 * len(self._blocks) + 1024:  # mostly stale entries: rebuild
                self._leaves = [(b.used, k) for k, b in self._blocks.items() if b.children == 0]
                heapq.heapify(self._leaves)

    def _evict_locked(self, target: int, protect: BlockKey | None = None) -> list[Removed]:
        """Evict least recently used leaves until usage <= target (the copies put off made first: a block leaves
        with its bytes, and its buffer is never reused while a copy into it is pending)."""
        self._flush_locked()
        evicted: list[Removed] = []
        spared: list[tuple[int, BlockKey]] = []
        leaves = self._leaves
        while self._used > target and leaves:
            used, key = heapq.heappop(leaves)
            block = self._blocks.get(key)
            if block is None or block.used != used or block.children:
                continue  # stale
            if key == protect:
                spared.append((used, key))
                continue
            self._remove_locked(key, block)
            evicted.append(Removed(key, block))
        for entry in spared:  # the parent of the block being stored: still a leaf, still that old
            heapq.heappush(leaves, entry)
        self.stats.evictions += len(evicted)
        return evicted

    def _remove_locked(self, key: BlockKey, block: DramBlock) -> None:
        del self._blocks[key]
        self._used -= block_charge(len(block.data), self.bookkeeping)
        self._buffers.give_back(block.data)  # reused once whoever still reads the block (a demotion) is done
        parent_block = block.counted_by
        if parent_block is not None and block.parent is not None and self._blocks.get(block.parent) is parent_block:
            parent_block.children -= 1
            if parent_block.children == 0:  # a leaf again, as old as its last use
                heapq.heappush(self._leaves, (parent_block.used, block.parent))

    def _report(self, removed: list[Removed]) -> None:
        """Hand blocks that left to the listener (with their bytes, where evicted), then settle their buffers: the
        caller's list is emptied, so what nobody else holds is free to reuse now."""
        if not removed:
            return
        if self.on_removed is not None:
            self.on_removed(list(removed))
        n = len(removed)
        removed.clear()
        with self._lock:
            self._buffers.settle(n, self._used)
