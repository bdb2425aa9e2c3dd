"""NVMe tier as an append-only segment log: blocks are records appended to large segment files.

Why not one file per block: creating a file costs ~0.5 ms on the disks measured here, 15x the time to write a
64 KiB block sequentially, so file-per-block (the `files` layout, agent/tiers/nvme.py) cannot come near raw disk
speed for KV-sized blocks. Appending records to a segment is a sequential write; space is reclaimed a segment
at a time (the oldest segment is dropped whole -- FIFO eviction, the shape of CacheLib's block cache regions);
the upkeep's eviction first appends again the blocks read since they were written (CacheLib's reinsertion), so a
hot block does not go with its old segment.

A record is `header (32 B) + key + meta digest (8 B) + payload`. The header's payload checksum covers the payload;
the meta digest covers header and key, so neither a corrupt payload nor a corrupt key can ever be served.
Crash safety: an index entry exists only after its record is completely written; on restart each segment is
scanned record by record (headers only) and the scan of a segment stops at the first record that does not
check out (a torn tail after a crash), so what is indexed is whole; payloads are verified on every read.
Usage is the sum of segment file sizes (what the disk holds, dead records included), right after a restart too.
A long run of blocks (8 MiB and up) is read and checked in parts on the agent's copy threads (`preadv` and xxh3
release the GIL): one thread's `preadv` and checksum held loads to 3-4 GB/s on an H200 host.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import xxhash

from agent.block import HEADER, HEADER_SIZE, MAGIC, VERSION, BlockError, BlockKey, ChecksumError, checksum
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
from agent.tiers.buffers import unfilled
from agent.tiers.copies import ParallelCopier
from agent.tiers.nvme import DIR_MODE, FILE_MODE

log = logging.getLogger(__name__)

T = TypeVar("T")
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class _ReserveReached(OSError):
    """Writing would eat into `min_free`: refused like a full disk, but nothing failed."""

_BYTES_KEY = 0x8000  # header flag: the key is bytes (else a 64-bit int); low bits hold the key length
_META = struct.Struct("<Q")


def _key_bytes(key: BlockKey) -> tuple[bytes, int]:
    block_hash = key[1]
    if isinstance(block_hash, int):
        return block_hash.to_bytes(8, "big"), 8
    return bytes(block_hash), _BYTES_KEY | len(block_hash)


def _meta_digest(header: bytes | bytearray | memoryview, key: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(bytes(header) + bytes(key))


def _find_magic(fd: int, start: int, size: int, chunk: int = 1 << 20) -> int | None:
    """Offset of the next record magic at or after `start`, or None."""
    position = start
    while position < size:
        data = os.pread(fd, chunk + len(MAGIC) - 1, position)
        if not data:
            return None
        found = data.find(MAGIC)
        if found >= 0:
            return position + found
        position += chunk
    return None


@dataclass(slots=True)
class _Segment:
    seg_id: int
    path: str
    size: int = 0
    records: int = 0  # appended or reserved, dead ones included: what bounds its index entries
    keys: set[BlockKey] = field(default_factory=set)
    write_fd: int | None = None
    sealed: bool = False
    inflight: int = 0  # writes reserved here and not finished: the fd stays open, the segment stays
    read_fd: int | None = None
    readers: int = 0  # reads in progress: the read fd is closed by the last one once the segment is dropped
    dropped: bool = False
    hot: set[BlockKey] = field(default_factory=set)  # blocks read since they were written here


@dataclass(slots=True)
class _Record:
    key: BlockKey
    parts: list[Buffer]
    size: int
    meta_end: int
    length: int


_MAX_GROUP = 200  # records per write: 4 iovecs each, under IOV_MAX (1024)
_VERIFY_NEWEST = 2  # segments whose payloads are checked on restart
# bytes read by one preadv: small enough that the checksum pass that follows still finds them in the CPU cache
_READ_GROUP_BYTES = 1 << 20
# bytes read by one thread at least when a long run is read on several: about 1 ms of preadv and checksum
_READ_PART_BYTES = 8 << 20


@dataclass(slots=True)
class _Location:
    seg_id: int
    offset: int  # of the record
    payload_offset: int  # from the record start
    length: int  # payload bytes


@dataclass(slots=True)
class _Read:
    """One preadv: records lying back to back in one segment, for keys[first:first + len(locs)]; a reader of the
    segment is held for it (its fd stays open)."""

    segment: _Segment
    first: int
    locs: list[_Location]
    size: int  # payload bytes


def _parts(sizes: Sequence[int], threads: int, part_bytes: int) -> list[range]:
    """Consecutive items of these byte sizes cut, in order, into at most `threads` parts of about equal bytes,
    each at least `part_bytes` (a smaller part costs more to hand over than it saves); an item is never cut."""
    total = sum(sizes)
    shares = min(threads, max(1, total // max(1, part_bytes)))
    if shares == 1:
        return [range(len(sizes))]
    per_share = -(-total // shares)
    parts: list[range] = []
    start = filled = 0
    for i, size in enumerate(sizes):
        if i > start and filled >= per_share * (len(parts) + 1):
            parts.append(range(start, i))
            start = i
        filled += size
    parts.append(range(start, len(sizes)))
    return parts


def _check(key: BlockKey, loc: _Location, meta: bytearray, payload: memoryview, whole: bool) -> BlockError | None:
    """What is wrong with a record read back: torn, not this key's record, a payload that fails its checksum;
    None if nothing."""
    if not whole:
        return BlockError("torn or unreadable record")
    _magic, _version, _flags, layout_id, length, digest = HEADER.unpack_from(meta)
    # (the meta digest was checked when the record was indexed; what matters now is that this is the record of
    # this key, whole, with a payload that matches its checksum)
    if (layout_id != key[0] or length != loc.length
            or memoryview(meta)[HEADER_SIZE: loc.payload_offset - 8] != _key_bytes(key)[0]):
        return BlockError("record header does not match the index")
    if checksum(payload) != digest:
        return ChecksumError("payload checksum mismatch")
    return None


class SegmentNvmeTier:
    """`entry_floor`: the tier holds at most capacity // entry_floor blocks (INDEX_ENTRY_FLOOR: each costs the
    agent its index entry in RAM), a segment an eighth of them at most; 0, no bound but the bytes."""

    name = TierName.NVME

    def __init__(self, directory: str | Path, capacity: int, high_watermark: float = 0.95,
                 low_watermark: float = 0.85, fsync: bool = True, min_free: int = 0,
                 segment_bytes: int = 64 * 2**20, copier: ParallelCopier | None = None,
                 read_part_bytes: int = _READ_PART_BYTES, entry_floor: int = INDEX_ENTRY_FLOOR) -> None:
        self.root = Path(directory)
        self.seg_dir = self.root / "segments"
        self.capacity = capacity
        self.high_bytes = int(capacity * high_watermark)
        self.low_bytes = int(capacity * low_watermark)
        self.fsync = fsync
        self.min_free = min_free
        self._space = DiskSpace(str(self.root), min_free)
        # at least 8 segments in the bound, so dropping one frees a small part of the tier
        self.segment_bytes = max(1024, min(segment_bytes, capacity // 8))
        self.max_blocks = max(1, capacity // entry_floor) if entry_floor > 0 else capacity
        # a segment of tiny records is sealed by its count, so dropping one still frees a small part of the bound
        self.segment_records = max(1, self.max_blocks // 8)
        # the count has the bytes' watermarks too: a tier of small blocks is full by its count long before its bytes,
        # and its blocks must go through background eviction (demoted first) rather than one by one at store time
        self.high_blocks = int(self.max_blocks * high_watermark)
        self.low_blocks = int(self.max_blocks * low_watermark)
        self.stats = TierStats()
        self.on_removed: RemovalListener | None = None
        self._index: dict[BlockKey, _Location] = {}
        self._segments: OrderedDict[int, _Segment] = OrderedDict()  # oldest first
        self._active: _Segment | None = None
        self._pending: set[BlockKey] = set()
        self._used = 0
        self._lock = threading.Lock()
        # long runs of reads are split over its threads (agent/tiers/copies.py); None: read on the caller's
        self._copier = copier
        self.read_part_bytes = read_part_bytes
        self.seg_dir.mkdir(DIR_MODE, parents=True, exist_ok=True)
        self._next_id = 1
        self._rebuild()
        self._next_id = max(self._next_id, max(self._segments, default=0) + 1)
        self._evict_blocks_locked(self.max_blocks)  # (a smaller capacity than the last run's)

    # -- restart ---------------------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        ids = []
        for entry in os.scandir(self.seg_dir):
            stem, dot, ext = entry.name.partition(".")
            if dot and ext == "seg" and len(stem) == 16:
                if not entry.is_file(follow_symlinks=False):  # opening a FIFO waited forever: the agent never started
                    log.warning("nvme segments: %s is not a regular file: left alone", entry.path)
                    with contextlib.suppress(ValueError):  # (its name is not one a new segment may take)
                        self._next_id = max(self._next_id, int(stem, 16) + 1)
                    continue
                try:
                    ids.append(int(stem, 16))
                except ValueError:
                    continue
        dropped = 0
        ids.sort()
        # the newest segments are the ones a crash can have caught mid-append (with several writers, a torn
        # record may sit between whole ones): their payloads are checked now, the others' on first read
        recent = set(ids[-_VERIFY_NEWEST:])
        for seg_id in ids:
            segment = _Segment(seg_id, str(self.seg_dir / f"{seg_id:016x}.seg"), sealed=True)
            try:
                segment.size = os.stat(segment.path).st_size
                dropped += self._scan(segment, verify=seg_id in recent)
            except OSError as exc:
                log.warning("nvme segments: cannot scan %s: %s", segment.path, exc)
            self._segments[seg_id] = segment
            self._used += segment.size
        log.info("nvme tier %s: %d blocks in %d segments, %d bytes after restart (%d bad spots skipped)",
                 self.root, len(self._index), len(self._segments), self._used, dropped)

    def _scan(self, segment: _Segment, verify: bool = False) -> int:
        """Index the whole records of a segment; the number of bad spots skipped.

        Concurrent appends can leave a hole (a later record written, an earlier one not, then a crash), so at a
        record that does not check out the scan resynchronises on the next record magic whose header and key
        pass the meta digest (a false match needs a 64-bit digest collision)."""
        fd = os.open(segment.path, os.O_RDONLY)
        bad = 0
        try:
            offset = 0
            while offset < segment.size:
                parsed = self._parse_record(fd, offset, segment.size)
                if parsed is not None and verify:
                    payload = os.pread(fd, parsed[2], offset + parsed[1])
                    if len(payload) != parsed[2] or checksum(payload) != parsed[3]:
                        parsed = None  # a torn record: header written, payload not (all of it)
                if parsed is None:
                    bad += 1
                    found = _find_magic(fd, offset + 1, segment.size)
                    if found is None:
                        break
                    offset = found
                    continue
                key, meta_end, length, _digest = parsed
                previous = self._index.get(key)
                if previous is not None:  # written again later: the newer record wins
                    owner = segment if previous.seg_id == segment.seg_id else self._segments.get(previous.seg_id)
                    if owner is not None:
                        owner.keys.discard(key)
                self._index[key] = _Location(segment.seg_id, offset, meta_end, length)
                segment.keys.add(key)
                segment.records += 1
                offset += meta_end + length
            return bad
        finally:
            os.close(fd)

    @staticmethod
    def _parse_record(fd: int, offset: int, size: int) -> tuple[BlockKey, int, int, int] | None:
        """(key, payload offset in the record, payload length, payload checksum) of a record whose header and
        key check out."""
        head = os.pread(fd, HEADER_SIZE + 64 + 8, offset)
        if len(head) < HEADER_SIZE:
            return None
        magic, version, flags, layout_id, length, digest = HEADER.unpack_from(head)
        klen = flags & ~_BYTES_KEY
        meta_end = HEADER_SIZE + klen + 8
        if magic != MAGIC or version != VERSION or klen > 64 or len(head) < meta_end:
            return None
        key_raw = head[HEADER_SIZE: HEADER_SIZE + klen]
        (meta,) = _META.unpack_from(head, HEADER_SIZE + klen)
        if meta != _meta_digest(head[:HEADER_SIZE], key_raw) or offset + meta_end + length > size:
            return None
        block_hash: int | bytes = key_raw if flags & _BYTES_KEY else int.from_bytes(key_raw, "big")
        return (layout_id, block_hash), meta_end, length, digest

    # -- interface -------------------------------------------------------------------------------------------

    @staticmethod
    def _record(key: BlockKey, payload: Buffer, digest: int | None) -> _Record:
        key_raw, flags = _key_bytes(key)
        length = len(payload)
        meta_end = HEADER_SIZE + len(key_raw) + 8
        header = HEADER.pack(MAGIC, VERSION, flags, key[0], length, checksum(payload) if digest is None else digest)
        parts: list[Buffer] = [header, key_raw, _META.pack(_meta_digest(header, key_raw)), payload]
        return _Record(key, parts, meta_end + length, meta_end, length)

    def store(self, key: BlockKey, payload: Buffer, digest: int | None = None) -> bool:
        return self.store_many([StoreItem(key, payload, digest)]) == 1

    def store_many(self, items: Sequence[StoreItem]) -> int:
        """Append blocks with one write per group that fits a segment; how many are held afterwards."""
        held = 0
        group: list[_Record] = []
        group_bytes = 0
        for key, payload, digest, _parent in items:
            if HEADER_SIZE + 16 + len(payload) > self.capacity:
                self.stats.add("refused")
                continue
            record = self._record(key, payload, digest)
            if group and (group_bytes + record.size > self.segment_bytes or len(group) >= _MAX_GROUP):
                held += self._append(group)
                group, group_bytes = [], 0
            group.append(record)
            group_bytes += record.size
        if group:
            held += self._append(group)
        return held

    def _append(self, records: list[_Record], retry: bool = True, again: bool = False) -> int:
        """Append records back to back at the end of the active segment, one pwritev; how many of them are held
        afterwards. A failed write gives its bytes back and seals the segment (never append after a hole). A
        group that cannot be written is tried again a record at a time, so what fits is kept; a record that
        meets a full disk is tried once more after the oldest segment is dropped (a file-size limit or a short
        write: in a new segment)."""
        error: OSError | None = None
        segment: _Segment | None = None
        with self._lock:  # `again`: blocks already held, appended anew so they outlive their old segment
            fresh = [r for r in records if (again or r.key not in self._index) and r.key not in self._pending]
            held = len(records) - len(fresh)
            if not fresh:
                return held
            size = sum(r.size for r in fresh)
            if self.min_free and not self._space.take(size):
                error = _ReserveReached(errno.ENOSPC, "the free-space reserve would be used")
            else:
                self._evict_locked(self.capacity - size)
                self._evict_blocks_locked(self.max_blocks - (0 if again else len(fresh)))
                try:
                    segment = self._segment_for_locked(size, len(fresh))
                except OSError as exc:
                    error = exc
                    self.stats.add("backend_errors")
            if segment is not None:
                offset = segment.size
                segment.size += size
                segment.records += len(fresh)
                segment.inflight += 1
                self._used += size
                self._pending.update(r.key for r in fresh)
                fd = segment.write_fd
        if segment is not None:
            assert fd is not None
            try:
                written = os.pwritev(fd, [part for r in fresh for part in r.parts], offset)
                if written != size:
                    # a file-size limit, or the first sign of a full disk (the next write says ENOSPC)
                    raise OSError(errno.EFBIG, f"short write ({written} of {size} bytes)")
                if self.fsync:
                    os.fdatasync(fd)
            except OSError as exc:
                error = exc
            with self._lock:
                self._pending.difference_update(r.key for r in fresh)
                segment.inflight -= 1
                kept = error is None and segment.seg_id in self._segments  # else it was dropped while we wrote
                if kept:
                    position = offset
                    for r in fresh:
                        if again and r.key not in self._index:
                            continue  # forgotten while we wrote: stays forgotten
                        self._index[r.key] = _Location(segment.seg_id, position, r.meta_end, r.length)
                        segment.keys.add(r.key)
                        position += r.size
                elif error is not None:
                    self.stats.add("backend_errors")
                    self._give_back_tail_locked(segment, offset, size)
                    segment.sealed = True
                if segment.sealed:
                    self._seal_locked(segment)  # closes the fd once the last write is done
            if kept:
                self.stats.add("stores", len(fresh))
                return held + len(fresh)
        if error is not None and len(fresh) > 1:
            return held + sum(self._append([r], again=again) for r in fresh)
        if error is not None and retry and error.errno in _FULL:
            if error.errno != errno.EFBIG:  # the disk is full: free the oldest segment
                with self._lock:
                    self._evict_oldest_locked()
            return held + self._append(fresh, retry=False, again=again)
        if error is not None and not isinstance(error, _ReserveReached):
            log.warning("nvme segments: cannot write a block: %s", error)
        self.stats.add("refused", len(fresh))
        return held

    def read_into(self, key: BlockKey, out: memoryview, touch: bool = True) -> int | None:
        return self.read_many([key], [out], touch)[0]

    def read_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview], touch: bool = True) -> list[int | None]:
        """Read blocks into `outs`; records lying back to back in one segment (a chain stored together) are
        read with one preadv. Each entry: the payload length, or None (miss, or a block that failed checks).
        A long run is read in parts of at least `read_part_bytes` on the copier's threads (preadv and the
        checksum release the GIL), each part read and verified where it is read; what the checks failed is
        forgotten here, on the caller's thread, once every part is done."""
        results: list[int | None] = [None] * len(keys)
        with self._lock:
            reads, missed = self._plan_locked(keys, outs)
        try:
            parts = [reads[part.start: part.stop] for part in self._parts([read.size for read in reads])]
            verdicts = self._run([partial(self._read_part, part, keys, outs) for part in parts])
        finally:
            with self._lock:  # every reader let go, an exception or not
                for read in reads:
                    self._release_reader_locked(read.segment)
        hits: list[tuple[_Segment, BlockKey]] = []
        for read, errors in zip((r for part in parts for r in part), (e for part in verdicts for e in part),
                                strict=True):
            for k, (loc, error) in enumerate(zip(read.locs, errors, strict=True)):
                key = keys[read.first + k]
                if error is None:
                    results[read.first + k] = loc.length
                    hits.append((read.segment, key))
                    continue
                corrupt = isinstance(error, ChecksumError)
                log.warning("nvme segments: %s: %s", "corrupt block" if corrupt else "unreadable block", error)
                self.stats.add("checksum_failures" if corrupt else "read_errors")
                missed += 1
                self._forget(key, at=loc)
        if touch and hits:
            with self._lock:
                for segment, key in hits:
                    segment.hot.add(key)
        if missed:
            self.stats.add("misses", missed)
        if hits:
            self.stats.add("hits", len(hits))
        return results

    def _parts(self, sizes: Sequence[int]) -> list[range]:
        return _parts(sizes, self._copier.threads if self._copier is not None else 1, self.read_part_bytes)

    def _run(self, shares: Sequence[Callable[[], T]]) -> list[T]:
        """The shares' results: on the copier's threads, or all on this one."""
        if self._copier is not None and len(shares) > 1:
            return self._copier.run(shares)
        return [share() for share in shares]

    def _plan_locked(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> tuple[list[_Read], int]:
        """The preadvs that read `keys` (each with a reader of its segment held), and how many keys are misses
        (not held, a payload bigger than its buffer, a segment gone)."""
        reads: list[_Read] = []
        missed = 0
        i = 0
        try:
            while i < len(keys):
                first = self._index.get(keys[i])
                if first is None or first.length > len(outs[i]):
                    missed += 1
                    i += 1
                    continue
                run = [first]
                run_bytes = first.length
                while i + len(run) < len(keys) and len(run) < _MAX_GROUP:
                    prev, loc = run[-1], self._index.get(keys[i + len(run)])
                    if (loc is None or loc.seg_id != first.seg_id or loc.length > len(outs[i + len(run)])
                            or loc.offset != prev.offset + prev.payload_offset + prev.length
                            or run_bytes + loc.length > _READ_GROUP_BYTES):
                        break
                    run.append(loc)
                    run_bytes += loc.length
                segment = self._reader_locked(first.seg_id)
                if segment is None:
                    missed += 1
                    i += 1
                    continue
                reads.append(_Read(segment, i, run, run_bytes))
                i += len(run)
        except BaseException:
            for read in reads:
                self._release_reader_locked(read.segment)
            raise
        return reads, missed

    def _read_part(self, reads: list[_Read], keys: Sequence[BlockKey],
                   outs: Sequence[memoryview]) -> list[list[BlockError | None]]:
        """Read and check a part's records (on any thread: no lock, no tier state changed); per read, per record,
        what is wrong with it (None: whole, and its payload matches its checksum)."""
        verdicts: list[list[BlockError | None]] = []
        for read in reads:
            fd = read.segment.read_fd
            assert fd is not None  # open while it has readers
            metas = [bytearray(loc.payload_offset) for loc in read.locs]
            views = [outs[read.first + k][: loc.length] for k, loc in enumerate(read.locs)]
            try:
                got = os.preadv(fd, [b for pair in zip(metas, views, strict=True) for b in pair], read.locs[0].offset)
            except OSError as exc:
                got = -1
                log.warning("nvme segments: read failed: %s", exc)
            position = 0
            errors: list[BlockError | None] = []
            for k, loc in enumerate(read.locs):
                position += loc.payload_offset + loc.length
                errors.append(_check(keys[read.first + k], loc, metas[k], views[k], whole=got >= position))
            verdicts.append(errors)
        return verdicts

    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def held(self, key: BlockKey) -> HeldBlock | None:
        return None

    def touch(self, keys: Sequence[BlockKey]) -> None:
        pass  # reads mark blocks hot; the upkeep's eviction appends hot blocks again before their segment goes

    def delete(self, key: BlockKey) -> bool:
        """Forget a block; its bytes stay until its segment is dropped."""
        return self._forget(key)

    def usage(self) -> TierUsage:
        return TierUsage(self._used, len(self._index), self.capacity)

    def block_keys(self) -> Iterable[BlockKey]:
        with self._lock:
            return list(self._index)


    # -- pressure --------------------------------------------------------------------------------------------

    def above_high_watermark(self) -> bool:
        return self._used > self.high_bytes or len(self._index) > self.high_blocks

    def evict_to_low_watermark(self, offered: Collection[BlockKey] | None = None) -> None:
        """Drop the oldest segments down to the low watermarks, of bytes and of blocks; blocks read since they were
        written there are appended again first (once: they must be read again to survive the next time), up to
        half the bytes freed, so a hot block does not go with its old segment. Only segments older than the one
        being appended to when it starts go, never that one, nor one opened since (the hot blocks' new home);
        given `offered`, only while the oldest holds none but offered blocks (the one being appended to when
        `demotion_candidates` ran, sealed by a store since, is not offered): the watermarks are a target, the
        store-time bounds the hard limit."""
        with self._lock:
            before = self._active.seg_id if self._active is not None else self._next_id
            freed = freed_blocks = 0
            excess = self._used - self.low_bytes
            excess_blocks = len(self._index) - self.low_blocks
            hot: list[tuple[BlockKey, int]] = []
            for segment in self._segments.values():
                if ((freed >= excess and freed_blocks >= excess_blocks) or segment is self._active or segment.inflight
                        or not self._offered_locked(segment, offered)):
                    break
                freed += segment.size
                freed_blocks += len(segment.keys)
                hot.extend((key, loc.length) for key in segment.hot
                           if (loc := self._index.get(key)) is not None and loc.seg_id == segment.seg_id)
        budget = max(0, excess) // 2
        keep: list[tuple[BlockKey, int]] = []
        for key, length in hot:
            if length + HEADER_SIZE + 16 > budget:
                continue
            budget -= length + HEADER_SIZE + 16
            keep.append((key, length))
        if keep:
            outs = [memoryview(unfilled(length)) for _key, length in keep]  # read into before use
            got = self.read_many([key for key, _n in keep], outs, touch=False)
            records = [self._record(key, out[:n], None) for (key, _l), out, n in zip(keep, outs, got, strict=True)
                       if n is not None]
            for start in range(0, len(records), _MAX_GROUP):
                self._append(records[start: start + _MAX_GROUP], again=True)
        with self._lock:
            self._evict_locked(self.low_bytes, before, offered)
            self._evict_blocks_locked(self.low_blocks, before, offered)

    def demotion_candidates(self) -> list[tuple[BlockKey, int]]:
        """The blocks of the oldest segments, which go first, down to the low watermarks."""
        with self._lock:
            out: list[tuple[BlockKey, int]] = []
            total = 0
            excess = self._used - self.low_bytes
            excess_blocks = len(self._index) - self.low_blocks
            for segment in self._segments.values():
                if (total >= excess and len(out) >= excess_blocks) or segment is self._active:
                    break
                out.extend((key, loc.length) for key in segment.keys if (loc := self._index.get(key)) is not None)
                total += segment.size
            return out

    def upkeep(self) -> None:
        self.verify_segments()

    def verify_segments(self) -> int:
        """Drop segments whose file disappeared behind our back; how many were dropped."""
        with self._lock:
            gone = [s for s in self._segments.values() if not s.inflight and not os.path.exists(s.path)]
            for segment in gone:
                self._drop_segment_locked(segment, unlink=False)
        return len(gone)

    def close(self) -> None:
        with self._lock:
            for segment in self._segments.values():
                self._seal_locked(segment)
                if segment.read_fd is not None and not segment.readers:
                    os.close(segment.read_fd)
                    segment.read_fd = None
        if self._copier is not None:
            self._copier.close()

    # -- internals -------------------------------------------------------------------------------------------

    def _segment_for_locked(self, size: int, records: int) -> _Segment:
        active = self._active
        if active is None or active.sealed or (active.size and (active.size + size > self.segment_bytes or
                                                                active.records + records > self.segment_records)):
            if active is not None:
                self._seal_locked(active)
            seg_id = self._next_id
            self._next_id += 1
            path = str(self.seg_dir / f"{seg_id:016x}.seg")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
            active = _Segment(seg_id, path, write_fd=fd)
            self._segments[seg_id] = active
            self._active = active
        return active

    def _give_back_tail_locked(self, segment: _Segment, offset: int, size: int) -> None:
        """A write of `size` bytes at `offset` failed: if it is the segment's tail, give its bytes back."""
        if offset + size == segment.size and segment.seg_id in self._segments:
            segment.size = offset
            self._used -= size
            if segment.write_fd is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(segment.write_fd, offset)

    def _seal_locked(self, segment: _Segment) -> None:
        segment.sealed = True
        if segment.write_fd is not None and segment.inflight == 0:
            os.close(segment.write_fd)
            segment.write_fd = None
        if segment is self._active:
            self._active = None

    def _reader_locked(self, seg_id: int) -> _Segment | None:
        """The segment with an open read fd and one more reader; None if it is gone."""
        segment = self._segments.get(seg_id)
        if segment is None:
            return None
        if segment.read_fd is None:
            try:
                segment.read_fd = os.open(segment.path, os.O_RDONLY)
            except FileNotFoundError:
                if not segment.inflight:
                    self._drop_segment_locked(segment, unlink=False)
                return None
        segment.readers += 1
        return segment

    def _release_reader_locked(self, segment: _Segment) -> None:
        segment.readers -= 1
        if segment.dropped and segment.readers == 0 and segment.read_fd is not None:
            os.close(segment.read_fd)
            segment.read_fd = None

    def _evict_locked(self, target: int, before: int | None = None,
                      offered: Collection[BlockKey] | None = None) -> None:
        while self._used > target and self._evict_oldest_locked(before, offered):
            pass

    def _evict_blocks_locked(self, most: int, before: int | None = None,
                             offered: Collection[BlockKey] | None = None) -> None:
        """Drop the oldest segments until the blocks held and being written number `most` at most."""
        while len(self._index) + len(self._pending) > most and self._evict_oldest_locked(before, offered):
            pass

    def _evict_oldest_locked(self, before: int | None = None, offered: Collection[BlockKey] | None = None) -> bool:
        """Drop the oldest segment no write is in flight to, the one being appended to last (only to make room for
        a store: it is sealed first, the next append opens a fresh segment); given `before`, only one with a lower
        id; given `offered`, only one that holds none but those. Whether there was one."""
        chosen: _Segment | None = None
        for segment in self._segments.values():  # oldest first
            if before is not None and segment.seg_id >= before:
                break
            if segment.inflight:
                continue  # writes in flight there
            chosen = segment
            if segment is not self._active:
                break
        if chosen is None or not self._offered_locked(chosen, offered):
            return False
        self.stats.add("evictions", self._drop_segment_locked(chosen, unlink=True))
        return True

    def _offered_locked(self, segment: _Segment, offered: Collection[BlockKey] | None) -> bool:
        """Whether every block the segment holds (not one appended again elsewhere since) is `offered` (None: any
        is)."""
        if offered is None:
            return True
        index = self._index
        return all(key in offered for key in segment.keys
                   if (loc := index.get(key)) is not None and loc.seg_id == segment.seg_id)

    def _drop_segment_locked(self, segment: _Segment, unlink: bool) -> int:
        """Forget a segment and its blocks (reported to `on_removed`); how many blocks went with it."""
        self._segments.pop(segment.seg_id, None)
        self._seal_locked(segment)
        segment.dropped = True
        if segment.readers == 0 and segment.read_fd is not None:
            os.close(segment.read_fd)
            segment.read_fd = None
        self._used -= segment.size
        removed: list[Removed] = []
        for key in segment.keys:
            loc = self._index.get(key)
            if loc is not None and loc.seg_id == segment.seg_id:
                del self._index[key]
                removed.append(Removed(key))
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path)
        self._report(removed)
        return len(removed)

    def _forget(self, key: BlockKey, at: _Location | None = None) -> bool:
        """Forget a block (`at`: only if the index still has it there, not at a place written since)."""
        with self._lock:
            loc = self._index.get(key)
            if loc is None or (at is not None and loc is not at):
                return False
            del self._index[key]
            segment = self._segments.get(loc.seg_id)
            if segment is not None:
                segment.keys.discard(key)
        self._report([Removed(key)])
        return True

    def _report(self, removed: list[Removed]) -> None:
        if removed and self.on_removed is not None:
            self.on_removed(removed)
