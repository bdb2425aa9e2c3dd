"""The tier agent in virtual time (`kvgate bench vsim --tiers`): the agent's own `TierStore` -- its write policy,
admission by reuse, promotion, demotion and watermarks (agent/store.py, agent/policy.py), its shared tier's index
and TTL -- over tiers that keep one stand-in byte per block, so capacities count blocks.

Modelled rather than run: DRAM, as the agent's DRAM tier's eviction in prefix order over block hashes without
bytes (tested against the agent's tier); NVMe, as exact LRU, the DRAM tier's bookkeeping without prefix order (the
order of the agent's `files` layout; the default segment log drops the oldest eighth at a time), and like DRAM it
hands a block it pushes out to the tier below (the agent copies NVMe's eviction candidates down before its upkeep
evicts them). The fleet's Redis is a dict on the virtual clock: TTL from the last write, a bound in blocks with
least-recently-used eviction nobody is told of, as Redis's allkeys-lru. Each replica's agent has its own
shared-tier index and asks the backend about the blocks it does not know before a lookup (the connector with
`probe_ms`). Background writes happen at once; `maintain()` runs every `UPKEEP_S` virtual seconds, as in the agent.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, KeysView, Sequence
from concurrent.futures import Executor, Future
from functools import partial
from typing import Any, ParamSpec, TypeVar, cast

from agent.block import BlockHash, BlockKey, checksum
from agent.config import AgentConfig
from agent.policy import UseCounter
from agent.store import TierStore
from agent.tiers.base import Buffer, HeldBlock, RemovalListener, Removed, StoreItem, TierName, TierStats, TierUsage
from agent.tiers.shared import SharedTier
from bench.sim.hash_lru import Hash, HashLru
from kvcore.kv_events import BlockRemoved, BlockStored, KvEvent

LAYOUT = 0
UPKEEP_S = 0.2  # the agent's maintain() interval (agent/server.py)
_STAND_IN = b"\x00"  # one byte per block: tier capacities in bytes are capacities in blocks
_HELD = HeldBlock(bytearray(_STAND_IN), None, checksum(_STAND_IN))  # any block NVMe hands down

P = ParamSpec("P")
T = TypeVar("T")


class InlineExecutor(Executor):
    """Runs what is submitted at once: the agent's background writes take no virtual time."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


# one block of `DramModel`: [last use, resident children, parent hash, the parent's entry that counts it]
_USED, _CHILDREN, _PARENT, _COUNTED_BY = range(4)


class _ModelTier:
    """What the DRAM and NVMe models share: a capacity in blocks with the agent's watermarks, stats, the removal
    listener, and no bytes to copy down or keep up."""

    def __init__(self, capacity: int, high_watermark: float, low_watermark: float) -> None:
        self.capacity = capacity
        self.high_bytes = int(capacity * high_watermark)
        self.low_bytes = int(capacity * low_watermark)
        self.stats = TierStats()
        self.on_removed: RemovalListener | None = None
        # told instead of `on_removed` of the blocks pushed out (each with its stand-in bytes in hand), as their
        # hashes: set by the model's own store (`ModelTierStore`)
        self.on_pushed_out: Callable[[list[Hash]], None] | None = None

    def demotion_candidates(self) -> list[tuple[BlockKey, int]]:
        return []  # an eviction hands over the (stand-in) bytes itself

    def upkeep(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _report(self, removed: list[Removed]) -> None:
        if removed and self.on_removed is not None:
            self.on_removed(removed)

    def _push_out(self, hashes: list[Hash]) -> None:
        """Report blocks this tier pushed out (to `on_pushed_out`, else as the agent's tiers do)."""
        if not hashes:
            return
        if self.on_pushed_out is not None:
            self.on_pushed_out(hashes)
        else:
            self._report([Removed((LAYOUT, h), _HELD) for h in hashes])


class DramModel(_ModelTier):
    """The DRAM tier of the model: the agent's DRAM tier (agent/tiers/dram.py) in prefix order -- the least
    recently used leaf goes first, a block whose child is resident waits for it, a chain longer than the tier
    keeps its head -- over block hashes, without bytes: per block a small list (last use, resident children,
    parent, the parent's entry that counts it), no buffer, no `DramBlock`, no lock. Every block is the same
    one-byte stand-in, so capacities count blocks and one held block (`_HELD`) stands for each one that moves down
    (the tiers below take a block's key alone, not its parent). Tested against the agent's tier
    (tests/test_sim_tiers.py)."""

    name = TierName.DRAM

    def __init__(self, capacity: int, high_watermark: float, low_watermark: float) -> None:
        super().__init__(capacity, high_watermark, low_watermark)
        self._blocks: dict[Hash, list[Any]] = {}
        # (last use, hash) of leaves; an entry is stale once the block is gone, used again or a parent again
        self._leaves: list[tuple[int, Hash]] = []
        self._ticks = itertools.count()
        self._unentered: list[Any] | None = None  # see store_many

    def store(self, key: BlockKey, payload: Buffer, digest: int | None = None) -> bool:
        return self.store_many([StoreItem(key, payload, digest)]) == 1

    @property
    def hashes(self) -> KeysView[Hash]:
        """The blocks held, by hash (a live view: `h in dram.hashes` asks without a call)."""
        return self._blocks.keys()

    def store_many(self, items: Sequence[StoreItem]) -> int:
        return self.store_hashes([item.key[1] for item in items],
                                 [None if item.parent is None else item.parent[1] for item in items])

    def store_hashes(self, hashes: Sequence[Hash], parents: Sequence[Hash | None]) -> int:
        """`store_many` of blocks by hash, each with its parent's. As the agent's tier: a new block whose child is
        the next one is entered as a leaf only if it still is one once that child is stored."""
        evicted: list[Hash] = []
        held = 0
        refused: Hash | None = None
        last = len(hashes) - 1
        blocks = self._blocks
        deferred: tuple[list[Any], Hash] | None = None  # the block stored just before, without its leaf entry
        for i, (key, parent) in enumerate(zip(hashes, parents, strict=True)):
            if parent is not None and parent == refused:  # the rest of a chain the tier cannot hold whole
                self.stats.refused += 1
                refused = key
            elif self._store(key, parent, evicted, i == last or parents[i + 1] != key):
                held += 1
            else:
                refused = key
            if deferred is not None:
                block, h = deferred
                if block[_CHILDREN] == 0 and blocks.get(h) is block:
                    heapq.heappush(self._leaves, (block[_USED], h))
                deferred = None
            if self._unentered is not None:
                deferred, self._unentered = (self._unentered, key), None
        self._push_out(evicted)
        return held

    def _store(self, h: Hash, parent: Hash | None, evicted: list[Hash], leaf: bool) -> bool:
        if self.capacity < 1:
            self.stats.refused += 1
            return False
        blocks = self._blocks
        existing = blocks.get(h)
        if existing is not None:
            self._use(h, existing)
            return True
        if len(blocks) >= self.capacity:
            evicted += self._evict(self.capacity - 1, protect=parent)
            if len(blocks) >= self.capacity:  # what is left is this block's own ancestors
                self.stats.refused += 1
                return False
        block: list[Any] = [0, 0, None, None]
        if parent is not None:
            parent_block = blocks.get(parent)
            if parent_block is not None:
                parent_block[_CHILDREN] += 1
                block[_PARENT] = parent
                block[_COUNTED_BY] = parent_block
        blocks[h] = block
        if leaf:
            self._use(h, block)
        else:
            block[_USED] = next(self._ticks)
            self._unentered = block
        self.stats.stores += 1
        return True

    def read_into(self, key: BlockKey, out: memoryview, touch: bool = True) -> int | None:
        h = key[1]
        block = self._blocks.get(h)
        if block is None:
            self.stats.misses += 1
            return None
        out[:1] = _STAND_IN
        if touch:
            self._use(h, block)
        self.stats.hits += 1
        return 1

    def read_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview], touch: bool = True) -> list[int | None]:
        return [self.read_into(key, out, touch) for key, out in zip(keys, outs, strict=True)]

    def held(self, key: BlockKey) -> HeldBlock | None:
        return _HELD if key[1] in self._blocks else None

    def contains(self, key: BlockKey) -> bool:
        return key[1] in self._blocks

    def delete(self, key: BlockKey) -> bool:
        block = self._blocks.get(key[1])
        if block is None:
            return False
        self._remove(key[1], block)
        self._report([Removed(key)])
        return True

    def usage(self) -> TierUsage:
        return TierUsage(len(self._blocks), len(self._blocks), self.capacity)

    def block_keys(self) -> Iterable[BlockKey]:
        return [(LAYOUT, h) for h in self._blocks]

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.touch_hashes([h for _layout, h in keys])

    def touch_hashes(self, hashes: Sequence[Hash]) -> None:
        """A prefix chain used: children first, so each parent ends up more recent than its child."""
        blocks = self._blocks
        for h in reversed(hashes):
            block = blocks.get(h)
            if block is not None:
                self._use(h, block)

    def above_high_watermark(self) -> bool:
        return len(self._blocks) > self.high_bytes

    def evict_to_low_watermark(self, offered: Collection[BlockKey] | None = None) -> None:
        self._push_out(self._evict(self.low_bytes))  # (with the stand-in bytes in hand: `offered` is no matter)

    def _use(self, h: Hash, block: list[Any]) -> None:
        block[_USED] = used = next(self._ticks)
        if block[_CHILDREN] == 0:
            heapq.heappush(self._leaves, (used, h))
            if len(self._leaves) > 2 * len(self._blocks) + 1024:  # mostly stale entries: rebuild
                self._leaves = [(b[_USED], k) for k, b in self._blocks.items() if b[_CHILDREN] == 0]
                heapq.heapify(self._leaves)

    def _evict(self, target: int, protect: Hash | None = None) -> list[Hash]:
        """Evict least recently used leaves until at most `target` blocks are left; their hashes."""
        evicted: list[Hash] = []
        spared: list[tuple[int, Hash]] = []
        blocks = self._blocks
        leaves = self._leaves
        while len(blocks) > target and leaves:
            used, h = heapq.heappop(leaves)
            block = blocks.get(h)
            if block is None or block[_USED] != used or block[_CHILDREN]:
                continue  # stale
            if h == protect:
                spared.append((used, h))
                continue
            self._remove(h, block)
            evicted.append(h)
        for entry in spared:  # the parent of the block being stored: still a leaf, still that old
            heapq.heappush(leaves, entry)
        self.stats.evictions += len(evicted)
        return evicted

    def _remove(self, h: Hash, block: list[Any]) -> None:
        blocks = self._blocks
        del blocks[h]
        parent_block: list[Any] | None = block[_COUNTED_BY]
        if parent_block is not None and parent_block is blocks.get(block[_PARENT]):
            parent_block[_CHILDREN] -= 1
            if parent_block[_CHILDREN] == 0:  # a leaf again, as old as its last use
                heapq.heappush(self._leaves, (parent_block[_USED], block[_PARENT]))


class NvmeModel(_ModelTier):
    """The NVMe tier of the model: exact LRU over block keys, which is what the agent's DRAM tier without prefix
    order does, kept as the block hashes in use order (`HashLru`: arrays, no object per block) instead of a block
    object, a byte buffer and heap entries per block (NVMe holds ten times DRAM's blocks; this is most of a tiered
    simulation's memory otherwise), keyed by the block's hash alone (the simulation has one layout, `LAYOUT`: no
    key tuple kept per block). Every block is the same one-byte stand-in, so one held block stands for each one
    that moves down."""

    name = TierName.NVME

    def __init__(self, capacity: int, high_watermark: float, low_watermark: float) -> None:
        super().__init__(capacity, high_watermark, low_watermark)
        self._lru = HashLru()  # block hashes, least recently used first

    def store(self, key: BlockKey, payload: Buffer, digest: int | None = None) -> bool:
        return self.store_many([StoreItem(key, payload, digest)]) == 1

    def store_many(self, items: Sequence[StoreItem]) -> int:
        return self._store([item.key[1] for item in items])

    def store_new(self, hashes: list[Hash]) -> list[Hash]:
        """The store's write of blocks moving down (`TierStore._write`), as hashes: store those of `hashes` the tier
        does not hold yet; those of them it holds afterwards."""
        lru = self._lru
        fresh = [h for h in hashes if h not in lru]
        if not fresh:
            return fresh
        evictions = self.stats.evictions
        self._store(fresh)
        if self.stats.evictions == evictions:  # (most writes) nothing pushed out: every one of them is held
            return fresh
        return [h for h in fresh if h in lru]

    def _store(self, hashes: list[Hash]) -> int:
        lru = self._lru
        capacity = self.capacity
        evicted: list[Hash] = []
        held = 0
        size = len(lru)
        for key in hashes:
            if size < capacity:  # (most writes: the tier is kept below its high watermark) one probe
                if not lru.use(key):
                    size += 1
                    self.stats.stores += 1
            elif lru.touch(key):
                pass
            elif capacity < 1:
                self.stats.refused += 1
                continue
            else:
                while size >= capacity:
                    evicted.append(lru.pop_oldest())
                    size -= 1
                lru.add(key)
                size += 1
                self.stats.stores += 1
            held += 1
        self.stats.evictions += len(evicted)
        self._push_out(evicted)
        return held

    def read_into(self, key: BlockKey, out: memoryview, touch: bool = True) -> int | None:
        lru = self._lru
        h = key[1]
        if not (lru.touch(h) if touch else h in lru):
            self.stats.misses += 1
            return None
        out[:1] = _STAND_IN
        self.stats.hits += 1
        return 1

    def read_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview], touch: bool = True) -> list[int | None]:
        return [self.read_into(key, out, touch) for key, out in zip(keys, outs, strict=True)]

    def contains(self, key: BlockKey) -> bool:
        return key[1] in self._lru

    def held(self, key: BlockKey) -> HeldBlock | None:
        return _HELD if key[1] in self._lru else None

    def touch(self, keys: Sequence[BlockKey]) -> None:
        touch = self._lru.touch
        for _layout, key in reversed(keys):
            touch(key)

    def delete(self, key: BlockKey) -> bool:
        if not self._lru.remove(key[1]):
            return False
        self._report([Removed(key)])
        return True

    def usage(self) -> TierUsage:
        return TierUsage(len(self._lru), len(self._lru), self.capacity)

    def block_keys(self) -> Iterable[BlockKey]:
        return [(LAYOUT, key) for key in self._lru]

    def above_high_watermark(self) -> bool:
        return len(self._lru) > self.high_bytes

    def evict_to_low_watermark(self, offered: Collection[BlockKey] | None = None) -> None:
        lru = self._lru  # (what goes is pushed out with its stand-in bytes in hand: `offered` is no matter)
        victims = [lru.pop_oldest() for _ in range(max(0, len(lru) - self.low_bytes))]
        self.stats.evictions += len(victims)
        self._push_out(victims)


class FleetBackend:
    """The fleet's shared store (Redis in a real fleet): which blocks it holds, until when, least recently used
    first (block hashes in use order with their expiry, `HashLru`); at most `capacity` blocks."""

    def __init__(self, capacity: int, clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.clock = clock
        self._expiry = HashLru(values=True)

    def put(self, keys: Iterable[BlockKey], ttl_s: float) -> None:
        """Write blocks, each with the TTL (one expiry for them all: the store holds millions)."""
        expiry = self.clock() + ttl_s if ttl_s > 0 else float("inf")
        entries = self._expiry
        capacity = self.capacity
        for _layout, key in keys:
            entries.put(key, expiry)
            if len(entries) > capacity:
                entries.pop_oldest()

    def get(self, key: BlockKey) -> bool:
        entries = self._expiry
        h = key[1]
        expiry = entries.get(h)
        if expiry is None or expiry <= self.clock():
            return False
        entries.touch(h)
        return True

    def has(self, key: BlockKey) -> bool:
        expiry = self._expiry.get(key[1])
        return expiry is not None and expiry > self.clock()

    def has_many(self, keys: Iterable[BlockKey]) -> list[bool]:
        """`has` of each key, at one moment (a probe asks about every block of a prompt it does not know)."""
        get, now = self._expiry.get, self.clock()
        return [(expiry := get(h)) is not None and expiry > now for _layout, h in keys]

    def delete(self, key: BlockKey) -> None:
        self._expiry.remove(key[1])

    def keys(self) -> Iterable[BlockKey]:
        now = self.clock()
        return [(LAYOUT, key) for key, expiry in self._expiry.items() if expiry > now]


_MISSING = object()


class HashKeyedIndex:
    """A shared tier's index (`SharedTier._index`: block key -> (expiry, size), in expiry order) keyed by the
    block's hash alone, in arrays in use order (`HashLru`): the simulation has one layout, `LAYOUT`, and without a
    (layout, hash) tuple and an ordered dict's node per entry the eight replicas' indexes of a long replay (2.7 M
    entries on the conversation trace) take about 250 MB less (and without a dict entry, 70 MB less again). The
    ordered dict's operations the shared tier uses, taking and giving block keys."""

    __slots__ = ("by_hash",)

    def __init__(self) -> None:
        # the entries by block hash: the model's shared tier reads and writes them so, a write at a time
        self.by_hash = HashLru(values=True)

    def __len__(self) -> int:
        return len(self.by_hash)

    def __contains__(self, key: BlockKey) -> bool:
        return key[1] in self.by_hash

    def __iter__(self) -> Iterator[BlockKey]:
        return ((LAYOUT, h) for h in self.by_hash)

    def __setitem__(self, key: BlockKey, value: tuple[float, int]) -> None:
        self.by_hash.set(key[1], value)  # (a new value for a key keeps its place, as in an ordered dict)

    def __delitem__(self, key: BlockKey) -> None:
        if not self.by_hash.remove(key[1]):
            raise KeyError(key)

    def get(self, key: BlockKey, default: tuple[float, int] | None = None) -> tuple[float, int] | None:
        return cast("tuple[float, int] | None", self.by_hash.get(key[1], default))

    def pop(self, key: BlockKey, default: tuple[float, int] | None = None) -> tuple[float, int] | None:
        entries = self.by_hash
        value = entries.get(key[1], _MISSING)
        if value is _MISSING:
            return default
        entries.remove(key[1])
        return cast("tuple[float, int]", value)

    def move_to_end(self, key: BlockKey) -> None:
        if not self.by_hash.touch(key[1]):
            raise KeyError(key)

    def first(self) -> tuple[BlockKey, tuple[float, int]] | None:
        """The oldest entry, None when there is none."""
        h = self.by_hash.oldest()
        return None if h is None else ((LAYOUT, h), self.by_hash.get(h))

    def popitem(self, last: bool = True) -> tuple[BlockKey, tuple[float, int]]:
        entries = self.by_hash
        h = entries.newest() if last else entries.oldest()
        if h is None:
            raise KeyError("popitem(): the index is empty")
        value = entries.get(h)
        if last:
            entries.remove(h)
        else:
            entries.pop_oldest()
        return (LAYOUT, h), value

    def values(self) -> Iterable[tuple[float, int]]:
        return [value for _h, value in self.by_hash.items()]

    def items(self) -> Iterator[tuple[BlockKey, tuple[float, int]]]:
        return (((LAYOUT, h), value) for h, value in self.by_hash.items())


class FleetSharedTier(SharedTier):
    """One replica's view of the fleet's shared store: the agent's shared tier (index, TTL) over `FleetBackend`,
    its index keyed by block hash (`HashKeyedIndex`)."""

    def __init__(self, backend: FleetBackend, ttl_s: float) -> None:
        super().__init__(ttl_s, clock=backend.clock)
        self.backend = backend
        self._hashes = HashKeyedIndex()
        self._index = cast("OrderedDict[BlockKey, tuple[float, int]]", self._hashes)

    def upkeep(self) -> None:
        """The shared tier's upkeep, finding the oldest entry without walking the index from its start each time."""
        now = self.clock()
        gone: list[Removed] = []
        with self._lock:
            index = self._hashes
            while (oldest := index.first()) is not None and oldest[1][0] <= now:
                index.popitem(last=False)
                gone.append(Removed(oldest[0]))
        self._report(gone)

    def store_new(self, hashes: list[Hash]) -> list[Hash]:
        """`NvmeModel.store_new` for the shared tier: `SharedTier.store_many` of the blocks it does not hold yet
        (one write to the backend, their index entries the newest), as hashes; those it holds afterwards."""
        now = self.clock()
        get = self._hashes.by_hash.get
        fresh = [h for h in hashes if (entry := get(h)) is None or entry[0] <= now]
        if not fresh:
            return fresh
        if not self.available or now < self._writes_down_until:
            self.stats.add("refused", len(fresh))
            return []
        self.backend.put([(LAYOUT, h) for h in fresh], self.ttl_s)  # (the backend keeps no bytes: no seal)
        entry = (self._expiry(), self.seal.prefix_size + len(_STAND_IN))
        with self._lock:
            put = self._hashes.by_hash.put
            for h in fresh:
                put(h, entry)
        self.stats.add("stores", len(fresh))
        return fresh if entry[0] > now else []

    def _put_many(self, items: list[tuple[BlockKey, bytes, Buffer]]) -> set[int]:
        self.backend.put([key for key, _prefix, _payload in items], self.ttl_s)
        return set()

    def _fetch_many(self, keys: list[BlockKey], outs: list[memoryview]) -> list[int | Exception | None]:
        results: list[int | Exception | None] = []
        for key, out in zip(keys, outs, strict=True):
            if self.backend.get(key):
                out[:1] = _STAND_IN
                results.append(1)
            else:
                results.append(None)
        return results

    def contains(self, key: BlockKey) -> bool:
        """`SharedTier.contains` on the hash-keyed index, without a call per layer: every lookup and probe asks
        it for each block after the GPU prefix hit."""
        entry = self._hashes.by_hash.get(key[1])
        return entry is not None and entry[0] > self.clock()

    def _exists_many(self, keys: list[BlockKey]) -> list[bool]:
        return self.backend.has_many(keys)

    def _delete(self, key: BlockKey) -> None:
        self.backend.delete(key)

    def _list_keys(self) -> Iterable[BlockKey]:
        return self.backend.keys()


class HashUseCounter(UseCounter):
    """The agent's use counter keyed by block hash alone (the simulation has one layout), held in arrays: the
    hashes in order of first count (`array('Q')`), their counts beside them, and an open-addressing table of
    their places. The same counts and the same forgetting as the agent's dict (the older half by first count,
    once past the limit), without a dict entry and an int object per counted block: up to 262,144 per replica,
    most of them in no tier any more, so that the counter alone kept their 48-byte ints alive."""

    def __init__(self, limit: int = 262_144) -> None:
        super().__init__(limit)
        self._size = 1 << max(3, (2 * limit - 1).bit_length())  # at most half full (limit + 1 for a moment)
        self._rebuild(array("Q"), array("I"))

    def _rebuild(self, hashes: array[int], uses: array[int]) -> None:
        self._hashes = hashes  # in order of first count
        self._uses = uses  # the count of each
        mask = self._size - 1
        places = array("i", [-1]) * self._size  # hash & mask, probed onwards: the hash's index in `_hashes`
        for place, h in enumerate(hashes):
            i = h & mask
            while places[i] >= 0:
                i = (i + 1) & mask
            places[i] = place
        self._places = places

    def _bump(self, h: Hash) -> int:
        places, hashes, mask = self._places, self._hashes, self._size - 1
        i: int = h & mask
        while (place := places[i]) >= 0:
            if hashes[place] == h:
                n = self._uses[place] + 1
                self._uses[place] = n
                return n
            i = (i + 1) & mask
        places[i] = len(hashes)
        hashes.append(h)
        self._uses.append(1)
        if len(hashes) > self.limit:
            self._forget()
        return 1

    def _forget(self) -> None:
        half = self.limit // 2
        self._rebuild(self._hashes[half:], self._uses[half:])

    def bump(self, key: BlockKey) -> int:
        return self._bump(key[1])

    def bump_all(self, keys: list[BlockKey]) -> list[int]:
        return self.bump_hashes([h for _layout, h in keys])

    def bump_hashes(self, chain: Sequence[Hash]) -> list[int]:
        """`bump_all` by hash."""
        out = []
        places, hashes, uses, mask = self._places, self._hashes, self._uses, self._size - 1
        for h in chain:  # `_bump` written out: a chain's every block is counted
            i: int = h & mask
            while (place := places[i]) >= 0:
                if hashes[place] == h:
                    n = uses[place] = uses[place] + 1
                    break
                i = (i + 1) & mask
            else:
                places[i] = len(hashes)
                hashes.append(h)
                uses.append(1)
                n = 1
                if len(hashes) > self.limit:
                    self._forget()
                    places, hashes, uses = self._places, self._hashes, self._uses
            out.append(n)
        return out

    def get(self, key: BlockKey) -> int:
        return self.count(key[1])

    def count(self, h: Hash) -> int:
        """The count of a block by its hash (0: never counted, or forgotten)."""
        places, hashes, mask = self._places, self._hashes, self._size - 1
        i: int = h & mask
        while (place := places[i]) >= 0:
            if hashes[place] == h:
                return self._uses[place]
            i = (i + 1) & mask
        return 0

    def __len__(self) -> int:
        return len(self._hashes)


class ModelTierStore(TierStore):
    """The agent's `TierStore` over the model's tiers, moving blocks as their hashes where the agent's store makes a
    `StoreItem`, a `Removed`, a seal and several calls per block: a chain saved into the DRAM model
    (`store_chain`), and the blocks a model tier pushes out (`TierStore._removed` and the lazy demotion it starts,
    `_write_down`, `_write`, `_announce`) into the NVMe model and the shared tier -- a DRAM tier past its high
    watermark moves thousands at a time, a fifth to a third of round_robin's CPU with tiers. Its use counter is
    keyed by hash (`HashUseCounter`); one `BlockStored` per tier and write, as vsim's gateway wants
    (`chain_events=False`). Tested against `TierStore` over the same tiers (tests/test_sim_tiers.py)."""

    def __init__(self, config: AgentConfig, *, dram: DramModel | None, nvme: NvmeModel | None,
                 shared: FleetSharedTier | None, uses_limit: int = 262_144) -> None:
        super().__init__(config, dram=dram, nvme=nvme, shared=shared, executor=InlineExecutor(), chain_events=False)
        self.uses: HashUseCounter = HashUseCounter(uses_limit)
        for tier in (dram, nvme):
            if tier is not None:
                tier.on_pushed_out = partial(self._pushed_out, tier)

    def store_chain(self, layout: int, hashes: Sequence[BlockHash], payloads: Sequence[Buffer],
                    parent: BlockHash | None = None, digests: Sequence[int | None] | None = None) -> int:
        """`TierStore.store_chain` into the DRAM model as hashes (lazy, without a presence map: the simulation's
        saves; the blocks DRAM refuses go below as the agent stores them)."""
        dram = self.dram
        if not isinstance(dram, DramModel) or self.policy.eager or self.presence is not None:
            return super().store_chain(layout, hashes, payloads, parent, digests)
        uses = self.uses.bump_hashes(hashes)
        held = dram.hashes
        parents = [parent, *hashes[:-1]]
        fresh = [i for i, h in enumerate(hashes) if h not in held]
        if fresh:  # `TierStore._write`
            dram.store_hashes([hashes[i] for i in fresh], [parents[i] for i in fresh])
            taken = [h for i in fresh if (h := hashes[i]) in held]
            if taken:
                self.events.append(BlockStored(block_hashes=taken, parent_block_hash=None,
                                               block_size=self.config.block_size, medium=dram.name.medium))
        dram.touch_hashes(hashes)
        refused = [i for i, h in enumerate(hashes) if h not in held]
        if not refused:
            return len(hashes)
        below = [(StoreItem((layout, hashes[i]), payloads[i], digests[i] if digests else None,
                            None if (p := parents[i]) is None else (layout, p)), uses[i]) for i in refused]
        return len(hashes) - len(refused) + self.store_refused(below)

    def _pushed_out(self, tier: DramModel | NvmeModel, hashes: list[Hash]) -> None:
        """`TierStore._removed` for blocks a model tier pushed out, each with its (stand-in) bytes in hand."""
        self.events.append(BlockRemoved(block_hashes=hashes, medium=tier.name.medium))
        below = [t.name for t in self._below(tier)]
        descent: dict[TierName, list[Hash]] = {}
        targets: dict[int, TierName | None] = {}  # by uses, as TierStore._removed
        count = self.uses.count
        for h in hashes:
            n = count(h)
            target = targets[n] if n in targets else targets.setdefault(n, self.policy.demote_to(below, n))
            if target is not None:
                descent.setdefault(target, []).append(h)
        if descent:  # one stand-in byte a block
            self._background(sum(map(len, descent.values())), self._move_down, descent)

    def _move_down(self, descent: dict[TierName, list[Hash]]) -> None:
        """`TierStore._write_down` of demoted blocks, as hashes."""
        for name, hashes in descent.items():
            tier = self._tier(name)
            assert isinstance(tier, NvmeModel | FleetSharedTier)
            taken = tier.store_new(hashes)
            if taken:
                self.events.append(BlockStored(block_hashes=taken, parent_block_hash=None,
                                               block_size=self.config.block_size, medium=tier.name.medium))
            self.flow.add("demotions", name, len(taken))


class ReplicaAgent:
    """One replica's tier agent: the agent's `TierStore` over the model's tiers (`ModelTierStore`)."""

    def __init__(self, config: AgentConfig, dram_blocks: int, nvme_blocks: int, fleet: FleetBackend) -> None:
        dram = (DramModel(dram_blocks, config.dram_high_watermark, config.dram_low_watermark)
                if dram_blocks > 0 else None)
        nvme = (NvmeModel(nvme_blocks, config.nvme_high_watermark, config.nvme_low_watermark)
                if nvme_blocks > 0 else None)
        shared = FleetSharedTier(fleet, config.shared_ttl_s) if fleet.capacity > 0 else None
        self.store = ModelTierStore(config, dram=dram, nvme=nvme, shared=shared)
        self._buffer = memoryview(bytearray(1))

    def save(self, hashes: Sequence[int], parent: int | None) -> None:
        """The connector hands the agent a chain of blocks the engine computed."""
        self.store.store_chain(LAYOUT, hashes, [_STAND_IN] * len(hashes), parent, [_HELD.digest] * len(hashes))

    def load(self, hashes: Sequence[int]) -> str:
        """Load the leading run of `hashes` the tiers hold; the `TierName.code` of the tier each came from."""
        self.store.probe_shared(LAYOUT, hashes)
        count, where = self.store.lookup(LAYOUT, hashes)
        loaded = self.store.load_chain(LAYOUT, hashes[:count], [self._buffer] * count)
        return where[: len(loaded)]

    def maintain(self) -> None:
        self.store.maintain()

    def has_events(self) -> bool:
        return bool(self.store.events)

    def events(self) -> list[KvEvent]:
        return self.store.drain_events()
