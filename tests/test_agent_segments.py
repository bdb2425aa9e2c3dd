"""The NVMe tier's segment-log layout: restart rebuild, torn and corrupted records, external deletion, the byte
bound, a full disk and concurrent writers -- never a wrong block, usage always what the disk holds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import pytest

from agent.block import HEADER_SIZE
from agent.tiers.base import StoreItem
from agent.tiers.copies import ParallelCopier
from agent.tiers.segments import SegmentNvmeTier, _Segment
from tests.conftest import ROOT

LAYOUT = 0x5E6
SIZE = 1000
RECORD = HEADER_SIZE + 8 + 8 + SIZE  # header, int key, meta digest, payload
T = TypeVar("T")


def payload(i: int, size: int = SIZE) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(size))


def read(tier: SegmentNvmeTier, i: int, size: int = SIZE) -> bytes | None:
    out = memoryview(bytearray(size))
    n = tier.read_into((LAYOUT, i), out)
    return None if n is None else bytes(out[:n])


def segment_files(root: Path) -> list[Path]:
    return sorted((root / "segments").glob("*.seg"))


def on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in segment_files(root))


def test_store_read_and_restart(tmp_path: Path) -> None:
    tier = SegmentNvmeTier(tmp_path, capacity=1 << 20, fsync=False, segment_bytes=4 * RECORD)
    for i in range(10):
        assert tier.store((LAYOUT, i), payload(i))
    tier.store((LAYOUT, b"\x07" * 32), payload(99))  # bytes keys too
    assert tier.usage().used_bytes == on_disk(tmp_path) == 10 * RECORD + RECORD + 24
    assert len(segment_files(tmp_path)) == 3
    tier.close()
    again = SegmentNvmeTier(tmp_path, capacity=1 << 20, fsync=False, segment_bytes=4 * RECORD)
    assert again.usage() == tier.usage()
    assert all(read(again, i) == payload(i) for i in range(10))
    out = memoryview(bytearray(SIZE))
    assert again.read_into((LAYOUT, b"\x07" * 32), out) == SIZE and bytes(out) == payload(99)
    assert again.store((LAYOUT, 10), payload(10))  # appends go to a new segment after a restart
    assert read(again, 10) == payload(10) and len(segment_files(tmp_path)) == 4


def test_corrupt_payload_is_a_miss(tmp_path: Path) -> None:
    tier = SegmentNvmeTier(tmp_path, capacity=1 << 20, fsync=False)
    for i in range(3):
        tier.store((LAYOUT, i), payload(i))
    (seg,) = segment_files(tmp_path)
    data = bytearray(seg.read_bytes())
    data[RECORD + RECORD - 10] ^= 0xFF  # inside block 1's payload
    seg.write_bytes(data)
    assert read(tier, 1) is None and tier.stats.checksum_failures == 1
    assert read(tier, 0) == payload(0) and read(tier, 2) == payload(2)
    assert not tier.contains((LAYOUT, 1))


def test_corrupt_key_torn_tail_and_holes_never_serve_wrong_bytes(tmp_path: Path) -> None:
    tier = SegmentNvmeTier(tmp_path, capacity=1 << 20, fsync=False)
    for i in range(6):
        tier.store((LAYOUT, i), payload(i))
    tier.close()
    (seg,) = segment_files(tmp_path)
    data = bytearray(seg.read_bytes())
    data[RECORD + HEADER_SIZE + 7] ^= 0x01  # block 1's key now says block 0: its meta digest no longer matches
    data[3 * RECORD: 4 * RECORD] = bytes(RECORD)  # block 3 never written: a hole left by concurrent appends
    seg.write_bytes(data[: 6 * RECORD - 100])  # and block 5 is torn, as a crash mid-write leaves it
    again = SegmentNvmeTier(tmp_path, capacity=1 << 20, fsync=False)
    assert read(again, 0) == payload(0)  # not block 1's bytes under block 0's (corrupted) name
    assert read(again, 1) is None and read(again, 3) is None and read(again, 5) is None
    assert read(again, 2) == payload(2) and read(again, 4) == payload(4)  # found again past the bad spots
    assert again.usage().blocks == 3 and again.usage().used_bytes == 6 * RECORD - 100


def test_deleted_segment_is_a_miss(tmp_path: Path) -> None:
    tier = SegmentNvmeTier(tmp_path, capacity=1 << 20, fsync=False, segment_bytes=2 * RECORD)
    for i in range(6):
        tier.store((LAYOUT, i), payload(i))
    first = segment_files(tmp_path)[0]
    first.unlink()
    assert tier.verify_segments() == 1
    assert read(tier, 0) is None and read(tier, 1) is None and read(tier, 2) == payload(2)
    assert tier.usage().used_bytes == on_disk(tmp_path) and tier.usage().blocks == 4
    segment_files(tmp_path)[0].unlink()  # not yet noticed: the read finds out, no crash
    assert read(tier, 2) is None or read(tier, 2) == payload(2)


def test_byte_bound_drops_oldest_segments(tmp_path: Path) -> None:
    capacity = 16 * RECORD
    tier = SegmentNvmeTier(tmp_path, capacity=capacity, fsync=False)
    for i in range(100):
        assert tier.store((LAYOUT, i), payload(i))
        assert tier.usage().used_bytes <= capacity
        assert on_disk(tmp_path) == tier.usage().used_bytes
    assert read(tier, 99) == payload(99) and read(tier, 0) is None
    assert tier.stats.evictions >= 80
    assert not tier.store((LAYOUT, 1000), payload(1, capacity))  # bigger than the tier


def test_upkeep_eviction_keeps_a_hot_block_of_the_oldest_segment(tmp_path: Path) -> None:
    """Issue 14: eviction dropped the oldest segment whole, hot blocks too (docs said a hot block lives on)."""
    tier = SegmentNvmeTier(tmp_path, capacity=40 * RECORD, high_watermark=0.9, low_watermark=0.5, fsync=False,
                           segment_bytes=4 * RECORD)
    for i in range(38):
        assert tier.store((LAYOUT, i), payload(i))
    assert read(tier, 1) == payload(1)  # block 1 (first segment) is used; 0, 2, 3 are not
    assert tier.above_high_watermark()
    tier.evict_to_low_watermark()
    assert tier.usage().used_bytes <= 20 * RECORD and on_disk(tmp_path) == tier.usage().used_bytes
    assert read(tier, 1) == payload(1)
    assert all(read(tier, i) is None for i in (0, 2, 3))
    for i in range(38, 60):  # once appended again, it must be used again to survive the next round
        tier.store((LAYOUT, i), payload(i))
    tier.evict_to_low_watermark()
    tier.store_many([])
    assert tier.usage().used_bytes <= 40 * RECORD
    reopened = SegmentNvmeTier(tmp_path, capacity=40 * RECORD, fsync=False, segment_bytes=4 * RECORD)
    assert reopened.usage().blocks == tier.usage().blocks  # the rewritten record is what a restart finds


def test_eviction_never_drops_the_segment_being_appended_to(tmp_path: Path) -> None:
    """The watermark eviction dropped the oldest segments until under the low marks, the one being appended to
    too when the older ones were not enough (a low watermark under a segment's share of the tier): at main, 38
    blocks stored, the tier was left empty, and the 3 newest (one just read) went without ever being offered by
    `demotion_candidates`, which stops at that segment (a lazy store demotes only what it offers: they were lost,
    not demoted). Now it stops there too. What the tier holds reads back exact, before and after stores that
    evict to make room (the one being appended to last, sealed first: the next append opens a fresh one)."""
    tier = SegmentNvmeTier(tmp_path, capacity=40 * RECORD, high_watermark=0.9, low_watermark=0.05, fsync=False,
                           segment_bytes=5 * RECORD)
    removed: list[tuple[int, int | bytes]] = []
    tier.on_removed = lambda gone: removed.extend(r.key for r in gone)
    for i in range(38):
        assert tier.store((LAYOUT, i), payload(i))
    active = tier._active
    assert active is not None and active.keys == {(LAYOUT, 35), (LAYOUT, 36), (LAYOUT, 37)}
    assert read(tier, 36) == payload(36)  # used: hot
    offered = {key for key, _size in tier.demotion_candidates()}
    assert tier.above_high_watermark()
    tier.evict_to_low_watermark()
    assert len(removed) == 35 and set(removed) <= offered  # nothing went that was not offered first
    assert {int(k[1]) for k in tier.block_keys()} == {35, 36, 37}
    assert tier._active is active and tier.usage().used_bytes == on_disk(tmp_path)

    sizes: dict[int, int] = {}

    def exact() -> set[int]:
        held = {int(k[1]) for k in tier.block_keys()}
        assert all(read(tier, i, sizes.get(i, SIZE)) == payload(i, sizes.get(i, SIZE)) for i in held)
        return held

    for i in range(100, 140):  # stores past the byte bound: it holds 40 records, a segment 5
        assert tier.store((LAYOUT, i), payload(i))
        assert i in exact() and tier.usage().used_bytes <= 40 * RECORD
    sizes[500] = 40 * RECORD - (RECORD - SIZE)  # a record the size of the tier: every segment goes, the active last
    assert tier.store((LAYOUT, 500), payload(500, sizes[500]))
    assert exact() == {500} and tier.usage().used_bytes == on_disk(tmp_path) == 40 * RECORD
    for i in (600, 601):  # the big one's segment goes, the one being appended to
        assert tier.store((LAYOUT, i), payload(i))
    assert exact() == {600, 601} and tier.usage().used_bytes == on_disk(tmp_path) == 2 * RECORD
    reopened = SegmentNvmeTier(tmp_path, capacity=40 * RECORD, fsync=False, segment_bytes=5 * RECORD)
    assert {int(k[1]) for k in reopened.block_keys()} == {int(k[1]) for k in tier.block_keys()}
    assert reopened.stats.checksum_failures == tier.stats.checksum_failures == 0


DISK_FULL_SCRIPT = """
import resource, signal, sys
from agent.tiers.base import StoreItem
from agent.tiers.segments import SegmentNvmeTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
tier = SegmentNvmeTier(sys.argv[1], capacity=1 << 30, fsync=False, segment_bytes=1 << 20)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # no file may grow past 64 KiB now
stored = sum(tier.store((1, i), bytes([i % 256]) * 10_000) for i in range(20))
big = tier.store((1, 999), b"y" * 100_000)
chain = tier.store_many([StoreItem((2, i), bytes([i % 256]) * 10_000) for i in range(20)])  # one 200 kB write fails
ok = all(tier.read_into((layout, i), memoryview(bytearray(10_000))) == 10_000 for layout in (1, 2) for i in range(20))
u = tier.usage()
print(stored, big, chain, ok, u.blocks, u.used_bytes, tier.stats.backend_errors)
"""


def test_disk_full_seals_the_segment_and_refuses_what_cannot_fit(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", DISK_FULL_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    stored, big, chain, ok, blocks, used, errors = out.stdout.split()
    assert stored == "20" and big == "False" and ok == "True" and int(blocks) == 40
    assert chain == "20"  # the chain's write failed as a whole, then went in record by record
    assert int(errors) >= 2
    assert int(used) == on_disk(tmp_path)


def test_concurrent_writers_and_readers(tmp_path: Path) -> None:
    tier = SegmentNvmeTier(tmp_path, capacity=200 * RECORD, fsync=False, segment_bytes=10 * RECORD)
    wrong: list[int] = []

    def work(offset: int) -> None:
        for i in range(offset, offset + 300):
            tier.store((LAYOUT, i), payload(i))
            for j in (i, i - 7, i - 50):
                got = read(tier, j)
                if got is not None and got != payload(j):
                    wrong.append(j)

    threads = [threading.Thread(target=work, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert wrong == []
    assert tier.usage().used_bytes <= 200 * RECORD
    tier.close()
    again = SegmentNvmeTier(tmp_path, capacity=200 * RECORD, fsync=False)
    assert again.usage().used_bytes == on_disk(tmp_path)
    for key in list(again.block_keys()):
        assert read(again, int(key[1])) == payload(int(key[1]))


def test_a_torn_record_between_whole_ones_is_not_indexed_after_restart(tmp_path: Path) -> None:
    """kill -9 can cut a big append short while another writer's later record is whole (two writers)."""
    tier = SegmentNvmeTier(tmp_path, capacity=1 << 20, fsync=False)
    for i in range(3):
        tier.store((LAYOUT, i), payload(i))
    tier.close()
    (seg,) = segment_files(tmp_path)
    data = bytearray(seg.read_bytes())
    data[RECORD + HEADER_SIZE + 16 + 500: 2 * RECORD] = bytes(RECORD - HEADER_SIZE - 16 - 500)  # 1: half a payload
    seg.write_bytes(data)
    again = SegmentNvmeTier(tmp_path, capacity=1 << 20, fsync=False)
    assert again.usage().blocks == 2 and not again.contains((LAYOUT, 1))
    assert read(again, 0) == payload(0) and read(again, 2) == payload(2)


# -- long runs read in parts on several threads ------------------------------------------------------------------

BIG = 150_000  # a few records per preadv (1 MiB), several preadvs per segment and per part


class CountingCopier(ParallelCopier):
    """The tier's real thread shares, counted: a test of the parallel path must see it taken."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads, "test-nvme-read")
        self.shares: list[int] = []

    def run(self, shares: Sequence[Callable[[], T]]) -> list[T]:
        self.shares.append(len(shares))
        return super().run(shares)


def big_payload(i: int) -> bytes:
    size = BIG + 997 * i  # every block its own length: a result or a verdict given to the wrong block shows
    return (i.to_bytes(4, "big") * (size // 4 + 1))[:size]


def parallel_tier(root: Path, n: int) -> tuple[SegmentNvmeTier, CountingCopier]:
    copier = CountingCopier(4)
    tier = SegmentNvmeTier(root, capacity=1 << 30, fsync=False, segment_bytes=2_500_000, copier=copier,
                           read_part_bytes=1 << 20)
    assert tier.store_many([StoreItem((LAYOUT, i), big_payload(i)) for i in range(n)]) == n
    return tier, copier


def read_run(tier: SegmentNvmeTier, keys: list[int]) -> tuple[list[int | None], list[bytes | None]]:
    outs = [memoryview(bytearray(BIG + 997 * i + 10)) for i in keys]
    got = tier.read_many([(LAYOUT, i) for i in keys], outs)
    return got, [None if n is None else bytes(out[:n]) for n, out in zip(got, outs, strict=True)]


def all_readers(tier: SegmentNvmeTier, segments: list[_Segment]) -> list[tuple[int, int, bool]]:
    """(id, readers, fd open) of every segment ever seen: none may still count a reader."""
    return [(s.seg_id, s.readers, s.read_fd is not None) for s in segments]


def test_a_long_run_read_in_parts_is_what_a_single_thread_reads(tmp_path: Path) -> None:
    tier, copier = parallel_tier(tmp_path, 60)
    assert len(segment_files(tmp_path)) >= 4
    keys = list(range(60))
    got, data = read_run(tier, keys)
    assert copier.shares == [4]  # the run went to 4 threads
    assert got == [len(big_payload(i)) for i in keys] and data == [big_payload(i) for i in keys]
    sequential = SegmentNvmeTier(tmp_path, capacity=1 << 30, fsync=False)  # the same records, one thread
    assert read_run(sequential, keys) == (got, data)
    # a run with holes (misses, a block asked twice, one too big for its buffer) and out of order
    asked = [5, 1000, 6, 7, 7, 59, 30, 31, 1001, 2, 3, 4]
    got, data = read_run(tier, asked)
    assert got == [None if i >= 1000 else len(big_payload(i)) for i in asked]
    assert data == [None if i >= 1000 else big_payload(i) for i in asked]
    assert tier.stats.hits == 60 + 10 and tier.stats.misses == 2
    too_small = [memoryview(bytearray(BIG)) for _ in range(3)]
    assert tier.read_many([(LAYOUT, 0), (LAYOUT, 1), (LAYOUT, 2)], too_small) == [BIG, None, None]
    assert tier.stats.misses == 4 and tier.contains((LAYOUT, 1))  # too small a buffer: a miss, not a bad block
    assert all_readers(tier, list(tier._segments.values())) == [(s, 0, True) for s in tier._segments]
    tier.close()


def test_a_corrupt_record_in_a_middle_part_is_dropped_alone(tmp_path: Path) -> None:
    tier, copier = parallel_tier(tmp_path, 60)
    bad = 31  # in the third of four parts
    loc = tier._index[(LAYOUT, bad)]
    seg = tmp_path / "segments" / f"{loc.seg_id:016x}.seg"
    data = bytearray(seg.read_bytes())
    data[loc.offset + loc.payload_offset + 1234] ^= 0x40
    seg.write_bytes(data)
    keys = list(range(60))
    got, read_back = read_run(tier, keys)
    assert copier.shares == [4]
    assert got == [None if i == bad else len(big_payload(i)) for i in keys]
    assert read_back == [None if i == bad else big_payload(i) for i in keys]
    assert (tier.stats.hits, tier.stats.misses, tier.stats.checksum_failures, tier.stats.read_errors) == (59, 1, 1, 0)
    assert not tier.contains((LAYOUT, bad)) and tier.usage().blocks == 59
    got, _ = read_run(tier, keys)  # now a plain miss
    assert got[bad] is None and (tier.stats.hits, tier.stats.misses, tier.stats.checksum_failures) == (118, 2, 1)
    tier.close()


def test_a_failing_part_lets_go_of_every_reader(tmp_path: Path) -> None:
    tier, copier = parallel_tier(tmp_path, 60)
    outs = [memoryview(bytearray(BIG + 997 * i)) for i in range(60)]
    outs[40] = memoryview(bytes(len(outs[40])))  # not writable: that part's preadv raises
    with pytest.raises(BufferError):
        tier.read_many([(LAYOUT, i) for i in range(60)], outs)
    assert copier.shares == [4]
    assert all(s.readers == 0 for s in tier._segments.values())
    segments = list(tier._segments.values())
    with tier._lock:
        for segment in segments:
            tier._drop_segment_locked(segment, unlink=True)  # no reader left: its fd is closed at once
    assert all_readers(tier, segments) == [(s.seg_id, 0, False) for s in segments]


def test_segments_dropped_during_parallel_reads_never_serve_wrong_bytes(tmp_path: Path) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    copier = CountingCopier(4)
    tier = SegmentNvmeTier(tmp_path, capacity=12_000_000, fsync=False, segment_bytes=1_500_000, copier=copier,
                           read_part_bytes=1 << 20)
    seen: list[_Segment] = []
    wrong: list[int] = []
    served = [0]
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            keys = sorted(int(k[1]) for k in tier.block_keys())[:50]
            got, data = read_run(tier, keys)
            for i, n, payload_read in zip(keys, got, data, strict=True):
                if n is not None:
                    served[0] += 1
                    if payload_read != big_payload(i):
                        wrong.append(i)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    assert tier.store_many([StoreItem((LAYOUT, i), big_payload(i)) for i in range(40)]) == 40
    for t in readers:
        t.start()
    try:
        for i in range(40, 160, 5):  # the oldest segments go while they are read
            seen.extend(s for s in tier._segments.values() if s not in seen)
            tier.store_many([StoreItem((LAYOUT, j), big_payload(j)) for j in range(i, i + 5)])
            if i % 20 == 0:
                tier.evict_to_low_watermark()
            if i % 30 == 0:  # and one deleted behind the tier's back
                segment_files(tmp_path)[0].unlink()
                tier.verify_segments()
    finally:
        stop.set()
        for t in readers:
            t.join(60)
    assert wrong == [] and served[0] > 0 and max(copier.shares) > 1
    seen.extend(s for s in tier._segments.values() if s not in seen)
    assert all(s.readers == 0 for s in seen)
    assert all(s.read_fd is None for s in seen if s.dropped)
    assert tier.stats.hits + tier.stats.misses > 0 and tier.stats.checksum_failures == 0
    tier.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no fd of a dropped segment left open
