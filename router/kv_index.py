"""The KV-block index: which workers hold which of the gateway's block keys, and on which tier.

One small interface — `lookup`, `add`, `remove`, `clear` — with an in-memory implementation. It is shaped so
that a Redis-backed implementation (keys → worker/tier sets, pipelined lookups) can serve many gateways later:
every call names the worker and the tier, and `lookup` asks about one prompt's keys at once.

Tiers are vLLM's `medium` strings: "GPU" (the engine's own cache), and the tier agent's "CPU", "DISK" and
"SHARED". A block in the SHARED tier is reachable from every worker.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from router.block_keys import BlockKey

GPU, CPU, DISK, SHARED = "GPU", "CPU", "DISK", "SHARED"
TIERS = (GPU, CPU, DISK, SHARED)
_BIT = {tier: 1 << i for i, tier in enumerate(TIERS)}


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


class InMemoryKvIndex(KvBlockIndex):
    """The index in this process: block key → {worker: tier bit mask}, plus per-worker key sets for `clear`.

    Bounded by `max_entries` (block, worker) pairs: beyond it the oldest blocks are dropped, since without
    their removal events the gateway can no longer be sure of them anyway.
    """

    def __init__(self, max_entries: int = 10_000_000) -> None:
        self.max_entries = max_entries
        self._holders: dict[BlockKey, dict[str, int]] = {}
        self._by_worker: dict[str, set[BlockKey]] = {}
        self._entries = 0
        self.dropped = 0

    def lookup(self, keys: Sequence[BlockKey], workers: Iterable[str]) -> dict[str, PrefixRun]:
        runs = {w: PrefixRun() for w in workers}
        live = list(runs)
        holders_of = self._holders
        shared_bit = _BIT[SHARED]
        for key in keys:
            holders = holders_of.get(key)
            if not holders:
                break
            shared = any(mask & shared_bit for mask in holders.values())
            still = []
            for worker in live:
                mask = holders.get(worker, 0)
                tier = _cheapest(mask) if mask else (SHARED if shared else None)
                if tier is None:
                    continue
                run = runs[worker]
                run.blocks += 1
                run.by_tier[tier] = run.by_tier.get(tier, 0) + 1
                still.append(worker)
            live = still
            if not live:
                break
        return runs

    def add(self, worker: str, keys: Iterable[BlockKey], tier: str) -> None:
        bit = _BIT[tier]
        held = self._by_worker.setdefault(worker, set())
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = {}
            mask = holders.get(worker, 0)
            if not mask:
                self._entries += 1
                held.add(key)
            holders[worker] = mask | bit
        if self._entries > self.max_entries:
            self._shrink()

    def remove(self, worker: str, keys: Iterable[BlockKey], tier: str) -> None:
        bit = _BIT[tier]
        held = self._by_worker.get(worker)
        for key in keys:
            holders = self._holders.get(key)
            if holders is None or worker not in holders:
                continue
            mask = holders[worker] & ~bit
            if mask:
                holders[worker] = mask
                continue
            del holders[worker]
            self._entries -= 1
            if held is not None:
                held.discard(key)
            if not holders:
                del self._holders[key]

    def clear(self, worker: str) -> None:
        for key in self._by_worker.pop(worker, set()):
            holders = self._holders.get(key)
            if holders is not None and holders.pop(worker, None) is not None:
                self._entries -= 1
                if not holders:
                    del self._holders[key]

    def holds(self, worker: str) -> set[tuple[BlockKey, str]]:
        """Every (key, tier) the worker holds (for tests and debugging)."""
        out: set[tuple[BlockKey, str]] = set()
        for key in self._by_worker.get(worker, ()):
            mask = self._holders[key].get(worker, 0)
            out.update((key, tier) for tier in TIERS if mask & _BIT[tier])
        return out

    def entries(self) -> int:
        return self._entries

    def _shrink(self) -> None:
        excess = self._entries - int(self.max_entries * 0.9)
        for key in list(self._holders)[: max(excess, 1)]:
            holders = self._holders.pop(key)
            for worker in holders:
                self._by_worker.get(worker, set()).discard(key)
            self._entries -= len(holders)
            self.dropped += len(holders)


def _cheapest(mask: int) -> str:
    for tier in TIERS:
        if mask & _BIT[tier]:
            return tier
    raise ValueError(mask)


def measure_entry_bytes(blocks: int = 20_000, workers: int = 4) -> float:
    """Bytes one (block, worker) entry costs in the in-memory index, measured with tracemalloc."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = InMemoryKvIndex()
        for w in range(workers):
            index.add(f"http://10.0.0.{w}:8000", range(w * blocks // 2, w * blocks // 2 + blocks), GPU)
        used = tracemalloc.get_traced_memory()[0] - before
        return used / index.entries()
    finally:
        tracemalloc.stop()

