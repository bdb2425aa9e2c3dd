"""Unit tests of the agent's block format and tiers, on real files and a real Valkey server."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis
import redis.cluster

from agent.block import HEADER_SIZE, BlockError, BlockKey, ChecksumError, key_name, pack, parse_key_name, verify
from agent.config import AgentConfig
from agent.store import TierStore
from agent.tiers.base import INDEX_ENTRY_FLOOR, DiskSpace, Removed, StoreItem, TierUsage
from agent.tiers.dram import DramTier
from agent.tiers.nvme import NvmeTier
from agent.tiers.segments import SegmentNvmeTier
from agent.tiers.shared import FsSharedTier, RedisSharedTier
from bench.procs import free_port, spawn_valkey, valkey_server_binary, wait_for_port
from bench.procs import stop as stop_process
from tests.conftest import ROOT, ValkeyServer

LAYOUT = 0xABCDEF


def key(i: int) -> tuple[int, int]:
    return (LAYOUT, i)


def payload(i: int, size: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def read(tier: object, k: tuple[int, int], size: int = 4096) -> bytes | None:
    out = memoryview(bytearray(size))
    n = tier.read_into(k, out)  # type: ignore[attr-defined]
    return None if n is None else bytes(out[:n])


# -- block format ------------------------------------------------------------------------------------------


def test_pack_verify_round_trip_and_corruption() -> None:
    raw = pack(LAYOUT, payload(1))
    assert bytes(verify(key(1), raw)) == payload(1)
    bad = bytearray(raw)
    bad[HEADER_SIZE + 10] ^= 1
    with pytest.raises(ChecksumError):
        verify(key(1), bad)
    with pytest.raises(BlockError):
        verify(key(1), raw[:-1])  # torn
    with pytest.raises(BlockError):
        verify((LAYOUT + 1, 1), raw)  # another layout


def test_key_names_round_trip() -> None:
    keys: list[tuple[int, int | bytes]] = [(1, 2**64 - 1), (0, 0), (LAYOUT, b"\x01" * 32), (2, 0xB0 << 56),
                                           (3, b"\xbb" * 8)]
    for k in keys:
        assert parse_key_name(key_name(k)) == k
    assert parse_key_name("garbage") is None
    assert key_name((1, 5)) == key_name((1, 5))


# -- DRAM --------------------------------------------------------------------------------------------------


def removals(tier: DramTier) -> list[Removed]:
    seen: list[Removed] = []
    tier.on_removed = seen.extend
    return seen


def test_dram_bound_and_lru() -> None:
    tier = DramTier(capacity=3000)
    evicted = removals(tier)
    for i in range(3):
        assert tier.store(key(i), payload(i))
    assert read(tier, key(0)) == payload(0)  # 0 becomes most recent
    assert tier.store(key(3), payload(3))
    assert [r.key for r in evicted] == [key(1)]
    assert evicted[0].block is not None and bytes(evicted[0].block.data) == payload(1)  # to move down
    assert tier.usage().used_bytes == 3000 and tier.usage().blocks == 3
    assert read(tier, key(1)) is None
    assert not tier.store(key(9), payload(9, 3001))  # bigger than the tier: refused
    assert tier.stats.refused == 1 and tier.stats.evictions == 1


def test_dram_parent_outlives_children() -> None:
    tier = DramTier(capacity=3000)
    tier.store(key(0), payload(0))
    tier.store(key(1), payload(1), parent=key(0))
    tier.store(key(10), payload(10))
    read(tier, key(10))
    read(tier, key(1))  # the chain's child is recent, its parent old: plain LRU would drop the parent
    tier.store(key(11), payload(11), parent=key(10))
    # room is made by evicting leaves only: 1's parent 0 (oldest) must stay while 1 is resident
    assert tier.contains(key(0))
    assert not tier.contains(key(1)) or not tier.contains(key(10))
    for k in tier.block_keys():
        block = tier.held(k)
        assert block is not None
        if block.parent is not None:
            assert tier.contains(block.parent)


def test_dram_chain_parent_stays_evictable_when_its_child_was_held_already() -> None:
    """A chain's block is entered as a leaf only once the next block is known not to become its child: here the
    child was held already (stored before as a chain of its own), so the parent stays a leaf, the least recently
    used one, and is what room is made from."""
    tier = DramTier(capacity=2000)
    tier.store(key(1), payload(1))
    assert tier.store_many([StoreItem(key(0), payload(0)), StoreItem(key(1), payload(1), None, key(0))]) == 2
    tier.store(key(2), payload(2))
    assert not tier.contains(key(0))
    assert tier.contains(key(1)) and tier.contains(key(2))


def test_dram_eviction_does_not_walk_past_old_parents() -> None:
    """The heads of prefixes whose rest was saved in a later step (the engine kept the head) are older than their
    children, so they pile up at the old end of the LRU order; finding the least recently used leaf must not walk
    past all of them for every block evicted (it did: 2,000 stores under pressure behind 5,000 such heads took
    18x as long as behind 5,000 leaves)."""

    def pressure_stores(heads: bool) -> float:
        tier = DramTier(capacity=20_000)
        for i in range(5_000):
            tier.store(key(i), b"x")
        for i in range(5_000):
            tier.store(key(10_000 + i), b"x", parent=key(i) if heads else None)
        for i in range(9_000):
            tier.store(key(20_000 + i), b"x")
        started = time.process_time()
        for i in range(2_000):  # each evicts one block
            tier.store(key(30_000 + i), b"x")
        if heads:  # prefix order: a head outlives its child
            assert all(tier.contains(key(i)) for i in range(5_000) if tier.contains(key(10_000 + i)))
        return time.process_time() - started

    behind_leaves = min(pressure_stores(heads=False) for _ in range(3))
    behind_heads = min(pressure_stores(heads=True) for _ in range(3))
    assert behind_heads < 4 * behind_leaves, (behind_heads, behind_leaves)


def test_dram_bound_holds_for_a_chain_longer_than_the_tier() -> None:
    """Issue 14: a chain's blocks protect their parents, so a 3,000-byte tier took a 10-block chain whole (10,000
    bytes). The chain's head stays (what a lookup can use), its tail is refused (the store moves it below)."""
    tier = DramTier(capacity=3000)
    evicted = removals(tier)
    tier.store(key(100), payload(100))  # an unrelated block goes first
    held = tier.store_many([StoreItem(key(i), payload(i), None, key(i - 1) if i else None) for i in range(10)])
    assert held == 3 and tier.usage().used_bytes == 3000
    assert [r.key for r in evicted] == [key(100)]
    assert all(tier.contains(key(i)) for i in range(3)) and not tier.contains(key(3))
    assert tier.stats.refused == 7


def test_dram_delete_is_constant_time() -> None:
    """Deleting a block looked through every resident block for its children (O(n) each, O(n^2) for n)."""

    def delete_all(n: int) -> float:
        tier = DramTier(capacity=10 * n)
        tier.store_many([StoreItem(key(i), b"x", None, key(i - 1) if i % 4 else None) for i in range(n)])
        started = time.process_time()
        for i in range(0, n, 2):  # parents and children, every other block
            tier.delete(key(i))
        elapsed = time.process_time() - started
        assert tier.usage().blocks == n // 2
        tier.store_many([StoreItem(key(i), b"x") for i in range(0, n, 2)])  # stored again: counts nothing
        for i in range(n):
            tier.delete(key(i))
        assert tier.usage() == TierUsage(0, 0, 10 * n)
        return elapsed

    import gc

    gc.disable()  # a collection inside one timing is not what is measured
    try:
        small = min(delete_all(2_000) for _ in range(5))
        large = min(delete_all(40_000) for _ in range(3))
    finally:
        gc.enable()
    assert large < 150 * small, (large, small)  # linear: ~20x; quadratic: ~400x


def test_dram_watermarks() -> None:
    tier = DramTier(capacity=10_000, high_watermark=0.8, low_watermark=0.5)
    evicted = removals(tier)
    for i in range(9):
        tier.store(key(i), payload(i))
    assert tier.above_high_watermark() and evicted == []
    tier.evict_to_low_watermark()
    assert len(evicted) == 4 and tier.usage().used_bytes == 5000
    assert [r.key for r in evicted] == [key(i) for i in range(4)]
    assert tier.delete(key(8)) and evicted[-1] == Removed(key(8))  # a deleted block is reported, without bytes


# -- NVMe --------------------------------------------------------------------------------------------------


def test_nvme_store_read_and_restart(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity=1 << 20, fsync=False)
    for i in range(5):
        assert tier.store(key(i), payload(i))
    used = tier.usage()
    assert used.blocks == 5 and used.used_bytes == 5 * (HEADER_SIZE + 1000)
    (tmp_path / "tmp" / "leftover.tmp").write_bytes(b"half a block")
    again = NvmeTier(tmp_path, capacity=1 << 20, fsync=False)
    assert again.usage() == used
    assert list(os.scandir(tmp_path / "tmp")) == []
    assert read(again, key(3)) == payload(3)
    assert read(again, key(7)) is None


@pytest.mark.parametrize("layout", ["segments", "files"])
def test_nvme_tiers_hold_a_block_per_entry_floor_of_capacity_at_most(tmp_path: Path, layout: str) -> None:
    """Each block costs the agent an index entry in RAM that its disk bytes do not count: empty blocks (48-byte
    records, 32-byte files) were all held in a 64 KiB tier, 1,000 of them (up to 1,365 / 2,048 would have been). It
    holds capacity // INDEX_ENTRY_FLOOR at most, the newest (the oldest segments or files go), a segment an eighth
    of them; after a restart with a smaller capacity, as many as that one allows."""
    def tier(capacity: int) -> NvmeTier | SegmentNvmeTier:
        if layout == "segments":
            return SegmentNvmeTier(tmp_path, capacity=capacity, fsync=False)
        return NvmeTier(tmp_path, capacity=capacity, fsync=False)

    first = tier(64 * 1024)
    most = 64 * 1024 // INDEX_ENTRY_FLOOR
    for i in range(1000):
        assert first.store(key(i), b"")
        assert 0 < first.usage().blocks <= most
    held = [i for i in range(1000) if first.contains(key(i))]
    assert len(held) == first.usage().blocks and 999 in held and min(held) >= 1000 - most
    first.close()
    again = tier(32 * 1024)
    assert 0 < again.usage().blocks <= most // 2
    assert layout == "files" or again.contains(key(999))  # (files: their mtimes, the order on restart, may tie)


class _SharedTierAStoreLandsIn(FsSharedTier):
    """The shared tier on a directory, where `land` runs as the first write comes in: a client's store landing on
    the NVMe tier while the upkeep demotes to this one, between the NVMe tier's demotion_candidates and its
    eviction (the window of the race, here at a set point of it)."""

    def __init__(self, directory: Path, land: Callable[[], object] | None = None) -> None:
        super().__init__(directory)
        self.land = land

    def store_many(self, items: Sequence[StoreItem]) -> int:
        land, self.land = self.land, None
        if land is not None:
            land()
        return super().store_many(items)


@pytest.mark.parametrize("layout", ["segments", "files"])
def test_a_store_during_demotion_leaves_the_nvme_eviction_to_the_blocks_offered(tmp_path: Path, layout: str) -> None:
    """The upkeep demotes what the NVMe tier offers (demotion_candidates), then evicts down to the low watermark.
    A store that landed in between raised the usage, and the eviction dropped blocks past those offered, never
    copied down: lazy, they were lost from every tier though the shared tier had room (at main: files, the 4 least
    recently used blocks after the 17 offered; segments, the oldest segment after the 5 offered, its 4 blocks).
    Now the eviction drops only blocks offered, and what is then over the low watermark is offered in turn."""
    record = HEADER_SIZE + 1000 + (16 if layout == "segments" else 0)  # (a segment's record adds key and digest)
    directory = tmp_path / "nvme"
    nvme: NvmeTier | SegmentNvmeTier = (
        SegmentNvmeTier(directory, capacity=40 * record, high_watermark=0.8, low_watermark=0.4, fsync=False,
                        segment_bytes=4 * record, entry_floor=0) if layout == "segments" else
        NvmeTier(directory, capacity=40 * record, high_watermark=0.8, low_watermark=0.4, fsync=False, entry_floor=0))
    shared = _SharedTierAStoreLandsIn(tmp_path / "shared")
    store = TierStore(AgentConfig(write_policy="lazy"), nvme=nvme, shared=shared)
    try:
        assert store.store_chain(LAYOUT, list(range(33)), [payload(i) for i in range(33)]) == 33
        assert nvme.usage().blocks == 33 and nvme.above_high_watermark()
        offered = {k for k, _size in nvme.demotion_candidates()}
        shared.land = lambda: store.store_chain(LAYOUT, list(range(33, 37)), [payload(i) for i in range(33, 37)])
        store.maintain()
        assert shared.land is None  # (it landed)
        lost = [i for i in range(37) if not nvme.contains(key(i)) and not shared.contains(key(i))]
        assert lost == [], f"lost from every tier: {lost} ({len(offered)} offered)"
        assert not any(nvme.contains(k) for k in offered)  # what was offered went
        assert nvme.usage().used_bytes <= nvme.low_bytes  # and what was over the low watermark after it, offered
        for i in range(37):
            assert read(nvme, key(i)) == payload(i) or read(shared, key(i)) == payload(i)
    finally:
        store.close()
        nvme.close()
        shared.close()


def test_nvme_external_deletion_and_corruption_are_misses(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity=1 << 20, fsync=False)
    for i in range(4):
        tier.store(key(i), payload(i))
    files = {p.name: p for p in (tmp_path / "blocks").rglob("*") if p.is_file()}
    with files[key_name(key(3))].open("ab") as f:
        f.write(b"trailing junk")  # longer than its header says
    files[key_name(key(0))].unlink()
    path1 = files[key_name(key(1))]
    data = bytearray(path1.read_bytes())
    data[HEADER_SIZE + 5] ^= 0xFF
    path1.write_bytes(data)
    files[key_name(key(2))].write_bytes(data[: HEADER_SIZE + 10])  # truncated
    assert read(tier, key(0)) is None
    assert read(tier, key(1)) is None
    assert read(tier, key(2)) is None
    assert read(tier, key(3)) is None
    assert tier.stats.checksum_failures == 1 and tier.stats.read_errors == 2
    assert tier.usage().blocks == 0 and tier.usage().used_bytes == 0
    assert not path1.exists()  # a corrupt block is removed, not served again


def test_nvme_byte_bound_evicts_lru(tmp_path: Path) -> None:
    size = HEADER_SIZE + 1000
    tier = NvmeTier(tmp_path, capacity=3 * size, fsync=False)
    for i in range(3):
        tier.store(key(i), payload(i))
    read(tier, key(0))
    assert tier.store(key(3), payload(3))
    assert not tier.contains(key(1)) and tier.contains(key(0))
    assert tier.usage().used_bytes == 3 * size
    on_disk = sum(p.stat().st_size for p in (tmp_path / "blocks").rglob("*") if p.is_file())
    assert on_disk == 3 * size
    assert not tier.store(key(9), payload(9, 4 * size))


DISK_FULL_SCRIPT = """
import resource, signal, sys
from agent.tiers.nvme import NvmeTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
tier = NvmeTier(sys.argv[1], capacity=1 << 30, fsync=False)
assert tier.store((1, 1), b"x" * 1000)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the "disk" takes no file over 4 KiB now
ok = tier.store((1, 2), b"y" * 100_000)
small = tier.store((1, 3), b"z" * 100)
u = tier.usage()
print(ok, small, u.blocks, u.used_bytes, tier.stats.backend_errors)
"""


def test_what_is_no_block_in_the_nvme_directory_is_left_alone_at_restart(tmp_path: Path) -> None:
    """A FIFO named like a segment made the restart's scan wait for a writer forever (the agent never started); a
    directory named like a segment was counted as one and its eviction raised at every upkeep; a directory in the
    files layout's tmp/ or shards made the restart raise (the agent did not start)."""
    import threading

    segments = tmp_path / "seg" / "segments"
    segments.mkdir(parents=True)
    os.mkfifo(segments / f"{1:016x}.seg")
    (segments / f"{2:016x}.seg").mkdir()
    files = tmp_path / "files"
    (files / "tmp" / "a-directory.tmp").mkdir(parents=True)
    (files / "blocks" / "ab" / "a-directory").mkdir(parents=True)
    made: list[object] = []

    def restart() -> None:
        made.append(SegmentNvmeTier(tmp_path / "seg", capacity=2**20, fsync=False, segment_bytes=2**16))
        made.append(NvmeTier(files, capacity=2**20, fsync=False))

    starting = threading.Thread(target=restart, daemon=True)
    starting.start()
    starting.join(10)
    if starting.is_alive():  # release the hung scan before failing
        os.close(os.open(segments / f"{1:016x}.seg", os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError("the restart hung on a FIFO named like a segment")
    assert len(made) == 2, "a tier did not start"
    for tier in made:
        assert isinstance(tier, SegmentNvmeTier | NvmeTier)
        assert tier.usage().used_bytes == 0
        for i in range(40):  # 40 KB into 1 MiB: no eviction needed; then past the bound, evicting
            assert tier.store(key(i), payload(i, 60_000))
        assert read(tier, key(39), size=60_000) == payload(39, 60_000)
        tier.evict_to_low_watermark()
        assert tier.usage().used_bytes <= 2**20
    assert (segments / f"{2:016x}.seg").is_dir() and (files / "blocks" / "ab" / "a-directory").is_dir()


def test_disk_space_reserve(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    roomy = DiskSpace(str(tmp_path), min_free=0)
    assert roomy.take(1000) and roomy.take(1000)
    tight = DiskSpace(str(tmp_path), min_free=free - 10_000)  # room for about 10 kB more
    assert tight.take(4000) and tight.take(4000)
    assert not tight.take(4000)  # debited by our own writes, not only by the last statvfs
    assert not DiskSpace(str(tmp_path / "missing"), min_free=0).take(1)
    for tier in (NvmeTier(tmp_path / "files", capacity=1 << 20, fsync=False, min_free=free * 2),
                 SegmentNvmeTier(tmp_path / "segments", capacity=1 << 24, fsync=False, min_free=free * 2)):
        assert not tier.store(key(1), payload(1))  # the reserve is never written into
        assert tier.stats.refused + tier.stats.backend_errors >= 1 and read(tier, key(1)) is None


def test_nvme_disk_full_refuses_without_crashing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", DISK_FULL_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    ok, small, blocks, used, errors = out.stdout.split()
    assert ok == "False" and small == "True"
    assert int(errors) >= 1
    # the refused block left no file and no usage; the eviction to make room may have dropped block 1
    files = [p for p in (tmp_path / "blocks").rglob("*") if p.is_file()]
    assert int(blocks) == len(files)
    assert int(used) == sum(p.stat().st_size for p in files)
    assert list((tmp_path / "tmp").iterdir()) == []


# -- shared: Redis/Valkey ----------------------------------------------------------------------------------


def test_redis_shared_round_trip_across_replicas(valkey: ValkeyServer) -> None:
    a = RedisSharedTier(valkey.url, ttl_s=60)
    b = RedisSharedTier(valkey.url, ttl_s=60)
    assert a.store_many([StoreItem(key(i), payload(i)) for i in range(4)]) == 4
    assert not b.contains(key(0))  # b never asked: its local index does not know yet
    assert b.probe([key(0), key(9)]) == [True, False]
    assert b.contains(key(0))
    assert b.refresh_index() == 4 and all(b.contains(key(i)) for i in range(4))
    outs = [memoryview(bytearray(2000)) for _ in range(3)]
    assert b.read_many([key(0), key(1), key(9)], outs) == [1000, 1000, None]
    assert bytes(outs[1][:1000]) == payload(1)
    raw = redis.Redis.from_url(valkey.url)
    assert raw.ttl(f"kvgate:{key_name(key(0))}") > 50
    a.close()
    b.close()


def test_the_shared_index_remembers_index_blocks_at_most(valkey: ValkeyServer) -> None:
    """Another replica's writes enter every agent's index (announced) and left it only when their TTL ran out: a
    fleet storing empty blocks grew every agent's index without bound (~260-310 bytes of RAM an entry,
    agent.tiers.shared.INDEX_BLOCKS). Past `index_blocks` the entries that expire soonest are forgotten, counted as
    evictions and reported removed; the newest stay, and a forgotten block the backend holds is learned again by a
    probe."""
    writer = RedisSharedTier(valkey.url, ttl_s=60)
    tier = RedisSharedTier(valkey.url, ttl_s=60, index_blocks=100)
    removed: list[Removed] = []
    tier.on_removed = removed.extend
    tier.listen()
    try:
        assert tier.wait_subscribed(5)
        for start in range(0, 1000, 100):
            assert writer.store_many([StoreItem(key(i), b"") for i in range(start, start + 100)]) == 100
        deadline = time.monotonic() + 10
        while not tier.contains(key(999)):  # the last write is learned from its announcement
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert tier.usage().blocks <= 100 and tier.contains(key(999)) and not tier.contains(key(0))
        assert tier.stats.evictions == len(removed) >= 900 and Removed(key(0)) in removed
        assert tier.probe([key(0)]) == [True] and tier.contains(key(0)) and tier.usage().blocks <= 100
    finally:
        tier.close()
        writer.close()


def test_announcements_of_blocks_the_backend_does_not_hold_are_dropped_and_counted(valkey: ValkeyServer) -> None:
    """Anyone who could PUBLISH on the block channel could put any name in every agent's index (and so in every
    gateway's picture of the shared tier: lookups answered "S" for blocks no one wrote, loads of them missed), and
    take real blocks out of it with a `-name`. An announcement is checked now: a message that is not a list of
    block names, a name that is not a block's (or of a hash longer than any request may name) is dropped; the
    names left are confirmed with the backend (one pipelined EXISTS per announcement): a written block is learned,
    a deleted one forgotten, and any other is dropped. Every drop is counted."""
    writer = RedisSharedTier(valkey.url, ttl_s=60)
    tier = RedisSharedTier(valkey.url, ttl_s=60)
    tier.listen()
    try:
        assert tier.wait_subscribed(5)
        assert writer.store(key(1), payload(1))
        deadline = time.monotonic() + 10
        while not tier.contains(key(1)):  # a real write is learned from its announcement
            assert time.monotonic() < deadline
            time.sleep(0.02)
        raw = redis.Redis.from_url(valkey.url)
        forged = [key_name(key(i)) for i in range(100, 110)]
        hostile: list[bytes | str] = [
            "+" + " ".join(forged),  # well-formed names of blocks no one wrote
            "-" + key_name(key(1)),  # a real block said to be gone
            "+" + key_name((LAYOUT, b"\x01" * 65)),  # a hash longer than any request may name
            "+not-a-block 0123",  # not block names
            "hello",  # no + or -
            b"+\xff\xfe",  # not UTF-8
        ]
        for message in hostile:
            raw.publish(tier.channel, message)
        assert writer.store(key(2), payload(2))  # announced after them: once it is learned, they were handled
        deadline = time.monotonic() + 10
        while not tier.contains(key(2)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not any(tier.contains(key(i)) for i in range(100, 110))
        assert not tier.contains((LAYOUT, b"\x01" * 65))
        assert tier.contains(key(1)) and read(tier, key(1)) == payload(1)
        assert tier.stats.dropped_announcements == 10 + 1 + 1 + 2 + 1 + 1, tier.stats
        writer.delete(key(2))  # a real deletion is still followed
        deadline = time.monotonic() + 10
        while tier.contains(key(2)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        writer.close()
        tier.close()


class CountingRedisTier(RedisSharedTier):
    """A Redis shared tier that counts its EXISTS round trips and keyspace scans (one per subscription)."""

    exists_round_trips = 0
    scans = 0

    def _exists_many(self, keys: list[BlockKey]) -> list[bool]:
        self.exists_round_trips += 1
        return super()._exists_many(keys)

    def _list_keys(self) -> Iterator[BlockKey]:
        self.scans += 1
        yield from super()._list_keys()


def handled(tier: RedisSharedTier, dropped: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while tier.stats.dropped_announcements < dropped:
        assert time.monotonic() < deadline, tier.stats
        time.sleep(0.01)


def test_waiting_announcements_are_confirmed_together(valkey: ValkeyServer) -> None:
    """The listener confirmed each message with an EXISTS round trip of its own: 2000 messages waiting cost 2000
    round trips. The messages waiting are taken together now, their distinct names confirmed with one pipelined
    EXISTS per batch."""
    tier = CountingRedisTier(valkey.url, ttl_s=60)
    tier.listen()
    try:
        assert tier.wait_subscribed(5)
        raw = redis.Redis.from_url(valkey.url)
        pipe = raw.pipeline(transaction=False)
        for i in range(2000):  # forged names: each is confirmed absent and dropped, so each is counted once
            pipe.publish(tier.channel, f"+{key_name(key(10_000 + i % 500))} {key_name(key(20_000 + i))}")
        pipe.execute()
        handled(tier, 4000)
        assert tier.stats.dropped_announcements == 4000
        assert tier.exists_round_trips <= 2000 // 10, tier.exists_round_trips
    finally:
        tier.close()


def test_a_batch_of_announcements_ends_as_the_backend_holds_each_block(valkey: ValkeyServer) -> None:
    """Announcements confirmed together are confirmed after the last of them arrived: whatever order `+x` and `-x`
    came in, x ends learned if the backend holds it and forgotten if not; what the backend contradicts is counted."""
    writer = RedisSharedTier(valkey.url, ttl_s=60)
    tier = RedisSharedTier(valkey.url, ttl_s=60)
    tier.listen()
    try:
        assert tier.wait_subscribed(5)
        assert writer.store_many([StoreItem(key(i), payload(i)) for i in (1, 2, 3)]) == 3
        deadline = time.monotonic() + 10
        while not all(tier.contains(key(i)) for i in (1, 2, 3)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        raw = redis.Redis.from_url(valkey.url)
        raw.delete(f"kvgate:{key_name(key(2))}")  # gone without a word: its `+` below is a lie, its `-` the truth
        a, b, c, d = (key_name(key(i)) for i in (1, 2, 3, 4))
        pipe = raw.pipeline(transaction=False)
        for message in (f"+{a}", f"-{a}",  # held: learned, the `-` dropped
                        f"+{b}", f"-{b}",  # not held: forgotten, the `+` dropped
                        f"-{c}", f"+{c} {c}",  # held, whatever the order (a name twice counts twice)
                        f"+{d}", f"-{d}"):  # never written: not learned, the `-` of something unknown is no news
            pipe.publish(tier.channel, message)
        pipe.execute()
        handled(tier, 4)
        time.sleep(0.2)  # nothing more is dropped
        assert tier.stats.dropped_announcements == 4, tier.stats
        assert tier.contains(key(1)) and not tier.contains(key(2)) and tier.contains(key(3))
        assert not tier.contains(key(4))
    finally:
        writer.close()
        tier.close()


def test_an_announcement_flood_does_not_cut_the_subscription_off(valkey: ValkeyServer) -> None:
    """Anyone who may PUBLISH on the block channel (or many agents writing small chains) could publish faster than
    one EXISTS round trip per message drained: the server's pub/sub output buffer for the listener grew to its limit
    and the server disconnected it, again and again, every subscription starting with a scan of the keyspace. At
    4500 messages a second of 32 names (one message repeated, as a flood does) the listener kept up with about
    2300 before (a disconnect within two seconds at this limit), 12000 after, on a 2-core machine."""
    tier = CountingRedisTier(valkey.url, ttl_s=60, retry_s=0.2)
    raw = redis.Redis.from_url(valkey.url)
    raw.config_set("client-output-buffer-limit", "pubsub 1mb 512kb 5")
    tier.listen()
    try:
        assert tier.wait_subscribed(5)
        message = "+" + " ".join(key_name(key(30_000 + i)) for i in range(32))
        rate, seconds, burst = 4500, 4.0, 100
        sent = 0

        def flood() -> None:
            nonlocal sent
            publisher = redis.Redis.from_url(valkey.url)
            start = time.monotonic()
            while time.monotonic() < start + seconds:
                pipe = publisher.pipeline(transaction=False)
                for _ in range(burst):
                    pipe.publish(tier.channel, message)
                pipe.execute()
                sent += burst
                ahead = start + sent / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)

        publisher = threading.Thread(target=flood, daemon=True)
        publisher.start()
        publisher.join(seconds + 10)
        assert not publisher.is_alive()
        deadline = time.monotonic() + 20  # (a message the server dropped with the connection is never handled)
        while tier.stats.dropped_announcements < 32 * sent and not tier.stats.backend_errors:
            assert time.monotonic() < deadline, tier.stats
            time.sleep(0.01)
        assert raw.info("stats")["client_output_buffer_limit_disconnections"] == 0
        assert (tier.scans, tier.stats.backend_errors) == (1, 0)
        assert tier.stats.dropped_announcements == 32 * sent
    finally:
        tier.close()


def test_redis_shared_ttl_and_corruption(valkey: ValkeyServer) -> None:
    tier = RedisSharedTier(valkey.url, ttl_s=0.3)
    tier.store(key(1), payload(1))
    tier.store(key(2), payload(2))
    raw = redis.Redis.from_url(valkey.url)
    name = f"kvgate:{key_name(key(2))}"
    stored = raw.get(name)
    assert isinstance(stored, bytes)
    value = bytearray(stored)
    value[-1] ^= 1
    raw.set(name, bytes(value), keepttl=True)
    assert read(tier, key(2)) is None
    assert tier.stats.checksum_failures == 1 and not raw.exists(name)
    time.sleep(0.4)
    assert not tier.contains(key(1))
    assert read(tier, key(1)) is None and not raw.exists(f"kvgate:{key_name(key(1))}")
    tier.close()


def test_redis_blocks_are_written_whole_with_their_ttl(valkey: ValkeyServer) -> None:
    tier = RedisSharedTier(valkey.url, ttl_s=60)
    raw = redis.Redis.from_url(valkey.url)
    tier.store(key(6), payload(6))
    assert raw.get(f"kvgate:{key_name(key(6))}") == pack(LAYOUT, payload(6))  # header + payload, one string
    big = payload(7, 300 * 1024)  # two strings, each SET with its TTL: the header, and the payload as it is
    assert tier.store(key(7), memoryview(bytearray(big)))
    name = f"kvgate:{key_name(key(7))}"
    assert raw.get(name) == pack(LAYOUT, big)[:HEADER_SIZE] and raw.get(name + ":p") == big
    assert raw.pttl(name) > 50_000 and raw.pttl(name + ":p") > 50_000
    out = memoryview(bytearray(len(big)))
    assert tier.read_many([key(7)], [out]) == [len(big)] and bytes(out) == big
    raw.set(name + ":p", payload(8, 300 * 1024), keepttl=True)  # a payload that is not the header's
    assert tier.read_many([key(7)], [out]) == [None] and tier.stats.checksum_failures == 1
    assert not raw.exists(name) and not raw.exists(name + ":p")
    tier.close()


def test_redis_writes_never_leave_a_key_without_ttl(valkey: ValkeyServer) -> None:
    """Issue 14: SET (with PX) then SETRANGE in a pipeline; a key that expired in between was created again by
    SETRANGE, without a TTL, and lived forever."""
    tier = RedisSharedTier(valkey.url, ttl_s=0.001)  # expires while the payload is still on its way
    raw = redis.Redis.from_url(valkey.url)
    big = payload(1, 2 * 2**20)
    for chain in range(20):
        tier.store_many([StoreItem(key(chain * 4 + i), memoryview(big)) for i in range(4)])
    time.sleep(0.05)
    immortal = [name for name in raw.scan_iter("kvgate:*") if raw.pttl(name) == -1]
    assert immortal == [], f"{len(immortal)} keys without TTL"
    tier.close()


def test_redis_down_is_counted_and_recovers(valkey: ValkeyServer) -> None:
    tier = RedisSharedTier(valkey.url, ttl_s=60, timeout_s=0.3, retry_s=0.2)
    assert tier.store(key(1), payload(1))
    valkey.stop()
    assert read(tier, key(1)) is None
    assert not tier.store(key(2), payload(2))
    assert tier.stats.backend_errors >= 1
    valkey.start()
    time.sleep(0.3)
    assert tier.store(key(3), payload(3))  # reconnected (the old data is gone: no persistence)
    assert read(tier, key(3)) == payload(3)
    tier.close()


def test_shared_blocks_need_the_fleet_secret(valkey: ValkeyServer, tmp_path: Path) -> None:
    """Issue 14: an unkeyed checksum let anyone who can write Valkey plant KV that is served as a valid hit."""
    fleet = RedisSharedTier(valkey.url, ttl_s=60, secret=b"fleet secret")
    other = RedisSharedTier(valkey.url, ttl_s=60, secret=b"another fleet")
    raw = redis.Redis.from_url(valkey.url)
    assert fleet.store(key(1), payload(1))
    assert read(fleet, key(1)) == payload(1)
    stored = raw.get(f"kvgate:{key_name(key(1))}")
    assert isinstance(stored, bytes) and len(stored) == HEADER_SIZE + 16 + 1000
    # a planted block with a valid (unkeyed) header and checksum, as the tier wrote them before
    raw.set(f"kvgate:{key_name(key(2))}", pack(LAYOUT, payload(99)), px=60_000)
    # a sealed block whose payload was swapped (the tag no longer matches)
    raw.set(f"kvgate:{key_name(key(3))}", stored[: HEADER_SIZE + 16] + payload(98), px=60_000)
    # a genuine block copied under another block's name
    raw.set(f"kvgate:{key_name(key(4))}", stored, px=60_000)
    assert fleet.probe([key(2), key(3), key(4)]) == [True, True, True]
    assert fleet.read_many([key(2), key(3), key(4)], [memoryview(bytearray(2000)) for _ in range(3)]) == [None] * 3
    assert fleet.stats.checksum_failures == 3
    assert not any(raw.exists(f"kvgate:{key_name(key(i))}") for i in (2, 3, 4))  # deleted
    assert read(other, key(1)) is None  # another secret: refused too
    unkeyed = FsSharedTier(tmp_path, ttl_s=60)
    keyed = FsSharedTier(tmp_path, ttl_s=60, secret=b"fleet secret")
    assert unkeyed.store(key(5), payload(5)) and keyed.store(key(6), payload(6))
    assert keyed.refresh_index() == 2
    assert read(keyed, key(5)) is None and read(keyed, key(6)) == payload(6)
    for tier in (fleet, other):
        tier.close()


def test_a_key_of_another_type_is_one_bad_block_not_the_backend_down(valkey: ValkeyServer) -> None:
    """A hash or list under a block's name (another program's key, a hostile one) answered WRONGTYPE: the fetch
    raised, so the tier counted the backend down for retry_s (every block a miss, lookups counting none) and kept
    the name in its index, to fail again at its next load; it is one unreadable block now, deleted."""
    tier = RedisSharedTier(valkey.url, ttl_s=60, retry_s=30)
    raw = redis.Redis.from_url(valkey.url)
    assert tier.store_many([StoreItem(key(i), payload(i)) for i in range(3)]) == 3
    big = payload(9, 300 * 1024)
    assert tier.store(key(9), memoryview(bytearray(big)))
    name = f"kvgate:{key_name(key(1))}"
    raw.delete(name)
    raw.hset(name, "field", "value")
    raw.delete(f"kvgate:{key_name(key(9))}:p")  # a split block whose payload's string is a list
    raw.rpush(f"kvgate:{key_name(key(9))}:p", "item")
    outs = [memoryview(bytearray(len(big))) for _ in range(4)]
    for fetch in ("direct", "pipelined"):
        if fetch == "pipelined":  # the path a reply the direct one does not take goes (a cluster's redirection)
            raw.hset(name, "field", "value")
            assert tier.store(key(9), memoryview(bytearray(big)))
            raw.delete(f"kvgate:{key_name(key(9))}:p")
            raw.rpush(f"kvgate:{key_name(key(9))}:p", "item")
            keys: list[BlockKey] = [key(0), key(1), key(2), key(9)]
            found = tier._fetch_pipelined(keys, [tier._name(k) for k in keys], outs)
            assert [type(r) for r in found] == [int, BlockError, int, BlockError]
            continue
        assert tier.read_many([key(0), key(1), key(2), key(9)], outs) == [1000, None, 1000, None]
        assert bytes(outs[2][:1000]) == payload(2)
        assert tier.available and tier.stats.backend_errors == 0 and tier.stats.read_errors == 2
        assert not tier.contains(key(1)) and not raw.exists(name)  # the foreign key went with its block
        assert not raw.exists(f"kvgate:{key_name(key(9))}") and not raw.exists(f"kvgate:{key_name(key(9))}:p")
        assert read(tier, key(0)) == payload(0)
    tier.close()


def test_a_key_name_that_is_not_utf8_is_no_block(valkey: ValkeyServer) -> None:
    """A key under the prefix whose name is not UTF-8 made the keyspace scan raise: the subscription (which scans
    first) failed and was tried again forever, so the tier counted itself down for good, and every index refresh
    failed too."""
    raw = redis.Redis.from_url(valkey.url)
    raw.set(b"kvgate:\xff\xfe-not-a-block", b"junk")
    writer = RedisSharedTier(valkey.url, ttl_s=60)
    assert writer.store(key(1), payload(1))
    tier = RedisSharedTier(valkey.url, ttl_s=60, retry_s=0.2)
    tier.listen()
    assert tier.wait_subscribed(5) and tier.available and tier.contains(key(1))
    assert tier.refresh_index() == 1 and tier.stats.backend_errors == 0
    assert read(tier, key(1)) == payload(1)
    for t in (writer, tier):
        t.close()


def test_a_refused_write_does_not_switch_off_reads(tmp_path: Path) -> None:
    """Issue 14: any error, an OOM answer to a write too, made the tier skip reads for retry_s."""
    port = free_port()
    server = spawn_valkey(port, str(tmp_path), 15.0, "--maxmemory-policy", "noeviction")
    try:
        url = f"redis://127.0.0.1:{port}/0"
        tier = RedisSharedTier(url, ttl_s=60, retry_s=30)
        assert tier.store(key(1), payload(1))
        raw = redis.Redis.from_url(url)
        raw.config_set("maxmemory", "1")  # below what is used: every write is refused (OOM)
        assert not tier.store(key(2), payload(2, 300 * 1024))
        assert not tier.store(key(3), payload(3))
        assert tier.stats.backend_errors == 1
        assert tier.available and read(tier, key(1)) == payload(1)
        assert not raw.exists(f"kvgate:{key_name(key(2))}")
        tier.close()
    finally:
        stop_process(server)


def test_lookups_count_no_shared_blocks_while_redis_is_down(valkey: ValkeyServer, tmp_path: Path) -> None:
    """Issue 14: lookups answered from the index while Redis was down, so vLLM planned loads that could only fail."""
    config = AgentConfig(dram_capacity=0, shared_backend="redis", shared_url=valkey.url, shared_timeout_s=0.3,
                         shared_retry_s=0.3).validate()
    store = TierStore.from_config(config)
    shared = store.shared
    assert isinstance(shared, RedisSharedTier)
    shared.listen()
    assert shared.wait_subscribed(5)
    assert store.store_chain(LAYOUT, [1, 2, 3], [payload(i) for i in (1, 2, 3)]) == 3
    assert store.lookup(LAYOUT, [1, 2, 3]) == (3, "SSS")
    valkey.stop()
    deadline = time.monotonic() + 3
    while store.lookup(LAYOUT, [1, 2, 3]) != (0, ""):
        assert time.monotonic() < deadline, "lookups still count shared blocks with Redis down"
        time.sleep(0.05)
    for _ in range(10):  # and keep not counting them while it stays down
        assert store.lookup(LAYOUT, [1, 2, 3]) == (0, "")
        time.sleep(0.1)
    valkey.start()
    assert shared.wait_subscribed(10)  # back, and its keyspace learnt again (empty: no persistence)
    assert store.store_chain(LAYOUT, [4], [payload(4)]) == 1
    assert store.lookup(LAYOUT, [4]) == (1, "S")
    store.close()


# -- shared: POSIX directory -------------------------------------------------------------------------------


def test_fs_shared_round_trip_ttl_sweep(tmp_path: Path) -> None:
    a = FsSharedTier(tmp_path, ttl_s=60)
    b = FsSharedTier(tmp_path, ttl_s=60)
    assert a.store_many([StoreItem(key(i), payload(i)) for i in range(3)]) == 3
    assert b.refresh_index() == 3
    assert read(b, key(2)) == payload(2)
    old = time.time() - 120
    path = tmp_path / "kvgate" / key_name(key(0))[-2:] / key_name(key(0))
    os.utime(path, (old, old))
    assert read(b, key(0)) is None  # expired by mtime even before the sweep
    assert b.sweep() == 1 and not path.exists()
    corrupt = tmp_path / "kvgate" / key_name(key(1))[-2:] / key_name(key(1))
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 1
    corrupt.write_bytes(data)
    assert read(b, key(1)) is None and b.stats.checksum_failures == 1 and not corrupt.exists()


SHARED_DISK_FULL_SCRIPT = """
import resource, signal, sys
from agent.tiers.shared import FsSharedTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
tier = FsSharedTier(sys.argv[1], ttl_s=60, retry_s=30)
assert tier.store((1, 1), b"x" * 1000)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the "disk" takes no file over 4 KiB now
refused = tier.store((1, 2), b"y" * 100_000)
out = memoryview(bytearray(2000))
print(refused, tier.available, tier.read_into((1, 1), out), tier.stats.backend_errors)
"""


def test_what_holds_a_blocks_place_in_the_shared_directory_costs_that_block_only(tmp_path: Path) -> None:
    """A directory where a block's file goes, a file where a shard's directory goes, a full disk: each write error
    counted the whole directory down for retry_s (reads too: every block a miss); deleting a directory under a
    block's name (after reading it failed) did the same; a sweep ended at the first entry it could not delete,
    leaving every expired block after it on the disk."""
    tier = FsSharedTier(tmp_path, ttl_s=60, retry_s=30)
    root = tmp_path / "kvgate"

    def place(i: int) -> Path:
        return root / key_name(key(i))[-2:] / key_name(key(i))

    assert tier.store(key(1), payload(1))
    place(2).mkdir(parents=True)  # a directory under block 2's name
    (place(2) / "inside").write_bytes(b"z")
    shard3 = place(3).parent
    shard3.write_bytes(b"a file where block 3's shard directory goes")
    assert tier.store_many([StoreItem(key(i), payload(i)) for i in (2, 3, 4)]) == 1
    assert tier.available and tier.stats.backend_errors == 0 and tier.stats.refused == 2
    assert read(tier, key(4)) == payload(4) and read(tier, key(1)) == payload(1)
    assert not tier.contains(key(2)) and not tier.contains(key(3))
    assert tier.refresh_index() == 2  # a directory is no block
    tier.learn([key(2)])  # announced all the same: reading it fails, deleting it too; the tier stays up
    assert read(tier, key(2), size=1 << 20) is None
    assert tier.available and tier.stats.backend_errors == 0 and place(2).is_dir()
    assert read(tier, key(1)) == payload(1)
    old = time.time() - 7200
    (root / "tmp" / "a-directory.tmp").mkdir()
    os.utime(root / "tmp" / "a-directory.tmp", (old, old))
    for path in (place(2), place(1), place(4)):
        os.utime(path, (old, old))
    assert tier.sweep() == 2  # blocks 1 and 4 went, past the directories it cannot unlink
    assert not place(1).exists() and not place(4).exists() and place(2).is_dir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SHARED_DISK_FULL_SCRIPT, str(tmp_path / "full")], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "1000", "1"]  # refused, reads go on


def test_a_probe_past_a_file_where_a_shard_goes_is_a_miss(tmp_path: Path) -> None:
    """Asking whether a block exists when a file holds its shard directory's name raised NotADirectoryError: the
    probe (every lookup of blocks not yet known) counted the directory down for retry_s."""
    tier = FsSharedTier(tmp_path, ttl_s=60, retry_s=30)
    assert tier.store(key(1), payload(1))
    shard = tmp_path / "kvgate" / key_name(key(3))[-2:]
    shard.write_bytes(b"a file where block 3's shard directory goes")
    assert tier.probe([key(1), key(3)]) == [True, False]
    assert tier.available and tier.stats.backend_errors == 0 and read(tier, key(1)) == payload(1)


def test_a_symlink_in_the_shared_directory_leads_nothing_outside_it(tmp_path: Path) -> None:
    """Whoever can write the shared directory could replace a shard (or tmp/) by a symlink to any directory the
    agent may write: the sweep then deleted every file there older than the TTL, and blocks were written there."""
    victim = tmp_path / "victim"
    victim.mkdir()
    precious = victim / "precious.txt"
    precious.write_text("keep me")
    old = time.time() - 7200
    os.utime(precious, (old, old))
    tier = FsSharedTier(tmp_path / "shared", ttl_s=60, retry_s=30)
    root = tmp_path / "shared" / "kvgate"
    (root / key_name(key(3))[-2:]).symlink_to(victim)
    assert tier.sweep() == 0 and precious.exists()
    assert tier.store_many([StoreItem(key(i), payload(i)) for i in (1, 3)]) == 1
    assert os.listdir(victim) == ["precious.txt"] and tier.available
    (root / "tmp").rename(root / "old-tmp")
    (root / "tmp").symlink_to(victim)
    assert tier.sweep() == 0 and precious.exists()
    assert not tier.store(key(2), payload(2)) and os.listdir(victim) == ["precious.txt"]
    assert tier.available and read(tier, key(1)) == payload(1)  # writes pause, reads go on


def test_a_fifo_planted_in_the_shared_directory_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    """Issue 14: opening a FIFO named like a block waited for a writer forever, in every request thread."""
    import threading

    tier = FsSharedTier(tmp_path, ttl_s=60)
    fifo = tmp_path / "kvgate" / key_name(key(5))[-2:] / key_name(key(5))
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    (tmp_path / "elsewhere").write_bytes(pack(LAYOUT, payload(6)))
    link = tmp_path / "kvgate" / key_name(key(6))[-2:] / key_name(key(6))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(tmp_path / "elsewhere")
    assert tier.refresh_index() == 2
    results: list[int | None] = []
    reader = threading.Thread(target=lambda: results.extend(tier.read_many([key(5), key(6)], [
        memoryview(bytearray(1000)), memoryview(bytearray(1000))])), daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # release the hung reader before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError("reading a FIFO in the shared directory hung")
    assert results == [None, None] and tier.stats.read_errors == 2
    assert not fifo.exists() and not link.exists()


def test_tier_files_are_not_world_readable(tmp_path: Path) -> None:
    """Issue 14: segment, block and shared files were created 0644 (everyone could read the prompts' KV)."""
    old = os.umask(0o022)
    try:
        segments = SegmentNvmeTier(tmp_path / "seg", capacity=2**20, fsync=False)
        files = NvmeTier(tmp_path / "files", capacity=2**20, fsync=False)
        shared = FsSharedTier(tmp_path / "shared", ttl_s=60)
        for tier in (segments, files, shared):
            assert tier.store(key(1), payload(1))
    finally:
        os.umask(old)
    for root, forbidden in ((tmp_path / "seg", 0o077), (tmp_path / "files", 0o077), (tmp_path / "shared", 0o007)):
        paths = [p for p in root.rglob("*") if p.is_file() or p.is_dir()]
        assert any(p.is_file() for p in paths)
        for path in paths:
            assert path.stat().st_mode & forbidden == 0, (path, oct(path.stat().st_mode))


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[str]:
    """A one-node Valkey Cluster (all 16384 slots on one server): the cluster protocol, MOVED-free."""
    port = free_port()
    # the cluster bus port defaults to port + 10000, which does not exist for a free port above 55535
    proc = subprocess.Popen([valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--cluster-enabled", "yes",
                             "--cluster-port", str(free_port()), "--cluster-config-file", str(tmp_path / "nodes.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 15, proc)
        admin = redis.Redis(port=port)
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 15
        while b"cluster_state:ok" not in admin.execute_command("CLUSTER", "INFO"):  # type: ignore[no-untyped-call]
            assert time.monotonic() < deadline, "the one-node cluster did not come up"
            time.sleep(0.1)
        admin.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(proc)


def test_redis_cluster_backend(valkey_cluster: str) -> None:
    a = RedisSharedTier(valkey_cluster, cluster=True, ttl_s=60)
    b = RedisSharedTier(valkey_cluster, cluster=True, ttl_s=60)
    assert isinstance(a.client, redis.cluster.RedisCluster)
    assert a.store_many([StoreItem(key(i), payload(i)) for i in range(20)]) == 20  # keys over many slots
    assert b.probe([key(0), key(19), key(99)]) == [True, True, False]
    assert b.refresh_index() == 20
    outs = [memoryview(bytearray(2000)) for _ in range(20)]
    assert b.read_many([key(i) for i in range(20)], outs) == [1000] * 20
    assert all(bytes(outs[i][:1000]) == payload(i) for i in range(20))
    # announcements work on a cluster too: a listener learns another tier's writes without a scan
    c = RedisSharedTier(valkey_cluster, cluster=True, ttl_s=60, secret=b"s")
    writer = RedisSharedTier(valkey_cluster, cluster=True, ttl_s=60, secret=b"s")
    c.listen()
    assert c.wait_subscribed(10) and c.available
    assert writer.store_many([StoreItem(key(i), payload(i, 300 * 1024)) for i in range(100, 104)]) == 4
    deadline = time.monotonic() + 5
    while not all(c.contains(key(i)) for i in range(100, 104)):
        assert time.monotonic() < deadline, "the cluster listener learnt nothing"
        time.sleep(0.01)
    time.sleep(1.5)  # past a ping: the subscription stays up
    assert c.available
    big = [memoryview(bytearray(300 * 1024)) for _ in range(4)]
    assert c.read_many([key(i) for i in range(100, 104)], big) == [300 * 1024] * 4
    for tier in (a, b, c, writer):
        assert tier.stats.backend_errors == 0
        tier.close()
