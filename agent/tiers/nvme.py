"""NVMe tier: one file per block in a local directory, under a byte bound, LRU eviction.

Writes are crash-safe: header + payload go to a temp file, which is fsynced (optional) and renamed into place,
so a block file either exists whole or not at all; every read verifies the checksum anyway. On start the index
is rebuilt from the block files (usage = their sizes; LRU order = mtime) and leftover temp files are removed.
A block file deleted or corrupted behind the agent's back is a miss (and leaves the index), never a crash; a
full disk evicts and retries once, then refuses the block.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import uuid
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

from agent.block import (
    HEADER_SIZE,
    BlockError,
    BlockKey,
    ChecksumError,
    checksum,
    decode_header,
    encode_header,
    key_name,
    parse_key_name,
)
from agent.tiers.base import (
    INDEX_ENTRY_FLOOR,
    Buffer,
    DiskSpace,
    HeldBlock,
    RemovalListener,
    Removed,
    StoreItem,
    TierName,
    TierStats,
    TierUsage,
)

log = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# KV blocks are the prompts of every user of the replica: files only the agent's uid reads (the shared directory
# adds its group: the fleet's agents)
FILE_MODE = 0o600
DIR_MODE = 0o700


def write_file_atomically(tmp_dir: Path, final: Path, parts: list[Buffer], fsync: bool, mode: int = FILE_MODE) -> None:
    """temp file + (fsync) + rename: readers see the whole file or none of it."""
    tmp = tmp_dir / f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            total = sum(len(p) for p in parts)
            written = os.writev(fd, parts)
            if written != total:  # short write: finish the rest piece by piece
                rest = memoryview(b"".join(bytes(p) for p in parts))[written:]
                while rest:
                    rest = rest[os.write(fd, rest):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_regular(path: Path) -> int:
    """A read-only descriptor of a regular file, never through a symlink, never waiting (a FIFO planted in a shared
    directory would hang the reading thread); BlockError for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BlockError(f"{path.name} is a symlink") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BlockError(f"{path.name} is not a regular file")
    return fd


def read_block_file(path: Path, key: BlockKey, out: memoryview) -> int:
    """Read and verify a block file into `out` (header, payload and an EOF probe in one preadv); raises
    OSError, BlockError or ChecksumError. Only a regular file is read, never through a symlink, and opening never
    waits (a FIFO planted in a shared directory would hang the reading thread)."""
    header = bytearray(HEADER_SIZE)
    probe = bytearray(1)
    fd = open_regular(path)
    try:
        got = os.preadv(fd, [header, out, probe], 0)
        if got < HEADER_SIZE:
            raise BlockError(f"torn block: {got}-byte file")
        layout_id, length, digest = decode_header(header)
        if layout_id != key[0]:
            raise BlockError(f"layout {layout_id:#x} where {key[0]:#x} was asked for")
        if length > len(out):
            raise BlockError(f"block of {length} bytes does not fit a {len(out)}-byte buffer")
        if got > HEADER_SIZE + length:
            raise BlockError("block file longer than its header says")
        if got < HEADER_SIZE + length:
            # short read (rare for regular files): read the rest, then probe once more for trailing bytes
            while got < HEADER_SIZE + length:
                n = os.preadv(fd, [out[got - HEADER_SIZE: length]], got)
                if n == 0:
                    raise BlockError(f"torn block: {got - HEADER_SIZE} of {length} payload bytes")
                got += n
            if os.pread(fd, 1, got):
                raise BlockError("block file longer than its header says")
    finally:
        os.close(fd)
    view = out[:length]
    if checksum(view) != digest:
        raise ChecksumError(f"checksum mismatch in {path.name}")
    return length


class NvmeTier:
    """`entry_floor`: the tier holds at most capacity // entry_floor blocks (INDEX_ENTRY_FLOOR: each costs the
    agent its index entry in RAM); 0, no bound but the bytes."""

    name = TierName.NVME

    def __init__(self, directory: str | Path, capacity: int, high_watermark: float = 0.95,
                 low_watermark: float = 0.85, fsync: bool = True, min_free: int = 0,
                 entry_floor: int = INDEX_ENTRY_FLOOR) -> None:
        self.root = Path(directory)
        self.blocks_dir = self.root / "blocks"
        self.tmp_dir = self.root / "tmp"
        self.capacity = capacity
        self.max_blocks = max(1, capacity // entry_floor) if entry_floor > 0 else capacity
        self.high_bytes = int(capacity * high_watermark)
        self.low_bytes = int(capacity * low_watermark)
        # the count has the bytes' watermarks too: a tier of small blocks is full by its count long before its bytes,
        # and its blocks must go through background eviction (demoted first) rather than one by one at store time
        self.high_blocks = int(self.max_blocks * high_watermark)
        self.low_blocks = int(self.max_blocks * low_watermark)
        self.fsync = fsync
        self.min_free = min_free
        self._space = DiskSpace(str(self.root), min_free)
        self.stats = TierStats()
        self.on_removed: RemovalListener | None = None
        self._index: OrderedDict[BlockKey, int] = OrderedDict()  # key -> file size
        self._pending: dict[BlockKey, int] = {}  # being written: reserved bytes
        self._used = 0
        self._lock = threading.Lock()
        self._shards: set[str] = set()  # shard directories known to exist
        self.blocks_dir.mkdir(DIR_MODE, parents=True, exist_ok=True)
        self.tmp_dir.mkdir(DIR_MODE, parents=True, exist_ok=True)
        self._rebuild()

    def _path(self, key: BlockKey) -> Path:
        name = key_name(key)
        return self.blocks_dir / name[-2:] / name

    def _rebuild(self) -> None:
        for tmp in self.tmp_dir.iterdir():  # writes a crash interrupted: never renamed, never served
            try:
                tmp.unlink(missing_ok=True)
            except OSError as exc:  # (a directory: unlinking it raised, and the agent did not start)
                log.warning("nvme tier: cannot remove %s: %s", tmp, exc)
        found: list[tuple[int, BlockKey, int]] = []
        for shard in self.blocks_dir.iterdir():
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard):
                if not entry.is_file(follow_symlinks=False):  # no block: left alone (unlinking a directory raised)
                    log.warning("nvme tier: %s is not a regular file: left alone", entry.path)
                    continue
                key = parse_key_name(entry.name)
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if key is None or st.st_size < HEADER_SIZE:
                    os.unlink(entry.path)
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort(key=lambda item: item[0])
        for _mtime, key, size in found:
            self._index[key] = size
            self._used += size
        self._evict_locked(self._used, self.max_blocks)  # (a smaller capacity than the last run's)
        log.info("nvme tier %s: %d blocks, %d bytes after restart", self.root, len(self._index), self._used)

    # -- interface -------------------------------------------------------------------------------------------

    def store(self, key: BlockKey, payload: Buffer, digest: int | None = None) -> bool:
        size = HEADER_SIZE + len(payload)
        if size > self.capacity:
            self.stats.add("refused")
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if key in self._pending:
                return True
            evicted = self._evict_locked(self.capacity - size, self.max_blocks - 1)
            self._pending[key] = size
            self._used += size
        self._report(evicted)
        ok = False
        try:
            ok = self._write(key, payload, size, digest)
        finally:
            with self._lock:
                del self._pending[key]
                if ok:
                    self._index[key] = size
                else:
                    self._used -= size
        self.stats.add("stores" if ok else "refused")
        return ok

    def _write(self, key: BlockKey, payload: Buffer, size: int, digest: int | None) -> bool:
        if self.min_free and not self._space.take(size):
            with self._lock:
                evicted = self._evict_locked(self._used - size)
            self._report(evicted)
            if not self._space.take(size):
                return False
        header = encode_header(key[0], len(payload), checksum(payload) if digest is None else digest)
        final = self._path(key)
        for attempt in range(2):
            try:
                if final.parent.name not in self._shards:
                    final.parent.mkdir(DIR_MODE, exist_ok=True)
                    self._shards.add(final.parent.name)
                write_file_atomically(self.tmp_dir, final, [header, payload], self.fsync)
                return True
            except FileNotFoundError:  # the shard directory was removed behind our back: recreate it once
                self._shards.discard(final.parent.name)
                if attempt:
                    self.stats.add("backend_errors")
                    return False
            except OSError as exc:
                if exc.errno not in _FULL:
                    log.warning("nvme tier: cannot write %s: %s", final.name, exc)
                    self.stats.add("backend_errors")
                    return False
                self.stats.add("backend_errors")
                if attempt == 0:  # disk full: make room once, then give up on this block
                    with self._lock:
                        evicted = self._evict_locked(max(0, self._used - 2 * size))
                    self._report(evicted)
        return False

    def store_many(self, items: Sequence[StoreItem]) -> int:
        return sum(self.store(item.key, item.payload, item.digest) for item in items)

    def read_into(self, key: BlockKey, out: memoryview, touch: bool = True) -> int | None:
        with self._lock:
            size = self._index.get(key)
            if size is None or size - HEADER_SIZE > len(out):  # absent, or the caller's buffer is too small
                missing = True
            else:
                missing = False
                if touch:
                    self._index.move_to_end(key)
        if missing:
            self.stats.add("misses")
            return None
        path = self._path(key)
        try:
            length = read_block_file(path, key, out)
        except FileNotFoundError:
            self.stats.add("misses")
            self._forget(key, unlink=False)
            return None
        except ChecksumError as exc:
            log.warning("nvme tier: %s", exc)
            self.stats.add("checksum_failures")
            self.stats.add("misses")
            self._forget(key, unlink=True)
            return None
        except (BlockError, OSError) as exc:
            log.warning("nvme tier: unreadable block %s: %s", path.name, exc)
            self.stats.add("read_errors")
            self.stats.add("misses")
            self._forget(key, unlink=True)
            return None
        self.stats.add("hits")
        return length

    def read_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview], touch: bool = True) -> list[int | None]:
        return [self.read_into(key, out, touch) for key, out in zip(keys, outs, strict=True)]

    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def held(self, key: BlockKey) -> HeldBlock | None:
        return None

    def touch(self, keys: Sequence[BlockKey]) -> None:
        pass  # reads keep the LRU order

    def delete(self, key: BlockKey) -> bool:
        return self._forget(key, unlink=True)

    def upkeep(self) -> None:
        pass  # a block file deleted behind our back is noticed when it is read

    def close(self) -> None:
        pass

    def usage(self) -> TierUsage:
        return TierUsage(self._used, len(self._index), self.capacity)

    def block_keys(self) -> Iterable[BlockKey]:
        with self._lock:
            return list(self._index)

    # -- pressure --------------------------------------------------------------------------------------------

    def above_high_watermark(self) -> bool:
        return self._used > self.high_bytes or len(self._index) > self.high_blocks

    def evict_to_low_watermark(self, offered: Collection[BlockKey] | None = None) -> None:
        """The least recently used blocks, down to the low watermarks; given `offered`, only while the least
        recently used is one of them (one stored or read since is not)."""
        with self._lock:
            evicted = self._evict_locked(self.low_bytes, self.low_blocks, offered)
        self._report(evicted)

    def demotion_candidates(self) -> list[tuple[BlockKey, int]]:
        """The least recently used blocks, down to the low watermarks."""
        with self._lock:
            out: list[tuple[BlockKey, int]] = []
            total = 0
            excess = self._used - self.low_bytes
            excess_blocks = len(self._index) - self.low_blocks
            for key, size in self._index.items():
                if total >= excess and len(out) >= excess_blocks:
                    break
                out.append((key, size - HEADER_SIZE))
                total += size
            return out

    def _evict_locked(self, target: int, blocks: int | None = None,
                      offered: Collection[BlockKey] | None = None) -> list[Removed]:
        """Drop least recently used blocks until usage <= target (and the blocks held and being written number
        `blocks` at most), stopping at the first not `offered` if given; the caller reports them (outside the
        lock)."""
        evicted: list[Removed] = []
        most = len(self._index) + len(self._pending) if blocks is None else blocks
        while (self._used > target or len(self._index) + len(self._pending) > most) and self._index:
            key = next(iter(self._index))
            if offered is not None and key not in offered:
                break
            size = self._index.pop(key)
            self._used -= size
            try:
                self._path(key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("nvme tier: cannot delete %s: %s", key_name(key), exc)
            evicted.append(Removed(key))
        if evicted:
            self.stats.add("evictions", len(evicted))
        return evicted

    def _forget(self, key: BlockKey, unlink: bool) -> bool:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
        if unlink:
            self._path(key).unlink(missing_ok=True)
        if size is None:
            return False
        self._report([Removed(key)])
        return True

    def _report(self, removed: list[Removed]) -> None:
        if removed and self.on_removed is not None:
            self.on_removed(removed)
