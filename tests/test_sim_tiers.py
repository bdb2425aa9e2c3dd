"""The virtual-time simulator's tier agents (bench/sim/tier_model.py): the agent's own tier stack and policies over
stand-in bytes, the fleet's shared store and its TTL on the virtual clock, and the KV events they announce."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest

from agent.block import BlockKey, checksum
from agent.config import AgentConfig
from agent.policy import UseCounter
from agent.store import TierStore
from agent.tiers.base import StoreItem, TierName
from agent.tiers.dram import DramTier
from bench.sim import hash_lru
from bench.sim.hash_lru import HashLru
from bench.sim.tier_model import (
    DramModel,
    FleetBackend,
    FleetSharedTier,
    HashKeyedIndex,
    HashUseCounter,
    InlineExecutor,
    ModelTierStore,
    NvmeModel,
    ReplicaAgent,
)
from kvcore.kv_events import BlockRemoved, BlockStored


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def media(events: list[Any], kind: type[BlockStored] | type[BlockRemoved]) -> dict[str | None, list[Any]]:
    found: dict[str | None, list[Any]] = {}
    for event in events:
        if isinstance(event, kind):
            found.setdefault(event.medium, []).extend(event.block_hashes)
    return found


def test_lazy_tiers_demote_under_pressure_and_promote_on_hit() -> None:
    fleet = FleetBackend(capacity=100, clock=Clock())
    a = ReplicaAgent(AgentConfig(write_policy="lazy"), dram_blocks=4, nvme_blocks=4, fleet=fleet)
    for first in (1, 3, 5, 7, 9):  # five chains of two blocks; DRAM and NVMe hold four blocks each
        a.save([first, first + 1], None)
    # DRAM pushed out its least recently used chains to NVMe, and NVMe its oldest to the shared store
    assert [a.store.lookup(0, [h, h + 1]) for h in (1, 3, 5, 7, 9)] == [(2, "SS"), (2, "DD"), (2, "DD"),
                                                                       (2, "CC"), (2, "CC")]
    assert a.load([1, 2, 99]) == "SS"  # the leading run the tiers hold
    # promoted on the hit, which pushed 7 and 8 down to NVMe, and NVMe's oldest (3, 4) to the shared store
    assert [a.store.lookup(0, [h, h + 1]) for h in (1, 3, 5, 7, 9)] == [(2, "CC"), (2, "SS"), (2, "DD"),
                                                                       (2, "DD"), (2, "CC")]
    events = a.events()
    stored, removed = media(events, BlockStored), media(events, BlockRemoved)
    assert sorted(stored["CPU"]) == [1, 1, 2, 2, *range(3, 11)] and sorted(removed["CPU"]) == list(range(1, 9))
    assert sorted(stored["DISK"]) == list(range(1, 9)) and sorted(removed["DISK"]) == [1, 2, 3, 4]
    assert sorted(stored["SHARED"]) == [1, 2, 3, 4] and a.store.flow.promotions[TierName.SHARED] == 2


def test_replicas_share_through_the_fleet_store_until_the_ttl() -> None:
    clock = Clock()
    fleet = FleetBackend(capacity=100, clock=clock)
    config = AgentConfig(write_policy="eager", shared_ttl_s=60)
    a = ReplicaAgent(config, dram_blocks=8, nvme_blocks=0, fleet=fleet)
    b = ReplicaAgent(config, dram_blocks=8, nvme_blocks=0, fleet=fleet)
    a.save([1, 2, 3], None)
    assert media(a.events(), BlockStored)["SHARED"] == [1, 2, 3]  # eager: written through at once
    assert b.load([1, 2, 3, 4]) == "SSS"  # b asks the fleet store about blocks it does not know, then loads
    assert b.load([1, 2, 3]) == "CCC"  # promoted into b's DRAM
    assert b.store.flow.promotions[TierName.SHARED] == 3
    clock.now = 61.0  # past the TTL on the virtual clock
    c = ReplicaAgent(config, dram_blocks=8, nvme_blocks=0, fleet=fleet)
    assert c.load([1, 2, 3]) == ""


def test_admission_by_reuse_keeps_one_off_blocks_out_of_the_lower_tiers() -> None:
    fleet = FleetBackend(capacity=100, clock=Clock())
    config = AgentConfig(write_policy="eager", nvme_admit_reuse=2, shared_admit_reuse=3)
    a = ReplicaAgent(config, dram_blocks=8, nvme_blocks=8, fleet=fleet)
    a.save([1], None)
    assert "DISK" not in media(a.events(), BlockStored)
    assert a.load([1]) == "C"  # second use: nothing moves now (eager writes through on store only)
    a.store.dram.delete((0, 1))  # type: ignore[union-attr]
    a.save([1], None)  # third use: NVMe and the shared store admit it
    stored = media(a.events(), BlockStored)
    assert stored["DISK"] == [1] and stored["SHARED"] == [1]


def same_under_random_operations(slim: DramModel | NvmeModel, full: DramTier, rng: random.Random, longest: int,
                                 items_of: Callable[[list[BlockKey]], list[StoreItem]],
                                 agree: Callable[[list[BlockKey]], None]) -> int:
    """Drive a model and the agent's tier through the same 3,000 random operations (stores of `items_of` the
    keys, reads with and without touching, touches, deletions, upkeep) and require the same answers after each,
    `agree` besides, and the same stats at the end. Returns the blocks stored."""
    out = memoryview(bytearray(1))
    stores = 0
    for _ in range(3000):
        distinct = 120 if longest < 50 else 400
        keys: list[BlockKey] = [(0, rng.randrange(distinct)) for _ in range(rng.randint(1, longest))]
        op = rng.random()
        if op < 0.4:
            items = items_of(keys)
            held = slim.store_many(items)
            assert held == full.store_many(items)
            stores += held
        elif op < 0.7:
            touch = rng.random() < 0.8
            assert slim.read_many(keys, [out] * len(keys), touch) == full.read_many(keys, [out] * len(keys), touch)
        elif op < 0.8:
            slim.touch(keys)
            full.touch(keys)
        elif op < 0.9:
            assert slim.delete(keys[0]) == full.delete(keys[0])
        elif slim.above_high_watermark() or full.above_high_watermark():
            assert slim.above_high_watermark() and full.above_high_watermark()
            slim.evict_to_low_watermark()
            full.evict_to_low_watermark()
        assert [slim.contains(k) for k in keys] == [full.contains(k) for k in keys]
        assert slim.usage() == full.usage()
        agree(keys)
    assert vars(slim.stats) | {"lock": None} == vars(full.stats) | {"lock": None}
    return stores


@pytest.mark.parametrize("longest", [8, 150])
def test_the_nvme_model_is_the_dram_tier_without_prefix_order(monkeypatch: pytest.MonkeyPatch, longest: int) -> None:
    """The simulator's slim NVMe model (hashes in use order, `HashLru`) answers, evicts and hands down exactly as
    the agent's DRAM tier without prefix order, the exact LRU it stands for, under a random mix of operations;
    chains of up to 150 blocks into 50 make one write evict many blocks, among them blocks it wrote or touched
    itself, and the log is rewritten often."""
    monkeypatch.setattr(hash_lru, "STALE_SLACK", 3)
    slim, full = NvmeModel(50, 0.9, 0.6), DramTier(50, 0.9, 0.6, prefix_order=False)
    removed: dict[str, list[Any]] = {"slim": [], "full": []}
    slim.on_removed = lambda r: removed["slim"].append([(x.key, None if x.block is None else x.block.item(x.key))
                                                        for x in r])
    full.on_removed = lambda r: removed["full"].append([(x.key, None if x.block is None else x.block.item(x.key))
                                                        for x in r])

    def items_of(keys: list[BlockKey]) -> list[StoreItem]:
        return [StoreItem(k, b"\x00", checksum(b"\x00"), (0, 999)) for k in keys]

    def agree(keys: list[BlockKey]) -> None:
        assert list(slim.block_keys()) == sorted(full.block_keys(), key=lambda k: full._blocks[k].used)

    same_under_random_operations(slim, full, random.Random(7), longest, items_of, agree)
    assert removed["slim"] == removed["full"] and sum(map(len, removed["full"])) > 500


@pytest.mark.parametrize("longest", [8, 150])
def test_the_dram_model_is_the_agents_dram_tier(longest: int) -> None:
    """The simulator's DRAM model (`DramModel`: hashes, no bytes) stores, refuses, answers, evicts and hands down
    exactly as the agent's DRAM tier in prefix order under a random mix of operations: chains (each block the
    parent of the next, some continuing a resident block, some repeating one), promotions, reads, touches,
    deletions and upkeep; chains of up to 150 blocks into 50 make the tier refuse their tails and evict blocks of
    the chain being stored. A removed block is handed down with its key alone: the tiers below take nothing else
    of it."""
    rng = random.Random(5)
    slim, full = DramModel(50, 0.9, 0.6), DramTier(50, 0.9, 0.6)
    removed: dict[str, list[Any]] = {"slim": [], "full": []}
    slim.on_removed = lambda r: removed["slim"].append([(x.key, x.block is None) for x in r])
    full.on_removed = lambda r: removed["full"].append([(x.key, x.block is None) for x in r])

    def items_of(keys: list[BlockKey]) -> list[StoreItem]:
        first = (0, rng.randrange(400)) if rng.random() < 0.5 else None
        return [StoreItem(k, b"\x00", checksum(b"\x00"), parent)
                for k, parent in zip(keys, [first, *keys[:-1]], strict=True)]

    def agree(keys: list[BlockKey]) -> None:
        assert [slim.held(k) is None for k in keys] == [full.held(k) is None for k in keys]
        assert list(slim.block_keys()) == list(full.block_keys())

    stores = same_under_random_operations(slim, full, rng, longest, items_of, agree)
    assert removed["slim"] == removed["full"] and sum(map(len, removed["full"])) > 500 and stores > 1000
    assert (full.stats.refused > 0) == (longest > 50)


def stack_state(store: TierStore) -> tuple[Any, ...]:
    """What a tier store shows the world: its events, flows, and each tier's contents, usage and stats."""
    tiers = [(t.name, sorted(t.block_keys()), t.usage(), vars(t.stats) | {"lock": None}) for t in store.tiers]
    flow = (store.flow.promotions, store.flow.demotions, store.flow.write_through, store.flow.dropped_background_writes)
    return store.drain_events(), flow, tiers, store.background_bytes


@pytest.mark.parametrize(("policy", "nvme_admit", "uses_limit", "nvme_blocks"),
                         [("lazy", 1, 262_144, 60), ("lazy", 1, 262_144, 25), ("lazy", 2, 40, 60),
                          ("eager", 2, 40, 60)])
def test_the_model_store_moves_blocks_down_as_the_agents_store(policy: str, nvme_admit: int, uses_limit: int,
                                                               nvme_blocks: int) -> None:
    """The simulation's store (`ModelTierStore`: saves into DRAM and blocks a model tier pushes out, as hashes)
    announces, demotes, counts and leaves every tier exactly as the agent's `TierStore` over the same tiers, under
    a random mix of saves, loads (promotions), deletions and upkeep: DRAM and NVMe past their capacity and
    watermarks, chains longer than DRAM (it refuses their tails, which go below), demotions into NVMe and on into
    the shared tier (its TTL passing), an NVMe smaller than DRAM (a demotion pushes out blocks it brought), blocks
    NVMe admits only when reused, a use counter that forgets (a forgotten block goes nowhere)."""
    rng = random.Random(3)
    config = AgentConfig(write_policy=policy, nvme_admit_reuse=nvme_admit, shared_admit_reuse=1, shared_ttl_s=50)
    clock = Clock()

    def tiers() -> dict[str, Any]:
        return {"dram": DramModel(40, 0.9, 0.6), "nvme": NvmeModel(nvme_blocks, 0.9, 0.6),
                "shared": FleetSharedTier(FleetBackend(150, clock), config.shared_ttl_s)}

    ours = ModelTierStore(config, **tiers(), uses_limit=uses_limit)
    agents = TierStore(config, **tiers(), executor=InlineExecutor(), chain_events=False)
    agents.uses = HashUseCounter(uses_limit)
    for _ in range(1500):
        clock.now += rng.random()
        if rng.random() < 0.9:
            hashes = [rng.randrange(300) for _ in range(rng.randint(1, 30))]
        else:  # longer than DRAM: it refuses the tail, which goes below
            hashes = rng.sample(range(300), rng.randint(41, 80))
        op, parent, tier = rng.random(), rng.choice([None, 7]), rng.randrange(2)
        for store in (ours, agents):
            if op < 0.45:
                store.store_chain(0, hashes, [b"\x00"] * len(hashes), parent, [None] * len(hashes))
            elif op < 0.75:
                count, _where = store.lookup(0, hashes)
                store.load_chain(0, hashes[:count], [memoryview(bytearray(1))] * count)
            elif op < 0.8:
                store.tiers[tier].delete((0, hashes[0]))
            else:
                store.maintain()
        assert stack_state(ours) == stack_state(agents)
        assert [ours.lookup(0, [h]) for h in hashes] == [agents.lookup(0, [h]) for h in hashes]
    moved = ours.flow.demotions if policy == "lazy" else ours.flow.write_through
    assert moved[TierName.NVME] > 50 and moved[TierName.SHARED] > 50 and ours.tiers[1].stats.evictions > 50


def test_the_fleet_store_is_an_exact_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet's store (block hashes in use order, `HashLru`) keeps, expires and forgets blocks exactly as an
    ordered dict with a bound does, also when one write pushes out many blocks."""
    rng = random.Random(11)
    clock = Clock()
    fleet = FleetBackend(capacity=100, clock=clock)
    reference: OrderedDict[int, float] = OrderedDict()
    for _ in range(4000):
        clock.now += rng.random()
        keys = [(0, rng.randrange(500)) for _ in range(rng.randint(1, 250))]
        op = rng.random()
        if op < 0.4:
            fleet.put(keys, 30.0)
            for _layout, h in keys:
                reference[h] = clock.now + 30.0
                reference.move_to_end(h)
                if len(reference) > 100:
                    reference.popitem(last=False)
        elif op < 0.8:
            for key in keys:
                expiry = reference.get(key[1])
                live = expiry is not None and expiry > clock.now
                if live:
                    reference.move_to_end(key[1])
                assert fleet.get(key) == live
        elif op < 0.9:
            fleet.delete(keys[0])
            reference.pop(keys[0][1], None)
        assert [fleet.has(k) for k in keys] == [reference.get(k[1], 0.0) > clock.now for k in keys]
        assert list(fleet.keys()) == [(0, h) for h, expiry in reference.items() if expiry > clock.now]


@pytest.mark.parametrize("slack", [4096, 3])
def test_the_hash_keyed_shared_index_is_an_ordered_dict(monkeypatch: pytest.MonkeyPatch, slack: int) -> None:
    """Each replica's shared-tier index in the simulation (hashes in use order, `HashLru`) answers, orders and
    gives up its oldest and newest entries exactly as the ordered dict of block keys it stands for, under a random
    mix of the operations the shared tier uses, through its table's growth and its log's rewrites."""
    monkeypatch.setattr(hash_lru, "STALE_SLACK", slack)
    rng = random.Random(5)
    index = HashKeyedIndex()
    reference: OrderedDict[tuple[int, int], tuple[float, int]] = OrderedDict()
    for step in range(20000):
        key = (0, rng.randrange(300))
        value = (float(step), rng.randrange(3))
        op = rng.random()
        if op < 0.35:
            index[key] = value
            reference[key] = value
        elif op < 0.5:
            if key in reference:
                index.move_to_end(key)
                reference.move_to_end(key)
        elif op < 0.65:
            assert index.pop(key, None) == reference.pop(key, None)
        elif op < 0.7 and key in reference:
            del index[key]
            del reference[key]
        elif op < 0.85:
            for _ in range(rng.randrange(4)):
                if not reference:
                    break
                last = rng.random() < 0.2
                assert index.popitem(last=last) == reference.popitem(last=last)
        oldest = index.first()
        assert oldest == (next(iter(reference.items())) if reference else None)
        assert (key in index) == (key in reference) and index.get(key) == reference.get(key)
        assert len(index) == len(reference)
    assert list(index.items()) == list(reference.items()) and list(index) == list(reference)


def test_the_tier_models_hold_a_block_in_a_few_bytes() -> None:
    """NVMe, the fleet's store and the shared-tier index under LRU traffic at 12,000 blocks keep a block in at most
    40 bytes of arrays (and a value's pointer where it has one): a dict took 57 per block at a replica's 176,000
    NVMe blocks, and an int object of 48 bytes for each hash no other structure held."""
    rng = random.Random(2)
    clock = Clock()
    nvme, fleet, index = NvmeModel(12_000, 0.9, 0.6), FleetBackend(12_000, clock), HashKeyedIndex()
    out = memoryview(bytearray(1))
    seen: list[tuple[int, int]] = []
    for _ in range(3000):
        keys = [(0, rng.randrange(1 << 64)) for _ in range(rng.randint(1, 64))]
        seen += keys
        keys += rng.sample(seen[-20_000:], min(16, len(seen)))  # some used again
        nvme.store_many([StoreItem(k, b"\x00", None) for k in keys])
        nvme.read_many(keys, [out] * len(keys))
        fleet.put(keys, 30.0)
        for key in keys:
            fleet.get(key)
            if key in index:
                index.move_to_end(key)
            else:
                index[key] = (0.0, 1)
                if len(index) > 12_000:
                    index.popitem(last=False)
    for lru in (nvme._lru, fleet._expiry, index.by_hash):
        assert len(lru) == 12_000
        arrays = lru._log.itemsize * len(lru._log) + lru._places.itemsize * len(lru._places)
        assert arrays <= 40 * len(lru)
        assert lru._values is None or len(lru._values) == len(lru._log)


@pytest.mark.parametrize("limit", [2, 10, 64])
def test_the_hash_keyed_use_counter_counts_and_forgets_as_the_agents(limit: int) -> None:
    """The simulation's use counter (arrays and a table of places) against the agent's dict: the same counts, one
    at a time and in chains, and the same forgetting, over hashes that share their low bits (the table's place)."""
    rng = random.Random(limit)
    hashes = [rng.randrange(1 << 64) & ~0xFFFF | rng.randrange(4) for _ in range(4 * limit + 8)]
    ours, chains, agents = HashUseCounter(limit), HashUseCounter(limit), UseCounter(limit)
    for _ in range(500):
        keys: list[BlockKey] = [(0, rng.choice(hashes)) for _ in range(rng.randint(1, 6))]
        expected = [agents.bump(key[1]) for key in keys]  # type: ignore[arg-type]
        assert [ours.bump(key) for key in keys] == expected and chains.bump_all(keys) == expected
        assert [ours.get((0, h)) for h in hashes] == [agents.get(h) for h in hashes]  # type: ignore[arg-type]
        assert len(ours) == len(chains) == len(agents._counts)


@pytest.mark.parametrize("low_bits", [2, 12])
def test_the_hash_lru_is_an_ordered_dict(low_bits: int) -> None:
    """`HashLru` (a log and a table of places) against an OrderedDict: touches, adds, uses (touch or add in one
    probe), removals and the oldest taken, over hashes that share their low bits (long probe runs, deletions
    shifting them back) or do not, through its growth and the rewrites of its log."""
    rng = random.Random(low_bits)
    hashes = [rng.randrange(1 << 64) & ~((1 << low_bits) - 1) | rng.randrange(1 << low_bits) for _ in range(3000)]
    hashes[0] = 0
    lru, reference = HashLru(), OrderedDict[int, None]()
    for step in range(40_000):
        h = rng.choice(hashes)
        op = rng.random()
        if op < 0.5:
            held = h in reference
            assert (lru.use(h) if op < 0.25 else lru.touch(h)) == held
            if held:
                reference.move_to_end(h)
            else:
                if op >= 0.25:
                    lru.add(h)
                reference[h] = None
        elif op < 0.7:
            assert lru.remove(h) == (reference.pop(h, 0) is None)
        elif reference:
            assert lru.pop_oldest() == reference.popitem(last=False)[0]
        assert len(lru) == len(reference) and (h in lru) == (h in reference)
        assert lru.oldest() == next(iter(reference), None)
        if step % 1000 == 0:
            assert list(lru) == list(reference)
    assert list(lru) == list(reference)
