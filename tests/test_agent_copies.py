"""The DRAM tier's parallel copies (agent/tiers/copies.py): every byte where it belongs, a chain's copies made
before anything it evicts leaves with its bytes, and loads of a DRAM run."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from agent.config import AgentConfig
from agent.store import TierStore
from agent.tiers.base import Removed, StoreItem
from agent.tiers.copies import LARGE_BYTES, ParallelCopier
from agent.tiers.dram import DramTier

LAYOUT = 0x5EED
BIG = 2 * 2**20


def block(i: int, size: int) -> bytes:
    head = i.to_bytes(8, "little")
    return (head * (size // 8 + 1))[:size]


def test_copies_of_every_size_and_kind_land_whole() -> None:
    copier = ParallelCopier(3)
    try:
        sizes = [0, 1, 4095, LARGE_BYTES - 1, LARGE_BYTES, LARGE_BYTES + 1, BIG + 13, 3 * BIG + 7]
        sources: list[bytes | bytearray | memoryview] = []
        for i, n in enumerate(sizes):
            data = os.urandom(n)
            # read-only bytes, a bytearray and a slice of a bigger writable view: each addressed as it can be
            sources.append(data if i % 3 == 0 else bytearray(data) if i % 3 == 1
                           else memoryview(bytearray(b"x" + data + b"y"))[1: n + 1])
        targets = [bytearray(n) for n in sizes]
        copier.copy(list(zip(targets, sources, strict=True)))
        for target, source in zip(targets, sources, strict=True):
            assert target == bytes(source)
        assert all(len(t) == n for t, n in zip(targets, sizes, strict=True))  # nothing resized or released
        targets[-1].extend(b"!")  # the exports are gone once the copy returns
    finally:
        copier.close()


def test_a_copy_of_unequal_lengths_is_refused() -> None:
    copier = ParallelCopier(2)
    try:
        try:
            copier.copy([(bytearray(BIG), bytes(BIG + 1))])
        except ValueError:
            pass
        else:
            raise AssertionError("copied into a buffer of another length")
    finally:
        copier.close()


def test_a_chain_that_evicts_its_own_blocks_keeps_every_block_whole() -> None:
    """Blocks stored by one call (not a chain: each a leaf) in a tier that holds three: the later ones evict the
    earlier ones within the same call, whose copies were put off -- each evicted block must leave with its own
    bytes (they move down), and no buffer it hands back may be reused by a pending copy."""
    removed: list[Removed] = []
    tier = DramTier(3 * BIG, copier=ParallelCopier(2))
    tier.on_removed = lambda batch: removed.extend(batch)
    try:
        items = [StoreItem((LAYOUT, i), block(i, BIG)) for i in range(8)]
        assert tier.store_many(items) == 8
        assert len(removed) == 5
        for key, held in removed:
            assert held is not None and isinstance(key[1], int) and bytes(held.data) == block(key[1], BIG)
        out = memoryview(bytearray(BIG))
        for i in range(5, 8):
            assert tier.read_into((LAYOUT, i), out) == BIG and out == block(i, BIG)
    finally:
        tier.close()


def test_a_run_from_dram_reads_the_same_as_block_by_block() -> None:
    store = TierStore.from_config(AgentConfig(dram_capacity=64 * BIG, copy_threads=3))
    try:
        hashes = list(range(1, 11))
        payloads = [block(h, BIG if h % 4 else 4096) for h in hashes]
        assert store.store_chain(LAYOUT, hashes[:6], payloads[:6]) == 6
        dram = store.dram
        assert isinstance(dram, DramTier)
        hits, misses = dram.stats.hits, dram.stats.misses
        outs = [memoryview(bytearray(BIG)) for _ in hashes]
        assert store.load_chain(LAYOUT, hashes, outs) == [len(p) for p in payloads[:6]]
        for out, data in zip(outs, payloads[:6], strict=False):
            assert out[: len(data)] == data
        assert (dram.stats.hits - hits, dram.stats.misses - misses) == (6, 1)  # the block that ended the run
        small = [memoryview(bytearray(4096)) for _ in hashes]  # a block bigger than its buffer ends the run
        assert store.load_chain(LAYOUT, hashes, small) == []
    finally:
        store.close()



def test_shares_are_not_held_up_by_pool_threads_that_do_not_run() -> None:
    """A pool thread the OS does not run soon (2 busy cores) held a share, and the caller, until it ran: a
    16-block NVMe load 0.56x the single thread's. Whoever is free takes the next share."""
    import threading

    copier = ParallelCopier(3)
    busy = threading.Event()
    release = threading.Event()
    try:
        assert copier._pool is not None
        for _ in range(2):  # every pool thread taken, as by a scheduler that does not run them
            copier._pool.submit(release.wait, 30)
        ran_on: list[str] = []
        results: list[list[int]] = []

        def share(i: int) -> Callable[[], int]:
            def run() -> int:
                ran_on.append(threading.current_thread().name)
                if i == 1:
                    raise ValueError("share 1")
                return i
            return run

        def caller() -> None:
            results.append(copier.run([share(i) for i in (0, 2, 3, 4)]))
            busy.set()

        thread = threading.Thread(target=caller, name="the-caller")
        thread.start()
        assert busy.wait(10), "the shares waited for pool threads that were not running"
        assert results == [[0, 2, 3, 4]] and ran_on == ["the-caller"] * 4
        release.set()
        thread.join(10)
        # with the pool free: an exception comes back on the caller's thread, once every share ran
        ran_on.clear()
        with pytest.raises(ValueError, match="share 1"):
            copier.run([share(i) for i in (0, 1, 2, 3)])
        assert len(ran_on) == 4
    finally:
        release.set()
        copier.close()
