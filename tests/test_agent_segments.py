"""The NVMe tier's segment-log layout: restart rebuild, torn and corrupted records, external deletion, the byte
bound, a full disk and concurrent writers -- never a wrong block, usage always what the disk holds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from agent.block import HEADER_SIZE
from agent.tiers.segments import SegmentNvmeTier
from tests.conftest import ROOT

LAYOUT = 0x5E6
SIZE = 1000
RECORD = HEADER_SIZE + 8 + 8 + SIZE  # header, int key, meta digest, payload


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
