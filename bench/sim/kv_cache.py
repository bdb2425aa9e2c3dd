"""The simulated paged KV cache: a block pool with vLLM's prefix caching, free-block queue and KV events.

Mirrors vLLM v1's `BlockPool` / `KVCacheManager` (one KV-cache group): block 0 is the null block; free blocks sit
in a doubly linked queue, allocation pops from its head, freeing appends to its tail (a request's blocks in reverse
order, so its tail blocks are evicted first); a free block that still holds a cached hash stays findable until it
is popped for reuse, which evicts it (`BlockRemoved`). Only full blocks are cached (`BlockStored`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from kvcore.kv_events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvcore.vllm_hash import Digest, EventHash


class KvBlock:
    """One physical block: its id, how many requests use it, and its block hash while it is cached."""

    __slots__ = ("block_hash", "block_id", "event_hash", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Digest | None = None
        self.event_hash: EventHash = 0  # block_hash as events carry it, while block_hash is set
        self.prev_free: KvBlock | None = None
        self.next_free: KvBlock | None = None

    def __repr__(self) -> str:
        return f"KvBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """vLLM's `FreeKVCacheBlockQueue`: O(1) pop from the head, append to the tail, removal from the middle."""

    def __init__(self, blocks: Sequence[KvBlock]) -> None:
        self._head = KvBlock(-1)
        self._tail = KvBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KvBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KvBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KvBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KvBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


@dataclass
class PrefixCacheStats:
    """Counters since start, in tokens (as vLLM's prefix_cache_queries / prefix_cache_hits)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits


@dataclass
class ExternalCacheStats:
    """A KV connector's lookups, in tokens (vLLM's external_prefix_cache_queries / _hits): what the engine asked
    beyond its own prefix-cache hit, what the connector had, and by which tier (vLLM's CacheHitSource values)."""

    queries: int = 0
    hits: int = 0
    hits_by_source: dict[str, int] = field(default_factory=dict)
    load_errors: int = 0  # blocks a lookup promised that could not be loaded (recomputed instead)


class BlockPool:
    """All blocks of the cache, the hash → block map of cached blocks, and the events of what changed."""

    def __init__(self, num_blocks: int, block_size: int, event_hash: Callable[[Digest], EventHash] | None,
                 enable_events: bool = True, removals_per_block: bool = True) -> None:
        """`event_hash`: a digest as events carry it; None when the digests are 64-bit ints that events carry as
        they are (the virtual-time fleet's engines: one call less per block). `removals_per_block`: a
        `BlockRemoved` per evicted block, as vLLM sends them; False: one per allocation that evicted (the
        virtual-time fleet, which applies them in the same order, without an event object per block)."""
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is vLLM's null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KvBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        # hash -> the block holding it, or (rarely: two requests computed the same block before either was cached)
        # the blocks holding it by id, in the order they got it; a map per cached block cost 224 bytes each
        self.cached: dict[Digest, KvBlock | dict[int, KvBlock]] = {}
        self._event_hash: Callable[[Digest], EventHash] = event_hash or _as_event_hash
        self._identity = event_hash is None
        self.enable_events = enable_events
        self.removals_per_block = removals_per_block
        self.events: list[KvEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: the fraction of non-null blocks in use by requests (0..1)."""
        total = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / total if total else 0.0

    def get_cached_block(self, block_hash: Digest) -> KvBlock | None:
        holders = self.cached.get(block_hash)
        if holders is None or type(holders) is KvBlock:
            return holders
        return next(iter(holders.values()))  # type: ignore[union-attr]

    def cache_full_blocks(self, blocks: Sequence[KvBlock], block_hashes: Sequence[Digest], num_cached: int,
                          num_full: int, token_ids: Sequence[int],
                          first_block_extra: tuple[Any, ...] | None = None) -> None:
        """Give blocks[num_cached:num_full] their hashes and announce them in one `BlockStored`.

        `first_block_extra` is block 0's hash extra keys (cache_salt); events carry them untagged, one entry
        per block (None for a block without extra keys), as vLLM's `to_event_extra_keys`."""
        if num_cached >= num_full:
            return
        new_hashes: list[EventHash] = []
        to_event = None if self._identity else self._event_hash
        cached = self.cached
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block.block_hash is not None:  # already cached (a prefix hit); vLLM skips it too
                continue
            digest = block_hashes[i]
            block.block_hash = digest
            if to_event is None:
                event: EventHash = digest  # an int already (no call per block)
            else:
                event = to_event(digest)
            block.event_hash = event
            holders = cached.get(digest)
            if holders is None:
                cached[digest] = block
            elif type(holders) is KvBlock:
                cached[digest] = {holders.block_id: holders, block.block_id: block}
            else:
                holders[block.block_id] = block  # type: ignore[index]
            new_hashes.append(event)
        if self.enable_events and new_hashes:
            bs = self.block_size
            parent = self._event_hash(block_hashes[num_cached - 1]) if num_cached > 0 else None
            extra: list[Any] = [None] * len(new_hashes)
            if num_cached == 0 and first_block_extra:
                extra[0] = tuple(key[1:] if key[0] == "mm" else key[1] for key in first_block_extra)
            self.events.append(BlockStored(
                block_hashes=new_hashes, parent_block_hash=parent,
                token_ids=list(token_ids[num_cached * bs:num_full * bs]), block_size=bs, medium=GPU,
                extra_keys=extra, group_idx=0, kv_cache_spec_kind="full_attention",
            ))

    def get_new_blocks(self, n: int) -> list[KvBlock]:
        """Pop n blocks from the head of the free queue, evicting the cached ones (LRU first)."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks from the pool ({self.num_free_blocks} free)")
        out = []
        evicted: list[EventHash] = []
        queue = self.free_queue
        # the queue's popleft, inline: this runs for every block a prefill computes
        head = queue._head
        for _ in range(n):
            block = head.next_free
            assert block is not None and block is not queue._tail
            nxt = block.next_free
            assert nxt is not None
            head.next_free = nxt
            nxt.prev_free = head
            block.prev_free = block.next_free = None
            if block.block_hash is not None:
                self._evict(block)
                evicted.append(block.event_hash)
            block.ref_cnt += 1
            out.append(block)
        queue.num_free_blocks -= n
        if evicted and self.enable_events:
            if self.removals_per_block:
                self.events.extend(BlockRemoved(block_hashes=[h], medium=GPU, group_idx=0) for h in evicted)
            else:
                self.events.append(BlockRemoved(block_hashes=evicted, medium=GPU, group_idx=0))
        return out

    def _evict(self, block: KvBlock) -> None:
        digest = block.block_hash
        assert digest is not None
        holders = self.cached.get(digest)
        if holders is block:
            del self.cached[digest]
        elif isinstance(holders, dict):
            holders.pop(block.block_id, None)
            if len(holders) == 1:  # one holder left: the block itself again
                self.cached[digest] = next(iter(holders.values()))
            elif not holders:
                del self.cached[digest]
        block.block_hash = None

    def touch(self, blocks: Iterable[KvBlock]) -> None:
        """Take prefix-hit blocks into use; a free one leaves the free queue (so it cannot be evicted)."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KvBlock]) -> None:
        """Release blocks in eviction order: the first one freed is the first one evicted."""
        queue = self.free_queue
        tail = queue._tail
        null = self.null_block
        freed = 0
        for block in ordered:  # the queue's append, inline: this runs for every block of every request
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block is not null:
                last = tail.prev_free
                assert last is not None
                last.next_free = block
                block.prev_free = last
                block.next_free = tail
                tail.prev_free = block
                freed += 1
        queue.num_free_blocks += freed

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, as vLLM does."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    def cached_hashes(self) -> dict[EventHash, int]:
        """Every cached block hash (as events carry it) → how many blocks hold it."""
        return {self._event_hash(d): 1 if type(holders) is KvBlock else len(holders)  # type: ignore[arg-type]
                for d, holders in self.cached.items()}

    def free_order(self) -> list[int]:
        """Block ids in the order they would be reused (the head is evicted first)."""
        return [b.block_id for b in self.free_queue]


def _as_event_hash(digest: Digest) -> EventHash:
    """A digest that is its own event hash already (an int, see `BlockPool`)."""
    return cast(EventHash, digest)


@dataclass
class RequestBlocks:
    blocks: list[KvBlock] = field(default_factory=list)
    num_cached: int = 0  # leading blocks that already carry their hash


class KvCacheManager:
    """Per-request block tables over a `BlockPool`: prefix lookup, slot allocation, caching, freeing."""

    def __init__(self, pool: BlockPool, max_model_len: int, enable_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.tables: dict[str, RequestBlocks] = {}
        self.stats = PrefixCacheStats()

    def get_computed_blocks(self, request_id: str, block_hashes: Sequence[Digest], num_tokens: int,
                            record: bool = True) -> tuple[list[KvBlock], int]:
        """The longest run of leading full blocks already cached; the last token is always recomputed."""
        hits: list[KvBlock] = []
        if self.enable_caching:
            max_blocks = (num_tokens - 1) // self.block_size
            get = self.pool.get_cached_block
            for digest in block_hashes[:max_blocks]:
                block = get(digest)
                if block is None:
                    break
                hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if record:
            self.stats.record(num_tokens, num_hit_tokens)
        return hits, num_hit_tokens

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       new_computed_blocks: Sequence[KvBlock], block_hashes: Sequence[Digest],
                       all_token_ids: Sequence[int], first_block_extra: tuple[Any, ...] | None = None,
                       full_sequence_must_fit: bool = False) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens; False (and nothing changed) if the pool is short.

        `num_computed_tokens` counts the tokens already computed including `new_computed_blocks` (prefix hits).
        `full_sequence_must_fit` is vLLM 0.32's admission gate (`scheduler_reserve_full_isl`, on by default): a
        new request is admitted only if its whole sequence, not just its first chunk, fits in the free blocks.
        """
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = RequestBlocks()
        bs = self.block_size
        needed_tokens = min(num_computed_tokens + num_new_tokens, self.max_model_len)
        required = -(-needed_tokens // bs)
        if not new_computed_blocks and not full_sequence_must_fit and required <= len(table.blocks):
            # a decode step inside the last block (most steps): nothing to reserve, at most a block to cache
            if self.enable_caching:
                num_full = min(needed_tokens, len(all_token_ids), len(block_hashes) * bs) // bs
                if num_full > table.num_cached:
                    self.pool.cache_full_blocks(table.blocks, block_hashes, table.num_cached, num_full,
                                                all_token_ids, first_block_extra)
                    table.num_cached = num_full
            return True
        num_new = required - len(table.blocks) - len(new_computed_blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if full_sequence_must_fit:
            full = -(-min(len(all_token_ids), self.max_model_len) // bs)
            if full - len(table.blocks) - len(new_computed_blocks) + evictable_hits > self.pool.num_free_blocks:
                if not table.blocks:
                    del self.tables[request_id]
                return False
        if num_new + evictable_hits > self.pool.num_free_blocks:
            if not table.blocks:
                del self.tables[request_id]
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            table.blocks.extend(new_computed_blocks)
            table.num_cached = len(table.blocks)
        if num_new > 0:
            table.blocks.extend(self.pool.get_new_blocks(num_new))
        if self.enable_caching:
            num_full = min(needed_tokens, len(all_token_ids)) // bs
            num_full = min(num_full, len(block_hashes))
            if num_full > table.num_cached:
                self.pool.cache_full_blocks(table.blocks, block_hashes, table.num_cached, num_full, all_token_ids,
                                            first_block_extra)
                table.num_cached = num_full
        return True

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pool.free_blocks(reversed(table.blocks))

    def num_blocks_of(self, request_id: str) -> int:
        table = self.tables.get(request_id)
        return len(table.blocks) if table else 0
