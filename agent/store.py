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
from agent.tiers.segments import SegmentNvmeTier
from agent.tiers.shared import FsSharedTier, RedisSharedTier, SharedTier
from kvcore.kv_events import BlockRemoved, BlockStored, KvEvent

log = logging.getLogger(__name__)

# one character per block in a lookup answer: where the block would be loaded from
WHERE_DRAM, WHERE_NVME, WHERE_SHARED = "C", "D", "S"

NvmeLike = NvmeTier | SegmentNvmeTier

# a block on its way down: key, payload, checksum if known, parent key
ChainItem = tuple[BlockKey, Buffer, "int | None", "BlockKey | None"]

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

    def __init__(self, limit: int = 262_144) -> None:  # ~50 MB at most
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
    def __init__(self, config: AgentConfig, *, dram: DramTier | None = None, nvme: NvmeLike | None = None,
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
        self._maintenance_runs = 0
        if nvme is not None:
            nvme.on_removed = lambda key: self._event_removed(key, "DISK")

    @classmethod
    def from_config(cls, config: AgentConfig) -> TierStore:
        dram = (DramTier(config.dram_capacity, config.dram_high_watermark, config.dram_low_watermark)
                if config.dram_capacity > 0 else None)
        nvme: NvmeLike | None = None
        if config.nvme_dir and config.nvme_layout == "segments":
            nvme = SegmentNvmeTier(config.nvme_dir, config.nvme_capacity, config.nvme_high_watermark,
                                   config.nvme_low_watermark, fsync=config.nvme_fsync, min_free=config.nvme_min_free,
                                   segment_bytes=config.nvme_segment_bytes)
        elif config.nvme_dir:
            nvme = NvmeTier(config.nvme_dir, config.nvme_capacity, config.nvme_high_watermark,
                            config.nvme_low_watermark, fsync=config.nvme_fsync, min_free=config.nvme_min_free)
        return cls(config, dram=dram, nvme=nvme, shared=build_shared_tier(config))

    @property
    def tiers(self) -> list[DramTier | NvmeLike | SharedTier]:
        return [t for t in (self.dram, self.nvme, self.shared) if t is not None]

    def close(self, wait: bool = True) -> None:
        self._io.shutdown(wait=wait, cancel_futures=not wait)
        if isinstance(self.nvme, SegmentNvmeTier):
            self.nvme.close()
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
        keys: list[BlockKey] = [(layout, h) for h in hashes]
        parents: list[BlockKey | None] = [(layout, parent) if parent is not None else None, *keys[:-1]]
        uses = [self.uses.bump(key) for key in keys]
        items: list[ChainItem] = [(k, p, None, par) for k, p, par in zip(keys, payloads, parents, strict=True)]
        if self.dram is None:
            return self._store_below(items, uses)
        held = 0
        fresh_hashes: list[BlockHash] = []
        through: list[tuple[BlockKey, DramBlock, BlockKey | None, int]] = []
        too_big: list[ChainItem] = []
        too_big_uses: list[int] = []
        for (key, payload, _digest, par), n_uses in zip(items, uses, strict=True):
            fresh = not self.dram.contains(key)
            started = time.perf_counter()
            evicted = self.dram.store_evicting(key, payload, parent=par)
            self._observe("store", "dram", started)
            if evicted is None:  # bigger than the whole DRAM tier
                too_big.append((key, payload, None, par))
                too_big_uses.append(n_uses)
                continue
            held += 1
            self._handle_dram_evictions(evicted)
            if fresh:
                fresh_hashes.append(key[1])
                block = self.dram.get(key) if self.eager else None
                if block is not None:
                    through.append((key, block, par, n_uses))
        self.dram.touch_chain(keys)
        if fresh_hashes:
            self.events.append(BlockStored(block_hashes=fresh_hashes, parent_block_hash=parent,
                                           block_size=self.config.block_size, medium="CPU"))
        if too_big:
            held += self._store_below(too_big, too_big_uses)
        if through:
            to_nvme = [(k, b, par) for k, b, par, n in through
                       if self.nvme is not None and n >= self.config.nvme_admit_reuse]
            to_shared = [(k, b, par) for k, b, par, n in through
                         if self.shared is not None and n >= self.config.shared_admit_reuse]
            if to_nvme or to_shared:
                size = sum(len(b.data) for _k, b, _p, _n in through)
                self._background(size, self._write_down_many, to_nvme, to_shared, "write_through")
        return held

    def _store_below(self, items: list[ChainItem], uses: list[int]) -> int:
        """No DRAM tier (or blocks bigger than it): write to NVMe / shared synchronously; how many are held."""
        held: set[BlockKey] = set()
        if self.nvme is not None:
            held |= self._nvme_store_many([it for it, n in zip(items, uses, strict=True)
                                           if n >= self.config.nvme_admit_reuse])
        if self.shared is not None:
            held |= self._shared_store_many([it for it, n in zip(items, uses, strict=True)
                                             if n >= self.config.shared_admit_reuse
                                             and (self.eager or it[0] not in held)])
        return len(held)

    def _handle_dram_evictions(self, evicted: list[tuple[BlockKey, DramBlock]]) -> None:
        for key, block in evicted:
            self._event_removed(key, "CPU")
            if self.eager:
                continue  # already written through
            uses = self.uses.get(key)
            entry = [(key, block, block.parent)]
            if self.nvme is not None and uses >= self.config.nvme_admit_reuse:
                self._background(len(block.data), self._write_down_many, entry, [], "demotions")
            elif self.shared is not None and uses >= self.config.shared_admit_reuse:
                self._background(len(block.data), self._write_down_many, [], entry, "demotions")

    def _write_down_many(self, to_nvme: list[tuple[BlockKey, DramBlock, BlockKey | None]],
                         to_shared: list[tuple[BlockKey, DramBlock, BlockKey | None]], kind: str) -> None:
        """Background: copy DRAM blocks to NVMe / the shared tier, a chain per write where the tier allows."""
        if to_nvme:
            items: list[ChainItem] = [(k, b.data, b.checksum(), par) for k, b, par in to_nvme]
            self.flow.add(kind, "nvme", len(self._nvme_store_many(items)))
        if to_shared:
            items = [(k, b.data, b.checksum(), par) for k, b, par in to_shared]
            self.flow.add(kind, "shared", len(self._shared_store_many(items)))

    def _nvme_store_many(self, items: list[ChainItem]) -> set[BlockKey]:
        """Write blocks to NVMe (one write per chain on the segment log); the keys now held there."""
        nvme = self.nvme
        assert nvme is not None
        fresh = [it for it in items if not nvme.contains(it[0])]
        if fresh:
            started = time.perf_counter()
            if isinstance(nvme, SegmentNvmeTier):
                nvme.store_many([(k, p, d) for k, p, d, _par in fresh])
            else:
                for k, p, d, _par in fresh:
                    nvme.store(k, p, d)
            self._observe("store", "nvme", started)
            stored = [it for it in fresh if nvme.contains(it[0])]
            if stored:
                first_parent = stored[0][3]
                self.events.append(BlockStored(block_hashes=[it[0][1] for it in stored],
                                               parent_block_hash=first_parent[1] if first_parent else None,
                                               block_size=self.config.block_size, medium="DISK"))
        return {it[0] for it in items if nvme.contains(it[0])}

    def _shared_store_many(self, items: list[ChainItem]) -> set[BlockKey]:
        """Write blocks to the shared tier in one round trip; the keys now held there."""
        shared = self.shared
        assert shared is not None
        fresh = [it for it in items if not shared.contains(it[0])]
        if fresh:
            started = time.perf_counter()
            written = shared.store_many([(k, p, d) for k, p, d, _par in fresh])
            self._observe("store", "shared", started)
            if written:
                first_parent = fresh[0][3]
                self.events.append(BlockStored(block_hashes=[it[0][1] for it in fresh],
                                               parent_block_hash=first_parent[1] if first_parent else None,
                                               block_size=self.config.block_size, medium="SHARED"))
        return {it[0] for it in items if shared.contains(it[0])}

    # -- load ------------------------------------------------------------------------------------------------

    def load_chain(self, layout: int, hashes: Sequence[BlockHash], outs: Sequence[memoryview]) -> list[int]:
        """Load the leading run of blocks into `outs`; the payload length of each block loaded, in order.
        Runs of blocks in the same lower tier are fetched together (one read / one round trip per run)."""
        keys = [(layout, h) for h in hashes]
        lengths: list[int] = []
        failed: set[tuple[str, int]] = set()
        i = 0
        while i < len(keys):
            if self.dram is not None:
                started = time.perf_counter()
                n = self.dram.read_into(keys[i], outs[i])
                if n is not None:
                    self._observe("load", "dram", started)
                    self.uses.bump(keys[i])
                    lengths.append(n)
                    i += 1
                    continue
            tier, run = self._lower_run(keys, i)
            if tier is None or (tier.name, i) in failed:
                break
            started = time.perf_counter()
            if isinstance(tier, SegmentNvmeTier | SharedTier):
                got = tier.read_many(keys[i:run], list(outs[i:run]))
            else:
                got = [tier.read_into(keys[j], outs[j]) for j in range(i, run)]
            self._observe("load", tier.name, started)
            for j, n_got in enumerate(got, start=i):
                if n_got is None:
                    break
                lengths.append(n_got)
                self._hit(keys[j], outs[j][:n_got], tier.name, keys[j - 1] if j else None)
            if len(lengths) < run:  # a miss or a bad block: another tier may still hold it (e.g. NVMe -> shared)
                i = len(lengths)
                failed.add((tier.name, i))
                continue
            i = run
        if self.dram is not None and lengths:
            self.dram.touch_chain(keys[: len(lengths)])
        return lengths

    def _lower_run(self, keys: list[BlockKey], i: int) -> tuple[NvmeLike | SharedTier | None, int]:
        """The lower tier holding keys[i] and the end of the run of following keys it holds (not in DRAM)."""
        for tier in (self.nvme, self.shared):
            if tier is not None and tier.contains(keys[i]):
                run = i + 1
                while run < len(keys) and tier.contains(keys[run]) and not self._closer(keys[run], tier):
                    run += 1
                return tier, run
        return None, i

    def _closer(self, key: BlockKey, tier: object) -> bool:
        """Whether a tier above `tier` holds the key (then it is read from there)."""
        if self.dram is not None and self.dram.contains(key):
            return True
        return tier is self.shared and self.nvme is not None and self.nvme.contains(key)

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
        self._maintenance_runs += 1
        if isinstance(self.nvme, SegmentNvmeTier) and self._maintenance_runs % 10 == 0:
            self.nvme.verify_segments()  # segment files deleted behind our back
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
            if n is not None and self._shared_store_many([(key, buf[:n], None, None)]):
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
