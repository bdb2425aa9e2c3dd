"""The one interface every tier offers, the tiers' names, and the counters each keeps for metrics.

A tier is a bounded key -> bytes store for KV blocks on one medium: `store_many` (a chain, written together where
the medium allows), `read_many` (into a caller's buffers, so a block can go from a file or DRAM straight into
shared memory), `contains` (local state only), `delete`, `usage`, and the pressure hooks the store's upkeep
drives (watermarks, eviction candidates). Reads from media outside this process verify the block's checksum; a
block that fails is deleted and reported as a miss. Every block that leaves a tier, for whatever reason
(eviction, expiry, corruption, deletion behind the agent's back, `delete`), is reported to the tier's
`on_removed` listener -- the one way the store hears of removals.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

from agent.block import BlockKey, checksum
from kvcore.kv_events import CPU, DISK, SHARED

Buffer = bytes | bytearray | memoryview


class TierName(StrEnum):
    """The agent's tiers, top to bottom, spelled once: metric labels, stats, logs, benchmark rows. `medium` is the
    tier's name in KV events, `code` its letter in a lookup answer (agent/protocol.py's `where`)."""

    DRAM = "dram"
    NVME = "nvme"
    SHARED = "shared"

    @property
    def medium(self) -> str:
        return _MEDIUM[self]

    @property
    def code(self) -> str:
        return _CODE[self]

    @classmethod
    def from_code(cls, code: str) -> TierName:
        return _BY_CODE[code]


_MEDIUM = {TierName.DRAM: CPU, TierName.NVME: DISK, TierName.SHARED: SHARED}
_CODE = {TierName.DRAM: "C", TierName.NVME: "D", TierName.SHARED: "S"}
_BY_CODE = {code: name for name, code in _CODE.items()}


class StoreItem(NamedTuple):
    """One block to store: a chain is a sequence of these, each block's parent the one before it."""

    key: BlockKey
    payload: Buffer
    digest: int | None = None  # the payload's checksum, when already known
    parent: BlockKey | None = None  # the previous block of the same prefix (the DRAM tier keeps prefix order)


@dataclass(slots=True)
class HeldBlock:
    """A block whose bytes this process holds in memory (the DRAM tier's own copy): lower tiers take them from
    here without another copy, and the checksum is computed once, when a block first leaves for a medium."""

    data: bytearray
    parent: BlockKey | None
    digest: int | None = None

    def checksum(self) -> int:
        if self.digest is None:
            self.digest = checksum(self.data)
        return self.digest

    def item(self, key: BlockKey) -> StoreItem:
        return StoreItem(key, self.data, self.checksum(), self.parent)


class Removed(NamedTuple):
    """A block that left a tier. `block` is set when a tier pushed it out to make room and still had its bytes in
    memory (the DRAM tier): then it can still move down."""

    key: BlockKey
    block: HeldBlock | None = None


# told of every block a tier lost, in batches; may be called with the tier's lock held: it must not call back
# into that tier
RemovalListener = Callable[[list[Removed]], None]


@dataclass
class TierStats:
    """Monotonic counters of one tier, read by the metrics collector at scrape time."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    refused: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    read_errors: int = 0
    backend_errors: int = 0
    dropped_announcements: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int
    blocks: int
    capacity_bytes: int


class Tier(Protocol):
    name: TierName
    stats: TierStats
    on_removed: RemovalListener | None

    def store(self, key: BlockKey, payload: Buffer, digest: int | None = None) -> bool:
        """Keep one block; False when it cannot be admitted (too big, medium full, backend down)."""
        ...

    def store_many(self, items: Sequence[StoreItem]) -> int:
        """Keep blocks (one write per chain where the medium allows); how many of them are held afterwards."""
        ...

    def read_into(self, key: BlockKey, out: memoryview, touch: bool = True) -> int | None:
        """Copy one block's payload into `out`; its length, or None on a miss (or a bad / unreadable block).
        `touch=False`: a read that is not a use (a demotion), which leaves the tier's use order as it is."""
        ...

    def read_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview], touch: bool = True) -> list[int | None]:
        """`read_into` for a run of blocks (one read / one round trip where the medium allows)."""
        ...

    def contains(self, key: BlockKey) -> bool:
        """Answered from local state only: no I/O."""
        ...

    def held(self, key: BlockKey) -> HeldBlock | None:
        """The block's bytes if this tier holds them in this process's memory, without a copy; else None."""
        ...

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """A chain of blocks was used (stored or loaded): keep it, parents longest, where the tier orders by use."""
        ...

    def delete(self, key: BlockKey) -> bool: ...

    def usage(self) -> TierUsage: ...

    def block_keys(self) -> Iterable[BlockKey]: ...

    def above_high_watermark(self) -> bool: ...

    def evict_to_low_watermark(self, offered: Collection[BlockKey] | None = None) -> None:
        """Make room down to the low watermark; what goes is reported to `on_removed`. `offered`: the keys
        `demotion_candidates` gave (copied down since): only those may go, the eviction stops short of the
        watermark rather than drop another (a store or a hit since can change what it would drop; the next round
        offers the rest); None: any block. A memory tier's eviction hands the bytes over: it ignores `offered`."""
        ...

    def demotion_candidates(self) -> list[tuple[BlockKey, int]]:
        """(key, payload bytes) of the blocks `evict_to_low_watermark` would drop now whose bytes the eviction
        cannot hand over (they are on a medium): a lazy store copies them down first, then passes their keys to
        the eviction. None for a memory tier."""
        ...

    def upkeep(self) -> None:
        """Periodic checks off the request path (e.g. segment files deleted behind the agent's back)."""
        ...

    def close(self) -> None: ...


# An NVMe tier holds at most capacity // INDEX_ENTRY_FLOOR blocks, whatever their size (the oldest go first, as when
# its bytes are full): each block costs the agent RAM for its index entry, which the disk bytes the capacity bounds
# do not count. tracemalloc over 100,000-200,000 empty blocks stored into the tier: segments 286 bytes an entry (int
# hashes, the connector's) to 343 (64-byte hashes, the longest a request may name), files 211-267; a real agent's RSS
# grew 407 (segments) and 343 (files) bytes per empty block. Unbounded, a 16 GiB tier of empty blocks (48-byte
# records, 32-byte files: 358-537 million) would take 100-150 GB of agent; bounded, its index takes about a third of
# the capacity at most (16 GiB: 16.8 million entries, 4.8-5.8 GB), and for vLLM's blocks (16 KiB and up), or any of
# 1 KiB and up (the tests' 1,000-byte payloads with their header), nothing changes.
INDEX_ENTRY_FLOOR = 1024


class DiskSpace:
    """Whether a directory's file system can take `size` more bytes and still keep `min_free` free: statvfs at
    most every 0.5 s, debited by our own writes in between; a refusal looks again next time."""

    def __init__(self, root: str, min_free: int) -> None:
        self.root = root
        self.min_free = min_free
        self._free = 0
        self._checked = 0.0

    def take(self, size: int) -> bool:
        now = time.monotonic()
        if now - self._checked > 0.5:
            try:
                st = os.statvfs(self.root)
            except OSError:
                return False
            self._free, self._checked = st.f_bavail * st.f_frsize, now
        if self._free < self.min_free + size:
            self._checked = 0.0  # space may have been freed: look again next time
            return False
        self._free -= size
        return True
