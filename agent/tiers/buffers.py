"""The DRAM tier's block buffers: recycled when a block leaves, optionally pre-faulted at start.

Why: a store into a fresh buffer pays the kernel's page faults on every page it writes (on this VM 17-150 us per
16 KiB block against 5 us on memory touched before, docs/agent.md), and a tier that is still filling -- or whose
blocks are big enough for malloc to map and unmap each one -- stores every block into fresh memory. Here a block
that leaves the tier hands its buffer back, and the next block of the same size is copied into it; `prefault`
fills the pool ahead of the stores with buffers whose pages are already mapped.

A buffer is reused only once nothing else refers to it: a block pushed out of the tier is still read afterwards
(demoted to NVMe, written through, its checksum computed then), by whoever holds the block, a `StoreItem` or a
memoryview of its bytes -- each of which is a reference to the buffer (a memoryview, and a C reader's buffer
export, keep their object alive). So a returned buffer waits until its reference count says it is the pool's
alone; until then it is its reader's, as an evicted block's bytes always were. The bound holds for what the
tier keeps: free + resident bytes <= capacity (pre-faulting stops short of it by the returned bytes too), checked
when evicted blocks have been handed over (`settle`); a buffer whose reader finished later waits in the queue
until the next settle or store looks at it. So a tier whose stores evict on the spot (full, faster than its
upkeep brings it down to the low watermark) cannot recycle the buffer a store evicts (still in hand) and allocates
as before; one kept under its high watermark by upkeep stores into the buffers upkeep's evictions freed.
Not thread-safe: the DRAM tier calls it under its own lock.
"""

from __future__ import annotations

import ctypes
import sys
from collections import deque
from typing import NamedTuple

PAGE = 4096
RECLAIM_CHECKS = 64  # returned buffers looked at per reclaim: a long queue of buffers still being read is not
                     # rescanned whole on every store


def _references_when_alone() -> int:
    """What `sys.getrefcount` says, in `_reclaim`'s code path, of a buffer nothing else refers to."""
    returned: deque[bytearray] = deque([bytearray(1)])
    buf = returned.popleft()
    return sys.getrefcount(buf)


_ALONE = _references_when_alone()


_resize = ctypes.pythonapi.PyByteArray_Resize
_resize.argtypes = (ctypes.py_object, ctypes.c_ssize_t)
_resize.restype = ctypes.c_int


def unfilled(size: int) -> bytearray:
    """A bytearray of `size` bytes, contents undefined, whose pages are not written yet. `bytearray(size)` zeroes
    every byte itself: one memset with the GIL held, which faults in every page of a fresh allocation (a 2 MiB block
    ~0.4-1 ms; a 16 GiB pre-fault, seconds during which the agent's loop and copy threads waited for the GIL: DRAM
    loads on an H200 host 0.4-2.8 GB/s instead of 10-13). Here the pages are faulted by whoever writes them first:
    `touch`, or the copy of a block into it (large ones on the copier's threads, the GIL released)."""
    buf = bytearray()
    if size > 0:
        _resize(buf, size)  # PyByteArray_Resize: realloc, no memset (MemoryError raised by ctypes on failure)
    return buf


def touch(buf: bytearray) -> None:
    """Write every page of `buf` (a write, not a read: a read maps the shared zero page), so the kernel maps them
    now and a later copy into it faults on none; a foreign call, so the GIL is released meanwhile."""
    if buf:
        anchor = ctypes.c_char.from_buffer(buf)  # holds the export: `buf` cannot be resized under the memset
        ctypes.memset(ctypes.addressof(anchor), 0, len(buf))
        del anchor


class BufferStats(NamedTuple):
    free_bytes: int  # ready for the next stores
    returned_bytes: int  # of blocks that left the tier, reused once nothing reads them
    reused: int  # stores that copied into a recycled or pre-faulted buffer
    new: int  # stores that needed a new buffer (its pages faulted by the copy)


class BlockBuffers:
    """Free buffers by size, and the buffers returned by blocks that left the tier (reused once unreferenced)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free_bytes = 0
        self.returned_bytes = 0
        self.reused = 0
        self.new = 0
        self.reclaim_checks = 0  # returned buffers looked at by `take` (each a refcount check)
        self._free: dict[int, list[bytearray]] = {}
        self._returned: deque[bytearray] = deque()
        # returned since the last `settle`: the blocks they belonged to are still in the hands of whoever removed
        # them (a store's evictions, until they are reported), so no `take` looks at them before `settle` does --
        # in a full tier of small blocks, each store's `take` rescanned up to RECLAIM_CHECKS of them in vain, 40%
        # of a 16 KiB block's store
        self._unsettled: list[bytearray] = []

    def take(self, size: int, resident: int) -> bytearray:
        """A buffer of `size` bytes (contents undefined) that nothing else refers to, for a block about to be
        stored; `resident`: the tier's bytes, room for this block made already. A new one only where no free or
        reclaimable one fits, after letting free buffers of other sizes go as far as the bound needs."""
        stack = self._free.get(size)
        if not stack and self._returned:
            self._reclaim(size, resident)
            stack = self._free.get(size)
        if stack:
            self.free_bytes -= size
            self.reused += 1
            return stack.pop()
        self._let_go(self.capacity - resident - size)
        self.new += 1
        return unfilled(size)

    def stats(self) -> BufferStats:
        return BufferStats(self.free_bytes, self.returned_bytes, self.reused, self.new)

    def give_back(self, buf: bytearray) -> None:
        """A block left the tier (its bytes no longer resident): its buffer is reused once no one reads it."""
        self._unsettled.append(buf)
        self.returned_bytes += len(buf)

    def room(self, size: int, resident: int) -> bool:
        """Whether one more free buffer of `size` keeps what the pool holds plus `resident` within the capacity."""
        return self.free_bytes + self.returned_bytes + size + resident <= self.capacity

    def add_free(self, buf: bytearray) -> None:
        """A buffer nothing else refers to (pre-faulted) joins the free ones; the caller checked `room`."""
        self._free.setdefault(len(buf), []).append(buf)
        self.free_bytes += len(buf)

    def _reclaim(self, size: int | None, resident: int) -> None:
        """Free the returned buffers nothing refers to any more, the oldest first, until one of `size` is free or a
        bounded number were looked at; those still read go to the back of the queue, one the bound has no room for
        goes to the allocator."""
        returned = self._returned
        checks = min(RECLAIM_CHECKS, len(returned))
        self.reclaim_checks += checks
        for _ in range(checks):
            buf = returned.popleft()
            if sys.getrefcount(buf) > _ALONE:
                returned.append(buf)  # still read (a demotion, a write-through, a view of its bytes)
                continue
            if self._release(buf, resident) and len(buf) == size:
                return

    def _release(self, buf: bytearray, resident: int) -> bool:
        """A returned buffer nothing reads any more leaves the returned ones: free where the bound has room (True),
        else to the allocator."""
        n = len(buf)
        self.returned_bytes -= n
        if self.free_bytes + n + resident > self.capacity:
            return False
        self._free.setdefault(n, []).append(buf)
        self.free_bytes += n
        return True

    def settle(self, recent: int, resident: int) -> None:
        """The last `recent` returned buffers were just handed to whoever reads evicted blocks, and that is done:
        those nobody reads now are free, or go to the allocator where the bound has no room (free + resident <=
        capacity), so what the tier keeps idle stays within it; the rest stay in transit, their readers' memory."""
        returned = self._returned
        returned.extend(self._unsettled)
        self._unsettled.clear()
        still_read = []
        for _ in range(min(recent, len(returned))):
            buf = returned.pop()
            if sys.getrefcount(buf) > _ALONE:
                still_read.append(buf)
                continue
            self._release(buf, resident)
        returned.extend(reversed(still_read))
        if returned:  # and the oldest: buffers whose readers (demotions) finished since
            self._reclaim(None, resident)

    def _let_go(self, budget: int) -> None:
        """Let free buffers go to the allocator until at most `budget` bytes are free."""
        for size in list(self._free):
            stack = self._free[size]
            while stack and self.free_bytes > budget:
                stack.pop()
                self.free_bytes -= size
            if not stack:
                del self._free[size]
