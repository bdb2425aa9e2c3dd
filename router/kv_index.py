"""The KV-block index: which workers hold which of the gateway's block keys, and on which tier.

One small interface — `lookup`, `add`, `remove`, `clear` — with an in-memory implementation. It is shaped so
that a Redis-backed implementation (keys → worker/tier sets, pipelined lookups) can serve many gateways later:
every call names the worker and the tier, and `lookup` asks about one prompt's keys at once.

Tiers are the KV events' `medium` values (kvcore.kv_events): GPU (the engine's own cache), and the tier agent's
CPU, DISK and SHARED. A block in the SHARED tier is reachable from every worker.
"""

from __future__ import annotations

import abc
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from operator import and_, or_
from typing import cast

from kvcore.dict_tables import TableTrim
from kvcore.kv_events import CPU, DISK, GPU, SHARED
from router.block_keys import BlockKey

TIERS = (GPU, CPU, DISK, SHARED)
_BIT = {tier: 1 << i for i, tier in enumerate(TIERS)}
_NOTHING: dict[BlockKey, int] = {}  # read in place of a tier's map while that one is empty (see `_other_gets`)
MaskGet = Callable[[BlockKey, int], int]  # a tier map's `get`: key, 0 -> the bit mask of the workers holding it


def tier_of(medium: str | None) -> str:
    """vLLM says "GPU" even on CPU builds; no medium means the engine's own cache; unknown names map to CPU."""
    if medium is None:
        return GPU
    medium = medium.upper()
    if medium in _BIT:
        return medium
    return {"STORAGE": DISK, "NVME": DISK, "DRAM": CPU, "REDIS": SHARED}.get(medium, CPU)


@dataclass(slots=True)
class PrefixRun:
    """How many leading blocks of a prompt a worker can get, by the cheapest tier it has each one on."""

    blocks: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)


class KvBlockIndex(abc.ABC):
    """Which engines hold which blocks, on what tier."""

    @abc.abstractmethod
    def lookup(self, keys: Sequence[BlockKey], workers: Iterable[str]) -> dict[str, PrefixRun]:
        """For each worker: the longest run of leading `keys` it holds (or can reach in the shared tier)."""

    @abc.abstractmethod
    def add(self, worker: str, keys: Iterable[BlockKey], tier: str) -> None:
        """The worker now holds these blocks on `tier`."""

    @abc.abstractmethod
    def remove(self, worker: str, keys: Iterable[BlockKey], tier: str) -> None:
        """The worker no longer holds these blocks on `tier` (unknown ones are ignored)."""

    @abc.abstractmethod
    def clear(self, worker: str) -> None:
        """Forget everything about one worker."""

    @abc.abstractmethod
    def entries(self) -> int:
        """(block, worker) pairs held."""


class _Arrivals:
    """The order a worker got its blocks in (for dropping its oldest, and forgetting it), as a log of 64-bit keys:
    8 bytes per block, not a dict entry (a map per worker of every block it holds cost 40-70 bytes per (block,
    worker) pair). A key is appended each time it becomes new to the worker; its last
    appearance is its place (the place an insertion-ordered dict would give it), and appearances of keys the
    worker no longer holds are stale. The log is rewritten without them once they make up half of it."""

    __slots__ = ("held", "keys")

    def __init__(self) -> None:
        self.keys = array("Q")  # block keys are 64-bit (xxh3_64)
        self.held = 0  # blocks the worker holds: the log's live appearances


class InMemoryKvIndex(KvBlockIndex):
    """The index in this process. Workers get small ids; for each tier, each block key held there maps to a bit
    mask of the workers holding it (so a lookup is a few integer operations per block, and a block costs one
    entry per tier it is on, not a map per block: a fleet's NVMe and shared tiers hold millions).

    Bounded by `max_entries` (block, worker) pairs: beyond it the oldest blocks are dropped, since without
    their removal events the gateway can no longer be sure of them anyway.
    """

    STALE_SLACK = 4096  # stale log entries a worker's log may hold beyond as many as it has live ones

    def __init__(self, max_entries: int = 10_000_000) -> None:
        self.max_entries = max_entries
        self._ids: dict[str, int] = {}
        self._free_ids: list[int] = []
        # tier -> key -> bit mask of worker ids holding it there
        self._masks: dict[str, MutableMapping[BlockKey, int]] = {tier: {} for tier in TIERS}
        self._others: dict[str, list[MutableMapping[BlockKey, int]]] = {}  # see _mapped
        self._mapped()
        self._trims: dict[str, TableTrim] | None = None  # see compact_tables
        self._arrivals: dict[int, _Arrivals] = {}
        self._entries = 0
        self.dropped = 0

    def compact_tables(self, tables: Mapping[str, Callable[[], MutableMapping[BlockKey, int]]] | None = None) -> None:
        """From now on keep each tier's map at the table size a copy of it would have (`TableTrim`): half the
        memory of maps whose entries come and go, for copying a map into itself (tens of ms per 100,000 entries)
        whenever CPython would grow it. For long simulations (`kvgate bench vsim`); a live gateway would stall its
        event loop meanwhile. `tables`: tiers whose map (key -> bit mask of worker ids) is made by a factory instead
        of a dict (a replay's NVMe tier in arrays, bench/sim/hash_map.py); before anything is added."""
        for tier, make in (tables or {}).items():
            if self._masks[tier]:
                raise ValueError(f"the {tier} map is not empty")
            self._masks[tier] = make()
        self._mapped()
        self._trims = {tier: TableTrim() for tier, masks in self._masks.items() if type(masks) is dict}

    def _mapped(self) -> None:
        """Name each tier's map, and for each tier the maps of the others, the dicts first: whether a worker holds
        a block on another tier is asked in that order and stops at the first yes, and a dict's `get` is a C call
        where a `U64Map`'s is a Python one."""
        self._gpu, self._cpu, self._disk, self._shared = (self._masks[t] for t in TIERS)
        self._others = {tier: sorted((masks for t, masks in self._masks.items() if t != tier),
                                     key=lambda masks: type(masks) is not dict) for tier in TIERS}

    def _other_gets(self, tier: str) -> tuple[MaskGet, MaskGet, MaskGet]:
        """The `get` of the three other tiers' maps (`_mapped`'s order), an empty one's as an empty dict's."""
        first, second, third = self._others[tier]
        nothing = _NOTHING.get
        return first.get if first else nothing, second.get if second else nothing, third.get if third else nothing

    def _id(self, worker: str) -> int:
        wid = self._ids.get(worker)
        if wid is None:
            wid = self._free_ids.pop() if self._free_ids else len(self._ids)
            self._ids[worker] = wid
            self._arrivals[wid] = _Arrivals()
        return wid

    def _tiers_of(self, key: BlockKey, wid: int) -> int:
        """The tier bits (`_BIT`) of the tiers worker `wid` holds `key` on."""
        return ((self._gpu.get(key, 0) >> wid & 1) | (self._cpu.get(key, 0) >> wid & 1) << 1
                | (self._disk.get(key, 0) >> wid & 1) << 2 | (self._shared.get(key, 0) >> wid & 1) << 3)

    def lookup(self, keys: Sequence[BlockKey], workers: Iterable[str]) -> dict[str, PrefixRun]:
        runs = {w: PrefixRun() for w in workers}
        ids = {self._ids[w]: w for w in runs if w in self._ids}
        wanted = sum(1 << wid for wid in ids)
        gpu, cpu, disk, shared = self._gpu, self._cpu, self._disk, self._shared
        lower = bool(cpu or disk or shared)
        if not wanted and not shared:
            return runs
        ends: dict[int, int] = {}
        live = wanted
        # per block, the workers holding it on the GPU or in DRAM: a lazy chain of C maps, so the Python loop below
        # does one test per block and stops where the last run ends. The tiers below (NVMe, the shared tier: all
        # workers hold what it holds) are read only for a block some worker still in the running holds on
        # neither: a prompt's blocks are mostly where they were computed or loaded (99% of them in a replay with
        # tiers), and the NVMe map is the largest and, in a replay, the slowest to read (`U64Map`)
        masks: Iterator[int] = map(gpu.get, keys, repeat(0))
        if cpu:
            masks = map(or_, masks, map(cpu.get, keys, repeat(0)))
        below = bool(disk or shared)
        disk_get = disk.get
        for i, held in enumerate(masks if live else ()):
            if held & live != live:
                if below:
                    key = keys[i]
                    held |= disk_get(key, 0)
                    if key in shared:
                        held |= wanted
                    if held & live == live:
                        continue
                held &= live
                gone = live & ~held
                while gone:
                    low = gone & -gone
                    ends[low.bit_length() - 1] = i
                    gone ^= low
                live = held
                if not live:
                    break
        shared_run = 0
        if shared and len(ids) < len(runs):  # workers the index never heard of reach the shared tier only
            while shared_run < len(keys) and keys[shared_run] in shared:
                shared_run += 1
        counted: list[tuple[int, int, dict[str, int]]] = []  # (worker id, blocks, by tier) to count by tier
        for worker, run in runs.items():
            wid = self._ids.get(worker)
            if wid is None:
                if shared_run:
                    run.blocks, run.by_tier = shared_run, {SHARED: shared_run}
                continue
            blocks = ends.get(wid, len(keys))
            run.blocks = blocks
            if not blocks:
                continue
            if not lower:
                run.by_tier = {GPU: blocks}
                continue
            counted.append((wid, blocks, run.by_tier))
        if counted:
            # each block by the cheapest tier the worker holds it on (none of its own: the shared tier), the tiers
            # named in the order of their first block (the order the strategy sums them in). A prompt's blocks come
            # in runs held alike (a system prompt, then a question): the GPU and DRAM masks are read in one C pass,
            # each run of equal masks is counted once for all workers, and the NVMe map is read only for the
            # blocks of a run that a worker holds on neither
            head = keys[: max(blocks for _wid, blocks, _by_tier in counted)]
            start = 0
            for (on_gpu, on_cpu), same in groupby(zip(map(gpu.get, head, repeat(0)), map(cpu.get, head, repeat(0)),
                                                      strict=True)):
                end = start + len(list(same))
                for wid, blocks, by_tier in counted:
                    n = min(blocks, end) - start
                    if n <= 0:
                        continue
                    if on_gpu >> wid & 1 or on_cpu >> wid & 1:
                        tier = GPU if on_gpu >> wid & 1 else CPU
                        by_tier[tier] = by_tier.get(tier, 0) + n
                        continue
                    for on_disk, alike in groupby(map(and_, map(disk_get, head[start:start + n], repeat(0)),
                                                      repeat(1 << wid))):
                        tier = DISK if on_disk else SHARED
                        by_tier[tier] = by_tier.get(tier, 0) + len(list(alike))
                start = end
        return runs

    def add(self, worker: str, keys: Iterable[BlockKey], tier: str) -> None:
        wid = self._id(worker)
        bit = 1 << wid
        arrivals = self._arrivals[wid]
        log = arrivals.keys
        before = len(log)
        masks = self._masks[tier]
        get = masks.get
        first, second, third = self._other_gets(tier)
        known = len(masks)
        for key in keys:
            mask = get(key, 0)
            if mask & bit:
                continue
            if not (first(key, 0) & bit or second(key, 0) & bit or third(key, 0) & bit):  # new to the worker
                log.append(key)
            masks[key] = mask | bit
        if self._trims is not None and (trim := self._trims.get(tier)) is not None:
            trim.check(cast(dict[BlockKey, int], masks), len(masks) - known)
        new = len(log) - before
        if new:
            self._entries += new
            arrivals.held += new
            if len(log) > 2 * arrivals.held + self.STALE_SLACK:
                arrivals.keys = array("Q", self._held_in_order(wid))
        if self._entries > self.max_entries:
            self._shrink()

    def remove(self, worker: str, keys: Iterable[BlockKey], tier: str) -> None:
        wid = self._ids.get(worker)
        if wid is None:
            return
        # `_drop` for one tier, inline: evictions remove a block per call, the largest share of an index's updates
        bit = 1 << wid
        masks = self._masks[tier]
        get = masks.get
        first, second, third = self._other_gets(tier)
        gone = 0
        for key in keys:
            mask = get(key, 0)
            if not mask & bit:
                continue
            if mask == bit:
                del masks[key]
            else:
                masks[key] = mask ^ bit
            if not (first(key, 0) & bit or second(key, 0) & bit or third(key, 0) & bit):  # the worker's last tier
                gone += 1
        if gone:
            self._entries -= gone
            self._arrivals[wid].held -= gone

    def _drop(self, key: BlockKey, wid: int, tier_bits: int) -> None:
        """Take `tier_bits` of `key` away from worker `wid`."""
        before = self._tiers_of(key, wid)
        if not before & tier_bits:
            return
        for tier in TIERS:
            if before & tier_bits & _BIT[tier]:
                masks = self._masks[tier]
                left = masks[key] & ~(1 << wid)
                if left:
                    masks[key] = left
                else:
                    del masks[key]
        if not before & ~tier_bits:
            self._entries -= 1
            self._arrivals[wid].held -= 1

    def _held_in_order(self, wid: int) -> list[BlockKey]:
        """The blocks worker `wid` holds, oldest first: the last appearance in its log of each one it holds."""
        bit = 1 << wid
        gpu, cpu, disk, shared = self._gpu, self._cpu, self._disk, self._shared
        seen: set[BlockKey] = set()
        out: list[BlockKey] = []
        for key in reversed(self._arrivals[wid].keys):
            if key in seen:
                continue
            seen.add(key)
            if (gpu.get(key, 0) | cpu.get(key, 0) | disk.get(key, 0) | shared.get(key, 0)) & bit:
                out.append(key)
        out.reverse()
        return out

    def clear(self, worker: str) -> None:
        wid = self._ids.pop(worker, None)
        if wid is None:
            return
        everything = sum(_BIT.values())
        for key in self._arrivals[wid].keys:  # a stale appearance is dropped as a block it does not hold: skipped
            self._drop(key, wid, everything)
        del self._arrivals[wid]
        self._free_ids.append(wid)

    def holds(self, worker: str) -> set[tuple[BlockKey, str]]:
        """Every (key, tier) the worker holds (for tests and debugging)."""
        wid = self._ids.get(worker)
        if wid is None:
            return set()
        out: set[tuple[BlockKey, str]] = set()
        for key in self._held_in_order(wid):
            mask = self._tiers_of(key, wid)
            out.update((key, tier) for tier in TIERS if mask & _BIT[tier])
        return out

    def entries(self) -> int:
        return self._entries

    def _shrink(self) -> None:
        """Drop each worker's oldest blocks (insertion order), in proportion, until 10% below the bound."""
        everything = sum(_BIT.values())
        share = 1 - int(self.max_entries * 0.9) / self._entries
        for wid in list(self._arrivals):
            keys = self._held_in_order(wid)
            for key in keys[: math.ceil(len(keys) * share)]:
                self._drop(key, wid, everything)
                self.dropped += 1

