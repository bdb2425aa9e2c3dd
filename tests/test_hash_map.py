"""`U64Map` (bench/sim/hash_map.py), the arrays a replay keeps its NVMe tier's gateway maps in: against a dict
entry by entry, and the block index and KV event applier built on it against the same ones on dicts, event by
event."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, MutableMapping

import pytest

from bench.sim.hash_map import U64Map
from kvcore.kv_events import CPU, DISK, GPU, BlockHash, BlockRemoved, BlockStored, KvEvent
from router.block_keys import BlockKey
from router.kv_apply import KvEventApplier
from router.kv_index import TIERS, InMemoryKvIndex
from router.kv_transport import EventSource
from router.metrics import GatewayMetrics

TOP = (1 << 64) - 1


@pytest.mark.parametrize("low_bits", [2, 12])
def test_the_u64_map_is_a_dict(low_bits: int) -> None:
    """Inserts, updates, lookups, pops and deletions against a dict, over keys that share their low bits (long
    probe runs, deletions shifting them back and moving the last entry into the hole) or do not, through its
    growth; the extreme keys and values included."""
    rng = random.Random(low_bits)
    keys = [rng.randrange(1 << 64) & ~((1 << low_bits) - 1) | rng.randrange(1 << low_bits) for _ in range(3000)]
    keys[:2] = [0, TOP]
    ours, reference = U64Map(), dict[int, int]()
    for step in range(40_000):
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.45:
            value = rng.choice([0, TOP, rng.randrange(1 << 64), rng.randrange(256)])
            ours[key] = value
            reference[key] = value
        elif op < 0.6:
            assert ours.pop(key, None) == reference.pop(key, None)
        elif op < 0.7:
            if key in reference:
                del ours[key]
                del reference[key]
            else:
                with pytest.raises(KeyError):
                    del ours[key]
                with pytest.raises(KeyError):
                    ours.pop(key)
        else:
            assert ours.get(key, -1) == reference.get(key, -1)
            if key in reference:
                assert ours[key] == reference[key]
            else:
                with pytest.raises(KeyError):
                    ours[key]
        assert len(ours) == len(reference) and (key in ours) == (key in reference)
        if step % 1000 == 0:
            assert dict(ours) == reference
    assert dict(ours) == reference and sorted(ours) == sorted(reference)
    ours.clear()
    assert len(ours) == 0 and not ours and 0 not in ours


def test_a_value_or_key_out_of_range_leaves_the_map_as_it_was() -> None:
    ours = U64Map()
    ours[5] = 7
    for key, value in ((6, 1 << 64), (6, -1), (-1, 1), (1 << 64, 1), (5, 1 << 64)):
        with pytest.raises(OverflowError):
            ours[key] = value
        assert dict(ours) == {5: 7}


def test_the_u64_map_holds_an_entry_in_at_most_32_bytes() -> None:
    """At 200,000 entries (a dict: 30-60 bytes of table per entry and, in a replay, an int object of 48 bytes for
    each key and value held nowhere else)."""
    rng = random.Random(1)
    ours = U64Map()
    for _ in range(200_000):
        ours[rng.randrange(1 << 64)] = rng.randrange(1 << 64)
    assert sys.getsizeof(ours) <= 32 * len(ours)


def _index(disk_in_arrays: bool) -> InMemoryKvIndex:
    index = InMemoryKvIndex()
    index.compact_tables({DISK: U64Map} if disk_in_arrays else None)
    return index


def test_the_index_answers_the_same_with_its_nvme_tier_in_arrays() -> None:
    """Adds and removals on every tier, lookups and what each worker holds, with the DISK tier's map a dict and
    a `U64Map`; and a map that is not empty is refused."""
    rng = random.Random(3)
    dicts, arrays = _index(False), _index(True)
    assert type(arrays._disk) is U64Map and type(dicts._disk) is dict
    workers = [f"w{i}" for i in range(5)]
    pool = [rng.getrandbits(64) for _ in range(400)]
    for step in range(8000):
        worker = rng.choice(workers)
        start = rng.randrange(len(pool))
        keys = pool[start:start + rng.randrange(1, 16)]
        tier = rng.choice([GPU, CPU, DISK, DISK, TIERS[3]])
        if rng.random() < 0.55:
            dicts.add(worker, keys, tier)
            arrays.add(worker, keys, tier)
        else:
            dicts.remove(worker, keys, tier)
            arrays.remove(worker, keys, tier)
        prompt = pool[start:start + 40]
        assert arrays.lookup(prompt, workers) == dicts.lookup(prompt, workers), step
        if step % 500 == 0:
            assert all(arrays.holds(w) == dicts.holds(w) for w in workers)
            assert arrays.entries() == dicts.entries()
        if step % 3001 == 3000:
            dicts.clear(worker)
            arrays.clear(worker)
    assert all(arrays.holds(w) == dicts.holds(w) for w in workers)
    with pytest.raises(ValueError, match="not empty"):
        arrays.compact_tables({DISK: U64Map})


def _events(rng: random.Random, chains: list[list[int]], bs: int) -> list[KvEvent]:
    """A step's events: an engine storing a prompt's blocks with their tokens (on the GPU), and an agent-style
    announcement (no tokens) of blocks the engine named, on DRAM or NVMe, or the removal of some."""
    tokens = rng.choice(chains)
    blocks = len(tokens) // bs
    hashes: list[BlockHash] = [hash((7, *tokens[: (i + 1) * bs])) & TOP for i in range(blocks)]
    op = rng.random()
    if op < 0.4:
        return [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=bs)]
    if op < 0.75:
        return [BlockStored(block_hashes=hashes[: rng.randint(1, blocks)], block_size=bs,
                            medium=rng.choice(["DISK", "CPU"]))]
    some = rng.sample(hashes, rng.randint(1, blocks))
    return [BlockRemoved(block_hashes=some, medium=rng.choice([None, "DISK", "DISK", "CPU"]))]


def _applier(tables: dict[str, Callable[[], MutableMapping[BlockHash, int]]] | None) -> KvEventApplier:
    index = InMemoryKvIndex()
    index.compact_tables({DISK: U64Map} if tables else None)
    applier = KvEventApplier(index, GatewayMetrics(), lambda url: "tiny", block_size=4)
    applier.compact_tables(tables)
    return applier


def _holds(applier: KvEventApplier, cache: str) -> set[tuple[BlockKey, str]]:
    index = applier.index
    assert isinstance(index, InMemoryKvIndex)
    return index.holds(cache)


def test_the_applier_holds_the_same_with_its_nvme_maps_in_arrays() -> None:
    """Engine stores with tokens, announcements placed by content identity, and removals, from two workers: the
    index and every source's holdings the same whether the DISK tier's maps are dicts or `U64Map`s."""
    rng = random.Random(7)
    bs = 4
    chains = [[rng.randrange(50) for _ in range(bs * rng.randint(1, 12))] for _ in range(60)]
    dicts = _applier(None)
    arrays = _applier({DISK: U64Map})  # type: ignore[dict-item]
    sources = [EventSource(f"http://w{i}", f"tcp://w{i}") for i in range(2)]
    for step in range(3000):
        source = rng.choice(sources)
        events = _events(rng, chains, bs)
        dicts.apply(source, events)
        arrays.apply(source, events)
        if step % 250 == 0:
            for s in sources:
                assert _holds(arrays, s.cache) == _holds(dicts, s.cache)
                for tier in TIERS:
                    assert arrays.engine_hashes(s.cache, tier) == dicts.engine_hashes(s.cache, tier)
    held = arrays._held[sources[0]].tiers
    assert type(held[DISK]) is U64Map and len(held[DISK]) > 0 and type(held[GPU]) is dict
    for s in sources:
        assert _holds(arrays, s.cache) == _holds(dicts, s.cache)
        assert {t for _, t in _holds(arrays, s.cache)} >= {GPU, CPU, DISK}
