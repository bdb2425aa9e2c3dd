"""The one interface every tier offers, and the counters each keeps for metrics.

A tier is a bounded key -> bytes store for KV blocks: `store`, `read_into` (load into a caller's buffer, so a
block can go from a file or DRAM straight into shared memory), `contains`, `delete`, `usage`. Reads from media
outside this process verify the block's checksum; a block that fails is deleted and reported as a miss.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from agent.block import BlockKey

Buffer = bytes | bytearray | memoryview


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
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int
    blocks: int
    capacity_bytes: int


# called with the key of every block a tier drops by itself (eviction, corruption, external deletion)
RemovalListener = Callable[[BlockKey], None]


class Tier(Protocol):
    name: str  # "dram", "nvme", "shared"
    medium: str  # KV-event medium: "CPU", "DISK", "SHARED"
    stats: TierStats

    def store(self, key: BlockKey, payload: Buffer, digest: int | None = None) -> bool:
        """Keep a block; False when it cannot be admitted (too big, medium full, backend down)."""
        ...

    def read_into(self, key: BlockKey, out: memoryview) -> int | None:
        """Copy the block's payload into `out`; its length, or None on a miss (or a bad / unreadable block)."""
        ...

    def contains(self, key: BlockKey) -> bool:
        """Answered from local state only: no I/O."""
        ...

    def delete(self, key: BlockKey) -> bool: ...

    def usage(self) -> TierUsage: ...

    def block_keys(self) -> Iterable[BlockKey]: ...


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
