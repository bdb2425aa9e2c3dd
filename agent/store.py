"""The agent's tier stack: DRAM over NVMe over the shared tier, with the policies that move blocks between them.

`TierStore` answers the three questions the agent's API asks: how many leading blocks of a hash chain are held
and where (`lookup`, local state only), store a chain (`store_chain`), load a chain (`load_chain`). Policies:
- write policy `eager`: every stored block is written through to NVMe and the shared tier in the background;
  `lazy`: a block moves down only when pressure evicts it (DRAM -> NVMe -> shared).
- promotion: a block read from NVMe or the shared tier is copied into DRAM.
- admission: a block enters NVMe / the shared tier only once it has been used (stored or hit) N times.
- watermarks: `maintain()` demotes DRAM and NVMe down to their low watermark once above the high one.
Tier changes become vLLM KV events (`medium` = CPU / DISK / SHARED) queued for the publisher.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from agent.block import BlockHash, BlockKey
from agent.config import AgentConfig
from agent.tiers.base import Buffer
from agent.tiers.dram import DramBlock, DramTier
from agent.tiers.nvme import NvmeTier
from agent.tiers.shared import FsSharedTier, RedisSharedTier, SharedTier
from router.kv_events import BlockRemoved, BlockStored, KvEvent

log = logging.getLogger(__name__)

# one character per block in a lookup answer: where the block would be loaded from
WHERE_DRAM, WHERE_NVME, WHERE_SHARED = "C", "D", "S"

# (operation "load" | "store", tier name, seconds)
LatencyObserver = Callable[[str, str, float], None]


@dataclass
class FlowStats:
    """Movements between tiers, for metrics."""

    promotions: dict[str, int] = field(default_factory=lambda: {"nvme": 0, "shared": 0})
    demotions: dict[str, int] = field(default_factory=lambda: {"nvme": 0, "shared": 0})
    write_through: dict[str, int] = field(default_factory=lambda: {"nvme": 0, "shared": 0})
    dropped_background_writes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, tier: str, n: int = 1) -> None:
        with self.lock:
            getattr(self, kind)[tier] += n


class UseCounter:
    """How often each block was stored or hit, bounded: the oldest half is forgotten when full."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self.limit = limit
        self._counts: dict[BlockKey, int] = {}

    def bump(self, key: BlockKey) -> int:
        n = self._counts.get(key, 0) + 1
        self._counts[key] = n
        if len(self._counts) > self.limit:
            for old in list(self._counts)[: self.limit // 2]:
                self._counts.pop(old, None)
        return n

    def get(self, key: BlockKey) -> int:
        return self._counts.get(key, 0)


def build_shared_tier(config: AgentConfig) -> SharedTier | None:
    if config.shared_backend == "redis":
        return RedisSharedTier(config.shared_url, prefix=config.shared_prefix, ttl_s=config.shared_ttl_s,
                               cluster=config.shared_cluster, timeout_s=config.shared_timeout_s,
                               retry_s=config.shared_retry_s)
    if config.shared_backend == "fs":
        return FsSharedTier(config.shared_dir, prefix=config.shared_prefix, ttl_s=config.shared_ttl_s,
                            retry_s=config.shared_retry_s)
    return None


class TierStore:
    def __init__(self, config: AgentConfig, *, dram: DramTier | None = None, nvme: NvmeTier | None = None,
                 shared: SharedTier | None = None, background_bytes: int = 256 * 2**20) -> None:
        self.config = config
        self.dram = dram
        self.nvme = nvme
        self.shared = shared
        self.eager = config.write_policy == "eager"
        self.flow = FlowStats()
        self.uses = UseCounter()
        self.events: deque[KvEvent] = deque()
        self.observe: LatencyObserver | None = None
        self._io = ThreadPoolExecutor(max(1, config.io_threads), thread_name_prefix="kvgate-agent-io")
        self._background_limit = background_bytes
        self._background_bytes = 0
        self._background_lock = threading.Lock()
        self._probing: set[BlockKey] = set()
        if nvme is not None:
            nvme.on_removed = lambda key: self._event_removed(key, "DISK")

    @classmethod
    def from_config(cls, config: AgentConfig) -> TierStore:
        dram = (DramTier(config.dram_capacity, config.dram_high_watermark, config.dram_low_watermark)
                if config.dram_capacity > 0 else None)
        nvme = (NvmeTier(config.nvme_dir, config.nvme_capacity, config.nvme_high_watermark,
                         config.nvme_low_watermark, fsync=config.nvme_fsync, min_free=config.nvme_min_free)
                if config.nvme_dir else None)
        return cls(config, dram=dram, nvme=nvme, shared=build_shared_tier(config))

    @property
    def tiers(self) -> list[DramTier | NvmeTier | SharedTier]:
        return [t for t in (self.dram, self.nvme, self.shared) if t is not None]

    def close(self, wait: bool = True) -> None:
        self._io.shutdown(wait=wait, cancel_futures=not wait)
        if self.shared is not None:
            self.shared.close()

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until background writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._background_bytes > 0 and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- lookup ----------------------------------------------------------------------------------------------

    def lookup(self, layout: int, hashes: Sequence[BlockHash]) -> tuple[int, str]:
        """How many leading blocks are held, and where each would come from; local state only, no I/O."""
        in_dram = self.dram.contains if self.dram is not None else None
        in_nvme = self.nvme.contains if self.nvme is not None else None
        in_shared = self.shared.contains if self.shared is not None else None
        where: list[str] = []
        for block_hash in hashes:
            key = (layout, block_hash)
            if in_dram is not None and in_dram(key):
                where.append(WHERE_DRAM)
            elif in_nvme is not None and in_nvme(key):
                where.append(WHERE_NVME)
            elif in_shared is not None and in_shared(key):
                where.append(WHERE_SHARED)
            else:
                break
        return len(where), "".join(where)

    def probe_shared(self, layout: int, hashes: Sequence[BlockHash]) -> int:
        """Ask the shared backend about blocks this node does not know yet (one round trip); new blocks found."""
        if self.shared is None or not self.shared.available:
            return 0
        keys = [(layout, h) for h in hashes]
        unknown = [k for k in keys if not self.shared.contains(k) and k not in self._probing]
        if not unknown:
            return 0
        self._probing.update(unknown)
        try:
            found = self.shared.probe(unknown)
        finally:
            self._probing.difference_update(unknown)
        return sum(found)

    def probe_shared_in_background(self, layout: int, hashes: Sequence[BlockHash]) -> None:
        if self.shared is not None and self.shared.available:
            self._io.submit(self._quiet, self.probe_shared, layout, list(hashes))

    # -- store -----------------------------------------------------------------------------------------------

    def store_chain(self, layout: int, hashes: Sequence[BlockHash], payloads: Sequence[Buffer],
                    parent: BlockHash | None = None) -> int:
        """Store consecutive blocks of one prefix (block i's parent is block i-1); returns how many are held."""
        stored = 0
        new_hashes: list[BlockHash] = []
        prev: BlockKey | None = (layout, parent) if parent is not None else None
        first_parent = parent
        keys: list[BlockKey] = []
        for block_hash, payload in zip(hashes, payloads, strict=True):
            key = (layout, block_hash)
            keys.append(key)
            uses = self.uses.bump(key)
            ok, fresh = self._store_one(key, payload, prev, uses)
            if ok:
                stored += 1
                if fresh:
                    new_hashes.append(block_hash)
            prev = key
        if self.dram is not None:
            self.dram.touch_chain(keys)
        if new_hashes:
            medium = "CPU" if self.dram is not None else "DISK"
            self.events.append(BlockStored(block_hashes=new_hashes, parent_block_hash=first_parent,
                                           block_size=self.config.block_size, medium=medium))
        return stored

    def _store_one(self, key: BlockKey, payload: Buffer, parent: BlockKey | None, uses: int) -> tuple[bool, bool]:
        """(held, newly stored)"""
        if self.dram is not None:
            fresh = not self.dram.contains(key)
            started = time.perf_counter()
            evicted = self.dram.store_evicting(key, payload, parent=parent)
            self._observe("store", "dram", started)
            if evicted is None:
                return self._store_below(key, payload, uses, parent), False
            self._handle_dram_evictions(evicted)
            if fresh and self.eager:
                block = self.dram.get(key)
                if block is not None:
                    self._write_through(key, block, parent, uses)
            return True, fresh
        return self._store_below(key, payload, uses, parent), True

    def _store_below(self, key: BlockKey, payload: Buffer, uses: int, parent: BlockKey | None) -> bool:
        """No DRAM tier (or the block is bigger than it): write to NVMe / shared synchronously."""
        held = False
        if self.nvme is not None and uses >= self.config.nvme_admit_reuse:
            held = self._nvme_store(key, payload, None, parent)
        if self.shared is not None and (self.eager or not held) and uses >= self.config.shared_admit_reuse:
            held = self._shared_store([(key, payload, None)], parent) > 0 or held
        return held

    def _write_through(self, key: BlockKey, block: DramBlock, parent: BlockKey | None, uses: int) -> None:
        to_nvme = self.nvme is not None and uses >= self.config.nvme_admit_reuse
        to_shared = self.shared is not None and uses >= self.config.shared_admit_reuse
        if to_nvme or to_shared:
            self._background(len(block.data), self._write_down, key, block, parent, to_nvme, to_shared,
                             "write_through")

    def _handle_dram_evictions(self, evicted: list[tuple[BlockKey, DramBlock]]) -> None:
        for key, block in evicted:
            self._event_removed(key, "CPU")
            if self.eager:
                continue  # already written through
            uses = self.uses.get(key)
            if self.nvme is not None and uses >= self.config.nvme_admit_reuse:
                self._background(len(block.data), self._write_down, key, block, block.parent, True, False,
                                 "demotions")
            elif self.shared is not None and uses >= self.config.shared_admit_reuse:
                self._background(len(block.data), self._write_down, key, block, block.parent, False, True,
                                 "demotions")

    def _write_down(self, key: BlockKey, block: DramBlock, parent: BlockKey | None, to_nvme: bool,
                    to_shared: bool, kind: str) -> None:
        digest = block.checksum()
        if (to_nvme and self.nvme is not None and not self.nvme.contains(key)
                and self._nvme_store(key, block.data, digest, parent)):
            self.flow.add(kind, "nvme")
        if (to_shared and self.shared is not None and not self.shared.contains(key)
                and self._shared_store([(key, block.data, digest)], parent)):
            self.flow.add(kind, "shared")

    def _nvme_store(self, key: BlockKey, payload: Buffer, digest: int | None, parent: BlockKey | None) -> bool:
        assert self.nvme is not None
        fresh = not self.nvme.contains(key)
        started = time.perf_counter()
        ok = self.nvme.store(key, payload, digest)
        self._observe("store", "nvme", started)
        if ok and fresh:
            self.events.append(BlockStored(block_hashes=[key[1]], parent_block_hash=parent[1] if parent else None,
                                           block_size=self.config.block_size, medium="DISK"))
        return ok

    def _shared_store(self, items: list[tuple[BlockKey, Buffer, int | None]], parent: BlockKey | None) -> int:
        assert self.shared is not None
        fresh = [key[1] for key, _p, _d in items if not self.shared.contains(key)]
        started = time.perf_counter()
        n = self.shared.store_many(items)
        self._observe("store", "shared", started)
        if n and fresh:
            self.events.append(BlockStored(block_hashes=fresh, parent_block_hash=parent[1] if parent else None,
                                           block_size=self.config.block_size, medium="SHARED"))
        return n

    # -- load ------------------------------------------------------------------------------------------------

    def load_chain(self, layout: int, hashes: Sequence[BlockHash], outs: Sequence[memoryview]) -> list[int]:
        """Load the leading run of blocks into `outs`; the payload length of each block loaded, in order."""
        keys = [(layout, h) for h in hashes]
        lengths: list[int] = []
        i = 0
        while i < len(keys):
            n = self._load_local(keys[i], outs[i], keys[i - 1] if i else None)
            if n is not None:
                lengths.append(n)
                i += 1
                continue
            if self.shared is None:
                break
            run = i
            while run < len(keys) and self.shared.contains(keys[run]) and not self._local_has(keys[run]):
                run += 1
            if run == i:
                break
            started = time.perf_counter()
            got = self.shared.read_many(keys[i:run], list(outs[i:run]))
            self._observe("load", "shared", started)
            for j, n_shared in enumerate(got, start=i):
                if n_shared is None:
                    break
                lengths.append(n_shared)
                self._hit(keys[j], outs[j][:n_shared], "shared", keys[j - 1] if j else None)
            if len(lengths) < run:
                break
            i = run
        if self.dram is not None and lengths:
            self.dram.touch_chain(keys[: len(lengths)])
        return lengths

    def _local_has(self, key: BlockKey) -> bool:
        return (self.dram is not None and self.dram.contains(key)) or (
            self.nvme is not None and self.nvme.contains(key))

    def _load_local(self, key: BlockKey, out: memoryview, parent: BlockKey | None) -> int | None:
        if self.dram is not None:
            started = time.perf_counter()
            n = self.dram.read_into(key, out)
            if n is not None:
                self._observe("load", "dram", started)
                self.uses.bump(key)
                return n
        if self.nvme is not None and self.nvme.contains(key):
            started = time.perf_counter()
            n = self.nvme.read_into(key, out)
            self._observe("load", "nvme", started)
            if n is not None:
                self._hit(key, out[:n], "nvme", parent)
                return n
        return None

    def _hit(self, key: BlockKey, payload: memoryview, tier: str, parent: BlockKey | None) -> None:
        self.uses.bump(key)
        if self.config.promote_on_hit and self.dram is not None and not self.dram.contains(key):
            evicted = self.dram.store_evicting(key, payload, parent=parent)
            if evicted is not None:
                self.flow.add("promotions", tier)
                self.events.append(BlockStored(block_hashes=[key[1]],
                                               parent_block_hash=parent[1] if parent else None,
                                               block_size=self.config.block_size, medium="CPU"))
                self._handle_dram_evictions(evicted)

    # -- pressure, TTL, index refresh ------------------------------------------------------------------------

    def maintain(self) -> None:
        """Watermark-driven demotion and eviction; run periodically off the event loop."""
        if self.dram is not None and self.dram.above_high_watermark():
            self._handle_dram_evictions(self.dram.evict_to_low_watermark())
        if self.nvme is not None and self.nvme.above_high_watermark():
            if self.shared is not None and not self.eager:
                self._demote_nvme_to_shared()
            self.nvme.evict_to_low_watermark()

    def _demote_nvme_to_shared(self) -> None:
        assert self.nvme is not None and self.shared is not None
        excess = self.nvme.usage().used_bytes - self.nvme.low_bytes
        if excess <= 0:
            return
        victims = self.nvme.eviction_candidates(excess)
        for key in victims:
            size = self.nvme.payload_size(key)
            if size is None or self.shared.contains(key) or self.uses.get(key) < self.config.shared_admit_reuse:
                continue
            buf = memoryview(bytearray(size))
            n = self.nvme.read_into(key, buf, touch=False)
            if n is not None and self._shared_store([(key, buf[:n], None)], None):
                self.flow.add("demotions", "shared")

    def sweep_shared(self) -> None:
        if isinstance(self.shared, FsSharedTier):
            self.shared.sweep()

    def refresh_shared_index(self) -> int:
        return self.shared.refresh_index() if self.shared is not None else 0

    # -- helpers ---------------------------------------------------------------------------------------------

    def _event_removed(self, key: BlockKey, medium: str) -> None:
        self.events.append(BlockRemoved(block_hashes=[key[1]], medium=medium))

    def drain_events(self) -> list[KvEvent]:
        out: list[KvEvent] = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def _observe(self, op: str, tier: str, started: float) -> None:
        if self.observe is not None:
            self.observe(op, tier, time.perf_counter() - started)

    def _background(self, size: int, fn: Callable[..., None], *args: object) -> None:
        with self._background_lock:
            if self._background_bytes + size > self._background_limit:
                self.flow.dropped_background_writes += 1
                return
            self._background_bytes += size

        def run() -> None:
            try:
                fn(*args)
            finally:
                with self._background_lock:
                    self._background_bytes -= size

        self._io.submit(self._quiet, run)

    @staticmethod
    def _quiet(fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("background tier operation failed")
