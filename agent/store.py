"""The agent's tier stack: DRAM over NVMe over the shared tier, and the flows that move blocks between them.

`TierStore` answers the three questions the agent's API asks: how many leading blocks of a hash chain are held
and where (`lookup`, local state only), store a chain (`store_chain`), load a chain (`load_chain`). It uses the
tiers only through their interface (agent/tiers/base.py) and asks `TierPolicy` (agent/policy.py) what goes
where: stores land in DRAM (eager: and are written through below, in the background), a block DRAM pushes out
moves down (lazy), a hit below DRAM is promoted, and `maintain()` brings every tier from its high watermark down
to its low one. Whatever a tier gains or loses becomes a vLLM KV event (`medium` = CPU / DISK / SHARED) queued
for the publisher; losses arrive through each tier's `on_removed`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial

from agent.block import BlockHash, BlockKey
from agent.config import AgentConfig
from agent.policy import TierPolicy, UseCounter
from agent.presence import PresenceMap
from agent.tiers.base import Buffer, HeldBlock, Removed, StoreItem, Tier, TierName
from agent.tiers.buffers import unfilled
from agent.tiers.copies import ParallelCopier
from agent.tiers.dram import BLOCK_BOOKKEEPING, DramTier
from agent.tiers.nvme import NvmeTier
from agent.tiers.segments import SegmentNvmeTier
from agent.tiers.shared import FsSharedTier, RedisSharedTier, SharedTier
from kvcore.aio import started_executor
from kvcore.kv_events import BlockRemoved, BlockStored, KvEvent

log = logging.getLogger(__name__)

# (operation "load" | "store", tier, seconds)
LatencyObserver = Callable[[str, TierName, float], None]

# blocks held in DRAM on their way to a lower tier
Descent = dict[TierName, list[tuple[BlockKey, HeldBlock]]]

# blocks the DRAM tier refused, with their use counts, on their way to the tiers below it
Refused = list[tuple[StoreItem, int]]

# demotions and evictions one upkeep run makes a tier past its high watermark go through at most (TierStore._make_room)
EVICTION_ROUNDS = 3


def _lower_tier_counts() -> dict[TierName, int]:
    return {TierName.NVME: 0, TierName.SHARED: 0}


@dataclass
class FlowStats:
    """Movements between tiers, for metrics."""

    promotions: dict[TierName, int] = field(default_factory=_lower_tier_counts)
    demotions: dict[TierName, int] = field(default_factory=_lower_tier_counts)
    write_through: dict[TierName, int] = field(default_factory=_lower_tier_counts)
    dropped_background_writes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, tier: TierName, n: int = 1) -> None:
        with self.lock:
            getattr(self, kind)[tier] += n


def build_shared_tier(config: AgentConfig) -> SharedTier | None:
    secret = config.shared_key()
    if config.shared_backend != "none" and secret is None:
        log.warning("shared tier without a fleet secret (--shared-secret / --shared-secret-file): whoever can "
                    "write %s can plant KV blocks this replica serves", config.shared_backend)
    if config.shared_backend == "redis":
        return RedisSharedTier(config.shared_url, prefix=config.shared_prefix, ttl_s=config.shared_ttl_s,
                               cluster=config.shared_cluster, timeout_s=config.shared_timeout_s,
                               retry_s=config.shared_retry_s, secret=secret, index_blocks=config.shared_index_blocks)
    if config.shared_backend == "fs":
        return FsSharedTier(config.shared_dir, prefix=config.shared_prefix, ttl_s=config.shared_ttl_s,
                            retry_s=config.shared_retry_s, secret=secret, index_blocks=config.shared_index_blocks)
    return None


def build_nvme_tier(config: AgentConfig) -> Tier | None:
    if not config.nvme_dir:
        return None
    if config.nvme_layout == "segments":
        return SegmentNvmeTier(config.nvme_dir, config.nvme_capacity, config.nvme_high_watermark,
                               config.nvme_low_watermark, fsync=config.nvme_fsync, min_free=config.nvme_min_free,
                               segment_bytes=config.nvme_segment_bytes,
                               copier=ParallelCopier(config.copy_threads, "kvgate-agent-nvme-read"))
    return NvmeTier(config.nvme_dir, config.nvme_capacity, config.nvme_high_watermark, config.nvme_low_watermark,
                    fsync=config.nvme_fsync, min_free=config.nvme_min_free)


class TierStore:
    """`dram` is the tier in this process's memory (stores land there, hits are promoted there, its copies feed
    the lower tiers), `nvme` the local medium, `shared` the fleet-wide one; any may be absent. `executor` runs
    write-through and demotion in the background (a simulation passes one that runs them at once).
    `chain_events`: a BlockStored per run of blocks that is a chain, as vLLM's events are; False: one per tier
    for all the blocks one write took (parent None), for a reader that places announced blocks by their hash
    alone, as kvgate's gateway does with the agent's: the simulation, where a demotion, whose blocks leave DRAM
    one leaf at a time, would otherwise cost an event per block."""

    def __init__(self, config: AgentConfig, *, dram: Tier | None = None, nvme: Tier | None = None,
                 shared: SharedTier | None = None, background_bytes: int = 256 * 2**20,
                 executor: Executor | None = None, chain_events: bool = True) -> None:
        self.config = config
        self.chain_events = chain_events
        self.policy = TierPolicy.from_config(config)
        self.dram = dram
        self.nvme = nvme
        self.shared = shared
        self.tiers: list[Tier] = [t for t in (dram, nvme, shared) if t is not None]
        self.flow = FlowStats()
        self.uses = UseCounter()
        self.events: deque[KvEvent] = deque()
        self.observe: LatencyObserver | None = None
        # started now: a store on the agent's event loop hands its write-through here (kvcore.aio.started_executor)
        self._io = executor or started_executor(config.io_threads, "kvgate-agent-io")
        self._background_limit = background_bytes
        self._background_bytes = 0
        self._background_lock = threading.Lock()
        self._probing: set[BlockKey] = set()
        self._maintenance_runs = 0
        # set by the agent that publishes one (agent/presence.py): every block's bit is set before it is held
        self.presence: PresenceMap | None = None
        for tier in self.tiers:
            tier.on_removed = partial(self._removed, tier)

    @classmethod
    def from_config(cls, config: AgentConfig) -> TierStore:
        dram = (DramTier(config.dram_capacity, config.dram_high_watermark, config.dram_low_watermark,
                         copier=ParallelCopier(config.copy_threads), bookkeeping=BLOCK_BOOKKEEPING)
                if config.dram_capacity > 0 else None)
        return cls(config, dram=dram, nvme=build_nvme_tier(config), shared=build_shared_tier(config))

    def close(self, wait: bool = True) -> None:
        self._io.shutdown(wait=wait, cancel_futures=not wait)
        for tier in self.tiers:
            tier.close()

    @property
    def background_bytes(self) -> int:
        """Bytes of write-throughs and demotions queued or running: 0 once every lower tier holds what it was sent
        (or refused it)."""
        return self._background_bytes

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until background writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.background_bytes > 0 and time.monotonic() < deadline:
            time.sleep(0.005)

    def _below(self, tier: Tier) -> list[Tier]:
        return self.tiers[self.tiers.index(tier) + 1:]

    def _tier(self, name: TierName) -> Tier:
        return next(t for t in self.tiers if t.name is name)

    # -- lookup ----------------------------------------------------------------------------------------------

    def lookup(self, layout: int, hashes: Sequence[BlockHash]) -> tuple[int, str]:
        """How many leading blocks are held, and where each would come from (one `TierName.code` per block);
        local state only, no I/O."""
        tiers = self.tiers
        if self.shared is not None and not self.shared.available:  # down or backing off: nothing to load there
            tiers = [t for t in tiers if t is not self.shared]
        if not tiers:
            return 0, ""
        (first, first_code), *rest = [(t.contains, t.name.code) for t in tiers]
        where: list[str] = []
        for block_hash in hashes:
            key = (layout, block_hash)
            if first(key):  # the closest tier, asked first without a loop: lookups are on the request path
                where.append(first_code)
                continue
            for contains, code in rest:
                if contains(key):
                    where.append(code)
                    break
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
                    parent: BlockHash | None = None, digests: Sequence[int | None] | None = None) -> int:
        """Store consecutive blocks of one prefix (block i's parent is block i-1); returns how many are held.
        `digests`: the payloads' checksums where the caller knows them (else computed when a block first leaves
        DRAM)."""
        if self.dram is None:
            _keys, items, uses = self._chain(layout, hashes, payloads, parent, digests)
            return self._store_below(self.tiers, items, uses)
        held, refused = self.store_in_memory(layout, hashes, payloads, parent, digests)
        return held + self.store_refused(refused)

    def store_in_memory(self, layout: int, hashes: Sequence[BlockHash], payloads: Sequence[Buffer],
                        parent: BlockHash | None = None,
                        digests: Sequence[int | None] | None = None) -> tuple[int, Refused]:
        """The part of `store_chain` that waits for no medium (there must be a DRAM tier): copy the chain into DRAM
        (what that pushes out, and eager write-through, move down in the background); how many blocks DRAM holds,
        and the blocks it refused (bigger than the whole tier), for `store_refused` -- while their payloads last."""
        assert self.dram is not None
        dram = self.dram
        keys, items, uses = self._chain(layout, hashes, payloads, parent, digests)
        contains = dram.contains
        self._write(dram, items, [contains(key) for key in keys])
        dram.touch(keys)
        refused = [(item, n) for item, n in zip(items, uses, strict=True) if not contains(item.key)]
        if self.policy.eager:  # every block, not just new ones: a block stored again may now be admitted below
            self._write_through(dram, list(zip(keys, uses, strict=True)))
        return len(items) - len(refused), refused

    def store_refused(self, refused: Refused) -> int:
        """Write blocks DRAM refused to the tiers below it now; how many they hold."""
        if not refused or self.dram is None:
            return 0
        return self._store_below(self._below(self.dram), [it for it, _n in refused], [n for _it, n in refused])

    def _chain(self, layout: int, hashes: Sequence[BlockHash], payloads: Sequence[Buffer], parent: BlockHash | None,
               digests: Sequence[int | None] | None) -> tuple[list[BlockKey], list[StoreItem], list[int]]:
        keys: list[BlockKey] = [(layout, h) for h in hashes]
        if self.presence is not None:
            self.presence.add(keys)
        parents: list[BlockKey | None] = [(layout, parent) if parent is not None else None, *keys[:-1]]
        uses = self.uses.bump_all(keys)
        items = [StoreItem(k, p, d, par) for k, p, d, par in zip(keys, payloads, digests or [None] * len(keys),
                                                                 parents, strict=True)]
        return keys, items, uses

    def _store_below(self, tiers: list[Tier], items: list[StoreItem], uses: list[int]) -> int:
        """No DRAM tier (or blocks bigger than it): write to the lower tiers now, each block to the first that
        admits and keeps it (eager: to every one that admits it); how many are held."""
        held: set[BlockKey] = set()
        for tier in tiers:
            todo = [item for item, n in zip(items, uses, strict=True)
                    if self.policy.admits(tier.name, n) and (self.policy.eager or item.key not in held)]
            if todo:
                held |= self._store_in(tier, todo)
        return len(held)

    def _write_through(self, source: Tier, used: list[tuple[BlockKey, int]]) -> None:
        """Eager: copy blocks just used (stored or hit) from `source`'s memory to the lower tiers that admit them
        now and do not hold them yet, in the background (one write / one pipeline per chain)."""
        below = [t.name for t in self._below(source)]
        descent: Descent = {}
        size = 0
        for key, n in used:
            targets = [t for t in self.policy.write_through(below, n) if not self._tier(t).contains(key)]
            block = source.held(key) if targets else None
            if block is None:
                continue
            for target in targets:
                descent.setdefault(target, []).append((key, block))
            size += len(block.data)
        if descent:
            self._background(size, self._write_down, descent, "write_through")

    def _removed(self, tier: Tier, removed: list[Removed]) -> None:
        """A tier lost blocks: announce it; lazy, blocks pushed out with their bytes in hand move down (one
        background write per lower tier)."""
        self.events.append(BlockRemoved(block_hashes=[r.key[1] for r in removed], medium=tier.name.medium))
        below = [t.name for t in self._below(tier)]
        descent: Descent = {}
        size = 0
        targets: dict[int, TierName | None] = {}  # by uses: the policy's answer depends on nothing else
        uses = self.uses.get
        for key, block in removed:
            if block is None:
                continue
            n = uses(key)
            target = targets[n] if n in targets else targets.setdefault(n, self.policy.demote_to(below, n))
            if target is not None:
                descent.setdefault(target, []).append((key, block))
                size += len(block.data)
        if descent:
            self._background(size, self._write_down, descent, "demotions")

    def _write_down(self, descent: Descent, kind: str) -> None:
        """Background: copy blocks held in DRAM to lower tiers, a chain per write where the tier allows."""
        for name, blocks in descent.items():
            tier = self._tier(name)
            items = [block.item(key) for key, block in blocks]
            # counted: the blocks this write added (another write of the same blocks may have come first: a hit
            # right after a store schedules one before the store's own write-through has run)
            self.flow.add(kind, name, self._write(tier, items, [tier.contains(item.key) for item in items]))

    def _store_in(self, tier: Tier, items: list[StoreItem]) -> set[BlockKey]:
        """Write the blocks `tier` does not hold yet and announce the ones it took; the keys it holds afterwards."""
        contains = tier.contains
        self._write(tier, items, [contains(item.key) for item in items])
        return {item.key for item in items if contains(item.key)}

    def _write(self, tier: Tier, items: list[StoreItem], known: list[bool]) -> int:
        """Write the blocks not `known` to `tier` (one call: a chain per write where the medium allows) and
        announce the ones it took; how many it took."""
        fresh = [item for item, was in zip(items, known, strict=True) if not was]
        if not fresh:
            return 0
        started = time.perf_counter()
        tier.store_many(fresh)
        self._observe("store", tier.name, started)
        contains = tier.contains
        taken = [item for item in fresh if contains(item.key)]
        self._announce(tier, taken)
        return len(taken)

    def _announce(self, tier: Tier, stored: list[StoreItem]) -> None:
        """One BlockStored per run of blocks that is a chain (each block the parent of the next)."""
        if not stored:
            return
        medium, block_size, events = tier.name.medium, self.config.block_size, self.events
        if not self.chain_events:
            events.append(BlockStored(block_hashes=[item.key[1] for item in stored], parent_block_hash=None,
                                      block_size=block_size, medium=medium))
            return
        ends = [i for i, (before, item) in enumerate(itertools.pairwise(stored), 1) if item.parent != before.key]
        ends.append(len(stored))
        start = 0
        for end in ends:
            parent = stored[start].parent
            events.append(BlockStored(block_hashes=[item.key[1] for item in stored[start:end]],
                                      parent_block_hash=parent[1] if parent else None, block_size=block_size,
                                      medium=medium))
            start = end

    # -- load ------------------------------------------------------------------------------------------------

    def load_chain(self, layout: int, hashes: Sequence[BlockHash], outs: Sequence[memoryview],
                   memory_only: bool = False) -> list[int]:
        """Load the leading run of blocks into `outs`; the payload length of each block loaded, in order.
        DRAM is asked first for every block; runs of blocks in the same lower tier are fetched together (one
        read / one round trip per run). `memory_only`: stop at the first block DRAM cannot supply (no medium is
        read: the agent's event loop loads so, and hands the rest of the chain to a thread)."""
        keys = [(layout, h) for h in hashes]
        lengths: list[int] = []
        failed: set[tuple[TierName, int]] = set()
        dram_hits: list[tuple[BlockKey, int]] = []
        i = 0
        dram = self.dram
        while i < len(keys):
            if isinstance(dram, DramTier):  # the leading run it holds, under one lock, large blocks in parallel
                started = time.perf_counter()
                held = dram.read_run(keys[i:], outs[i:])
                if held:
                    self._observe("load", dram.name, started, len(held))
                    dram_hits += [(key, self.uses.bump(key)) for key in keys[i: i + len(held)]]
                    lengths += held
                    i += len(held)
                    if i == len(keys):
                        break
            elif dram is not None:
                started = time.perf_counter()
                n = dram.read_into(keys[i], outs[i])
                if n is not None:
                    self._observe("load", dram.name, started)
                    dram_hits.append((keys[i], self.uses.bump(keys[i])))
                    lengths.append(n)
                    i += 1
                    continue
            if memory_only:
                break
            tier, run = self._lower_run(keys, i, failed)
            if tier is None:
                break
            started = time.perf_counter()
            got = tier.read_many(keys[i:run], outs[i:run])
            self._observe("load", tier.name, started)
            first = len(lengths)
            for n_got in got:
                if n_got is None:
                    break
                lengths.append(n_got)
            self._hits(keys, outs, lengths, first, tier.name)
            if len(lengths) < run:  # a miss or a bad block: another tier may still hold it (e.g. NVMe -> shared)
                i = len(lengths)
                failed.add((tier.name, i))
                continue
            i = run
        if self.dram is not None and lengths:
            self.dram.touch(keys[: len(lengths)])
            if self.policy.eager and dram_hits:  # a hit is a use: it may be what admits the block below
                self._write_through(self.dram, dram_hits)
        return lengths

    def _lower_run(self, keys: list[BlockKey], i: int, failed: set[tuple[TierName, int]]) -> tuple[Tier | None, int]:
        """The closest tier below DRAM holding keys[i] (and not failing on it already), and the end of the run of
        following keys it serves: those it holds that no closer tier does."""
        for depth, tier in enumerate(self.tiers):
            if tier is self.dram or (tier.name, i) in failed or not tier.contains(keys[i]):
                continue
            closer = self.tiers[:depth]
            run = i + 1
            while (run < len(keys) and tier.contains(keys[run])
                   and not any(t.contains(keys[run]) for t in closer)):
                run += 1
            return tier, run
        return None, i

    def _hits(self, keys: list[BlockKey], outs: Sequence[memoryview], lengths: list[int], first: int,
              tier: TierName) -> None:
        """Blocks `first:` of `lengths` were read from a lower tier: count the uses, and promote them as one chain
        (so DRAM keeps the chain's head, not its tail, when the run does not fit)."""
        for key in keys[first: len(lengths)]:
            self.uses.bump(key)
        dram = self.dram
        if not self.policy.promote_on_hit or dram is None:
            return
        items = [StoreItem(keys[j], outs[j][: lengths[j]], None, keys[j - 1] if j else None)
                 for j in range(first, len(lengths)) if not dram.contains(keys[j])]
        if items:
            dram.store_many(items)
            promoted = [item for item in items if dram.contains(item.key)]
            if promoted:
                self.flow.add("promotions", tier, len(promoted))
                self._announce(dram, promoted)

    # -- pressure, TTL, index refresh ------------------------------------------------------------------------

    def maintain(self) -> None:
        """Watermark-driven demotion and eviction, and the tiers' periodic checks; run every 0.2 s off the event
        loop."""
        self._maintenance_runs += 1
        for tier in self.tiers:
            if self._maintenance_runs % 10 == 0:
                tier.upkeep()
            if tier.above_high_watermark():
                self._make_room(tier)

    def _make_room(self, tier: Tier) -> None:
        """Bring `tier` down to its low watermark, what it offers demoted first (lazy). The eviction drops only
        blocks offered, so a store or a hit during the demotion can leave it short: what is then over the low
        watermark is offered and evicted in turn, EVICTION_ROUNDS at most (stores that keep landing leave the rest
        for the next time the tier is past its high watermark; the store-time bounds are the hard limit)."""
        offered = self._demote_before_eviction(tier)
        tier.evict_to_low_watermark(offered)
        for _round in range(1, EVICTION_ROUNDS):
            if offered is None:
                return
            offered = self._demote_before_eviction(tier)
            if not offered:
                return
            tier.evict_to_low_watermark(offered)

    def _demote_before_eviction(self, tier: Tier, group_bytes: int = 8 * 2**20) -> set[BlockKey] | None:
        """Lazy: copy what `tier` is about to evict to the first lower tier that admits it, where the eviction
        itself cannot hand the bytes over (they are on a medium, not in memory): read in runs (one preadv per
        run of a segment) and written in groups (one pipeline / one append per group of up to `group_bytes`).
        The keys offered, the only ones the eviction may drop then: stores and hits meanwhile change what it would
        drop, and it dropped blocks never offered, lost from every tier though a lower one had room. None where
        nothing is demoted (eager, or no tier below): any block may go."""
        below = [t.name for t in self._below(tier)]
        if self.policy.eager or not below:
            return None
        groups: dict[TierName, list[tuple[BlockKey, int]]] = {}
        candidates = tier.demotion_candidates()
        for key, size in candidates:
            target = self.policy.demote_to(below, self.uses.get(key))
            if target is not None and not self._tier(target).contains(key):
                groups.setdefault(target, []).append((key, size))
        for target, candidates in groups.items():
            start = 0
            while start < len(candidates):
                end, total = start, 0
                while end < len(candidates) and (end == start or total + candidates[end][1] <= group_bytes):
                    total += candidates[end][1]
                    end += 1
                batch = candidates[start:end]
                start = end
                bufs = [memoryview(unfilled(size)) for _key, size in batch]  # read into before use
                got = tier.read_many([key for key, _size in batch], bufs, touch=False)
                items = [StoreItem(key, buf[:n]) for (key, _size), buf, n in zip(batch, bufs, got, strict=True)
                         if n is not None]
                if items:
                    stored = self._store_in(self._tier(target), items)
                    self.flow.add("demotions", target, sum(item.key in stored for item in items))
        return {key for key, _size in candidates}

    def sweep_shared(self) -> None:
        if self.shared is not None:
            self.shared.sweep()

    def refresh_shared_index(self) -> int:
        return self.shared.refresh_index() if self.shared is not None else 0

    # -- helpers ---------------------------------------------------------------------------------------------

    def drain_events(self) -> list[KvEvent]:
        out: list[KvEvent] = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def _observe(self, op: str, tier: TierName, started: float, blocks: int = 1) -> None:
        """One observation per block: a run of `blocks` read together counts each at its share of the time."""
        if self.observe is not None:
            seconds = (time.perf_counter() - started) / blocks
            for _ in range(blocks):
                self.observe(op, tier, seconds)

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
