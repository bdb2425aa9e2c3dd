"""Which blocks a tier agent may hold, as a bitmap in a file next to its socket that the vLLM connector's scheduler
maps read-only: a lookup whose first block's bit is clear is answered "none" without a round trip to the agent.

The agent sets a block's bit before the block can be held (before a store copies it in; for blocks found on a
medium at start, before it serves anyone) and never clears one, so a clear bit proves the agent does not hold the
block, and then it holds no run starting there either. A set bit proves nothing (the block may be gone, or another
block shares the bit): such a lookup goes to the agent as before. So the bitmap only saves round trips, it never
makes an answer wrong -- at worst a block stored an instant after the bit was read is a miss, which the same lookup
sent an instant earlier would have been too. An agent with a shared tier publishes no bitmap: other replicas put
blocks there that it learns of only when it is asked (or scans), so only it can answer.

A new file replaces the old one (renamed over it) whenever an agent starts, so a reader that sees another inode at
the path maps the new one; a reader that finds no file asks the agent.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
from collections.abc import Iterable
from pathlib import Path

from agent.protocol import BlockHash

MAGIC = b"kvgbits1"
HEADER = struct.Struct("<8sQ")  # magic, log2 of the number of bits
DEFAULT_BITS_LOG2 = 27  # 2**27 bits, a 16 MiB file: 1% of bits set after 1.3 M distinct blocks stored
_MASK64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15


def presence_path(socket_path: str | Path) -> Path:
    return Path(f"{socket_path}.presence")


def _bit(layout: int, block_hash: BlockHash, bits_log2: int) -> int:
    """Fibonacci hashing of hash and layout: one multiply (vLLM's block hashes are uniform already; the multiply
    spreads small test hashes too)."""
    if isinstance(block_hash, bytes):
        block_hash = int.from_bytes(hashlib.blake2b(block_hash, digest_size=8).digest(), "little")
    return (((block_hash ^ layout) * _MIX) & _MASK64) >> (64 - bits_log2)


class PresenceMap:
    """The agent's side: creates the file (atomically, with the bits of `known` set) and sets bits."""

    def __init__(self, path: str | Path, known: Iterable[tuple[int, BlockHash]] = (),
                 bits_log2: int = DEFAULT_BITS_LOG2, mode: int = 0o600) -> None:
        self.path = Path(path)
        self.bits_log2 = bits_log2
        self._lock = threading.Lock()  # bits are set byte by byte (read, or, write): two writers could lose one
        size = HEADER.size + (1 << bits_log2) // 8
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, mode)  # (the umask does not apply): which blocks exist is for the agent's users only
            self._allocate(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        try:
            self._map = mmap.mmap(fd, size)
            self._ident = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        finally:
            os.close(fd)
        self._map[: HEADER.size] = HEADER.pack(MAGIC, bits_log2)
        self.add(known)
        os.replace(tmp, self.path)  # readers see a whole map or the previous one, never a part

    @staticmethod
    def _allocate(fd: int, size: int) -> None:
        """Allocated now, not sparse: a page first written on a full filesystem would be SIGBUS, not an error."""
        os.posix_fallocate(fd, 0, size)

    def add(self, keys: Iterable[tuple[int, BlockHash]]) -> None:
        m, base, log2 = self._map, HEADER.size, self.bits_log2
        bits = [_bit(layout, block_hash, log2) for layout, block_hash in keys]
        with self._lock:
            for i in bits:
                m[base + (i >> 3)] |= 1 << (i & 7)

    def close(self) -> None:
        """Remove the file if it is still ours (a newer agent's may have replaced it), so no reader trusts bits
        nobody sets any more."""
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._ident:
                os.unlink(self.path)
        except OSError:
            pass
        self._map.close()


class PresenceReader:
    """The scheduler's side: `may_hold(layout, hash)` False proves the agent does not hold the block; True (or no
    bitmap published) says ask the agent. Follows the file across agent restarts (checked at every call)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        self._ident: tuple[int, int] | None = None
        self._bits_log2 = 0

    def _current(self) -> mmap.mmap | None:
        try:
            st = os.stat(self.path)
        except OSError:
            self._drop()
            return None
        ident = (st.st_dev, st.st_ino)
        if ident != self._ident:
            self._drop()
            try:
                with open(self.path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                return None
            if len(m) < HEADER.size:
                m.close()
                return None
            magic, log2 = HEADER.unpack(m[: HEADER.size])
            if magic != MAGIC or not 3 <= log2 <= 40 or len(m) < HEADER.size + (1 << log2) // 8:
                m.close()
                return None
            self._map, self._ident, self._bits_log2 = m, ident, log2
        return self._map

    def may_hold(self, layout: int, block_hash: BlockHash) -> bool:
        m = self._current()
        if m is None:
            return True
        i = _bit(layout, block_hash, self._bits_log2)
        return bool(m[HEADER.size + (i >> 3)] & (1 << (i & 7)))

    def _drop(self) -> None:
        if self._map is not None:
            self._map.close()
        self._map, self._ident = None, None

    def close(self) -> None:
        self._drop()
