"""The DRAM tier's block buffers (agent/tiers/buffers.py): recycled only once nothing reads them, pre-faulted up to
the tier's bound and never past it; and a real `kvgate agent` that stores into them without page faults and serves
only the bytes it was given while blocks are evicted, demoted and their buffers reused."""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

from agent.client import AgentClient
from agent.tiers.base import Removed, StoreItem
from agent.tiers.buffers import PAGE, BlockBuffers
from agent.tiers.dram import DramTier
from tests.agent_process import AgentProcess
from tests.test_agent_process import content

LAYOUT = 0xB0FF
SIZE = 1000
BLOCK = 16 * 2**10  # the tiny model's block (docs/agent.md): 4 pages


def key(i: int) -> tuple[int, int]:
    return (LAYOUT, i)


def payload(i: int, size: int = SIZE) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def upkeep(tier: DramTier) -> None:
    """What the agent's upkeep does every 0.2 s (TierStore.maintain)."""
    if tier.above_high_watermark():
        tier.evict_to_low_watermark()


def held_bytes(tier: DramTier) -> int:
    """What the tier keeps: its blocks and its idle buffers (in these tests nothing else reads them)."""
    stats = tier.buffer_stats()
    return tier.usage().used_bytes + stats.free_bytes + stats.returned_bytes


def test_a_store_into_a_full_tier_does_not_rescan_the_buffers_it_just_evicted() -> None:
    """A chain stored into a full tier evicts a block for each block it adds; the evicted blocks' buffers are still
    in the store's hands until it reports them, so looking at them for reuse before then finds nothing. It used to:
    each new block's `take` rechecked up to 64 of them (40% of a 16 KiB block's store in a full tier); now each is
    looked at once, when the store reports its evictions."""
    tier = DramTier(64 * BLOCK)
    tier.store_many([StoreItem(key(i), payload(i, BLOCK), None, key(i - 1) if i else None) for i in range(64)])
    checks = tier._buffers.reclaim_checks
    items = [StoreItem(key(i), payload(i, BLOCK)) for i in range(100, 200)]  # each a leaf: evicts the oldest
    assert tier.store_many(items) == 100
    assert tier._buffers.reclaim_checks - checks <= 64  # before: 64 for each of the 100 blocks
    out = memoryview(bytearray(BLOCK))
    assert tier.read_into(key(199), out) == BLOCK and out == payload(199, BLOCK)
    assert held_bytes(tier) <= tier.capacity


def test_an_evicted_blocks_buffer_is_reused_only_once_nothing_reads_it() -> None:
    tier = DramTier(8 * SIZE)  # upkeep evicts 2 blocks whenever it holds 8
    removed: list[Removed] = []
    tier.on_removed = removed.extend  # what a demotion in flight holds: the evicted block, bytes and all
    for i in range(8):
        tier.store(key(i), payload(i))
    upkeep(tier)
    gone = removed[0]
    assert gone.key == key(0) and gone.block is not None and gone.block.data == payload(0)
    view = memoryview(gone.block.data)[100:200]  # a reader left with a view of its bytes only
    removed.clear()
    del gone
    tier.on_removed = None  # from now on every evicted block is dropped at once: its buffer free to reuse
    for i in range(8, 60):
        tier.store(key(i), payload(i))
        upkeep(tier)
        assert bytes(view) == payload(0)[100:200]
        assert all(tier.held(k).data is not view.obj for k in tier.block_keys())  # type: ignore[union-attr]
    stats = tier.buffer_stats()
    assert stats.new == 9 and stats.reused == 51  # new: the first 8, and the 9th (block 0's still read)
    assert stats.returned_bytes == SIZE  # block 0's, in transit: its reader's memory
    view.release()
    del view
    for i in range(60, 64):  # the view is gone: the buffer is looked at again, and let go (the 9th: no room)
        tier.store(key(i), payload(i))
        upkeep(tier)
    assert tier.buffer_stats().returned_bytes == 0 and held_bytes(tier) <= tier.capacity
    assert [tier.held(key(j)).data for j in range(58, 64)] == [payload(j) for j in range(58, 64)]  # type: ignore[union-attr]


def test_prefault_fills_up_to_the_bound_and_the_bound_holds_for_every_size() -> None:
    tier = DramTier(64 * SIZE)
    assert tier.prefault(SIZE) == 64 * SIZE
    assert tier.buffer_stats().free_bytes == 64 * SIZE
    assert tier.prefault(SIZE) == 0  # full already
    for i in range(200):  # three times the tier, under upkeep: every block into a pre-faulted or recycled buffer
        assert tier.store(key(i), payload(i))
        assert held_bytes(tier) <= tier.capacity
        if i % 8 == 7:
            upkeep(tier)
    assert tier.buffer_stats().new == 0
    for i in range(200, 300):  # stores that evict on the spot (no upkeep) keep the bound too
        assert tier.store(key(i), payload(i))
        assert held_bytes(tier) <= tier.capacity
    for i in range(300, 360):  # another block size: the other size's buffers make way for it
        assert tier.store(key(i), payload(i, 3 * SIZE))
        assert held_bytes(tier) <= tier.capacity
        if i % 4 == 3:
            upkeep(tier)
    assert all(tier.held(key(i)).data == payload(i, 3 * SIZE) for i in range(355, 360))  # type: ignore[union-attr]
    half = DramTier(64 * SIZE)
    for i in range(32):
        half.store(key(i), payload(i))
    assert half.prefault(SIZE) == 32 * SIZE  # what is resident counts


BIG = 64 * 2**20  # over glibc's largest mmap threshold (32 MiB): always fresh pages from the kernel


def own_minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_new_large_buffer_is_not_written_before_the_copy_into_it() -> None:
    """A regression: `bytearray(size)` zeroes every byte with the GIL held, faulting in every page of a new block's
    buffer on the agent's loop thread, before the copier's threads (which fault them without the GIL) get to it."""
    pool = BlockBuffers(4 * BIG)
    before = own_minor_faults()
    buf = pool.take(BIG, 0)
    assert len(buf) == BIG and pool.stats().new == 1
    assert own_minor_faults() - before < BIG // PAGE // 10  # 16,384 pages; a handful faulted at most
    buf[:] = bytes(BIG)  # the copy faults them
    assert own_minor_faults() - before >= BIG // PAGE * 9 // 10


def test_prefault_lets_other_threads_run_while_the_pages_are_faulted() -> None:
    """A regression: pre-faulting 16 GiB held the GIL for seconds (each buffer zeroed by `bytearray(size)`), and
    the agent's loop and copy threads waited: DRAM loads on an H200 host ran at 0.4-2.8 GB/s, not 10-13."""
    tier = DramTier(4 * BIG)
    done = threading.Event()
    faulted: list[int] = []

    def prefault() -> None:
        faulted.append(tier.prefault(2 * BIG, batch=1))  # two buffers of 128 MiB: ~65,000 page faults
        done.set()

    thread = threading.Thread(target=prefault)
    start = last = time.perf_counter()
    thread.start()
    gap = 0.0
    while not done.is_set():  # this thread's own progress, a pure Python loop that needs the GIL
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    took = time.perf_counter() - start
    thread.join()
    assert faulted == [4 * BIG] and tier.buffer_stats().free_bytes == 4 * BIG
    # held for the whole fault of each buffer, the longest gap was half the run; released, a switch interval or so
    assert gap < took / 4, (gap, took)


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def store_blocks(client: AgentClient, first: int, n: int, chain: int = 32) -> int:
    stored = 0
    for start in range(first, first + n, chain):
        hashes = list(range(start, min(start + chain, first + n)))
        stored += client.store(LAYOUT, hashes, [content(h, BLOCK) for h in hashes])
    return stored


def test_a_prefaulted_agent_stores_without_page_faults(tmp_path: Path, agents: list[AgentProcess],
                                                      subprocess_env: dict[str, str]) -> None:
    """512 blocks of 16 KiB (2,048 pages) stored into an agent that pre-faulted its DRAM tier, against one that did
    not: the page faults the copies cost are gone."""
    faults = {}
    for prefault in (False, True):
        agent = AgentProcess(tmp_path / str(prefault), subprocess_env, "--dram-capacity", "16MiB",
                             *(["--dram-prefault"] if prefault else []))
        agents.append(agent)
        assert agent.proc is not None
        with AgentClient(agent.socket, shm_bytes=32 * BLOCK, layout=LAYOUT, block_bytes=BLOCK) as client:
            client.stats()  # connected, Hello sent: the block size is declared
            deadline = time.monotonic() + 120
            while agent.metric("kvgate_agent_dram_prefaulting") > 0:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            if prefault:
                assert agent.metric("kvgate_agent_dram_free_buffer_bytes") == 16 * 2**20
            store_blocks(client, 0, 32)  # the code paths warm
            before = minor_faults(agent.proc.pid)
            assert store_blocks(client, 1000, 512) == 512
            faults[prefault] = minor_faults(agent.proc.pid) - before
            assert client.load(LAYOUT, [1000, 1511], BLOCK)[:1] == [content(1000, BLOCK)]
        assert agent.metric("kvgate_agent_dram_buffers_total", source="new") == (0 if prefault else 544)
    # the copies' 2,048 pages (what else faults -- Python's own objects, the presence bitmap's pages -- is in both)
    assert faults[False] >= 2048 and faults[False] - faults[True] >= 1500, faults


def test_recycled_buffers_serve_only_the_bytes_stored_under_each_hash(tmp_path: Path, agents: list[AgentProcess],
                                                                      subprocess_env: dict[str, str]) -> None:
    """A DRAM tier of 32 blocks over NVMe, lazy: 640 blocks stored, every eviction demoted to NVMe from the evicted
    buffer while later stores recycle buffers; every block loaded back (from DRAM or NVMe) is the one stored under
    its hash. A buffer reused before its demotion had read it would put another block's bytes on NVMe under a
    valid checksum."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", str(32 * BLOCK), "--nvme-dir",
                         str(tmp_path / "nvme"), "--no-nvme-fsync", "--write-policy", "lazy", "--dram-prefault")
    agents.append(agent)
    with AgentClient(agent.socket, shm_bytes=64 * BLOCK, layout=LAYOUT, block_bytes=BLOCK) as client:
        assert store_blocks(client, 0, 640, chain=16) == 640
        deadline = time.monotonic() + 60
        while agent.metric("kvgate_agent_background_bytes") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        loaded = 0
        for start in range(0, 640, 16):
            hashes = list(range(start, start + 16))
            got = client.load(LAYOUT, hashes, BLOCK)
            assert got == [content(h, BLOCK) for h in hashes[: len(got)]]
            loaded += len(got)
        assert loaded >= 600  # (a demotion may be dropped when too many bytes are in flight)
        assert client.stats().tiers["dram"].used_bytes <= 32 * BLOCK
    assert agent.metric("kvgate_agent_dram_buffers_total", source="reused") > 32  # recycled ones too, not only
                                                                                   # the 32 pre-faulted


def test_a_block_size_under_a_page_is_not_pre_faulted(tmp_path: Path, agents: list[AgentProcess],
                                                     subprocess_env: dict[str, str]) -> None:
    """The first Hello that declares a block size has the DRAM tier pre-faulted in buffers of it, whatever a client
    declares: 1-byte blocks filled an 8 MiB tier with 8 million buffers, 773 MB of the agent's memory (a Python
    object each), 12.9 s of a thread. A block size under a page pre-faults nothing, and the next client's real one
    still does."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "8MiB", "--dram-prefault")
    agents.append(agent)
    for tiny in (1, 16, PAGE - 1):
        with AgentClient(agent.socket, shm_bytes=0, layout=LAYOUT, block_bytes=tiny) as client:
            client.stats()  # connected, Hello sent: the block size is declared
    assert agent.metric("kvgate_agent_dram_prefaulting") == 0  # (set at the Hello that starts it, not later)
    assert agent.metric("kvgate_agent_dram_free_buffer_bytes") == 0
    with AgentClient(agent.socket, shm_bytes=2 * BLOCK, layout=LAYOUT, block_bytes=BLOCK) as client:
        client.stats()
        deadline = time.monotonic() + 120
        while agent.metric("kvgate_agent_dram_prefaulting") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert agent.metric("kvgate_agent_dram_free_buffer_bytes") == 8 * 2**20
