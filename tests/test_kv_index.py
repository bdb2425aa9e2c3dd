"""The block index's order of arrival per worker (what its bound drops first, what forgetting a worker walks): a
log of 64-bit keys, checked against the insertion-ordered dict per worker it replaced."""

from __future__ import annotations

import math
import random

import pytest

from kvcore import dict_tables
from kvcore.kv_events import CPU, DISK, GPU, SHARED
from router.kv_index import InMemoryKvIndex


def _reference_step(order: dict[str, dict[int, set[str]]], worker: str, keys: list[int], tier: str,
                    adding: bool) -> None:
    """The old bookkeeping: per worker, key -> tiers in a dict whose insertion order is the key's arrival."""
    held = order[worker]
    for key in keys:
        tiers = held.get(key)
        if adding:
            if tiers is None:
                held[key] = {tier}
            else:
                tiers.add(tier)
        elif tiers is not None and tier in tiers:
            tiers.discard(tier)
            if not tiers:
                del held[key]


def test_arrival_order_matches_an_insertion_ordered_dict_and_the_log_stays_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dict_tables, "MIN_ENTRIES", 0)  # dicts copied into themselves as they churn (compact_tables)
    rng = random.Random(11)
    index = InMemoryKvIndex()
    index.compact_tables()
    index.STALE_SLACK = 2  # rewrite the logs often
    workers = [f"w{i}" for i in range(4)]
    order: dict[str, dict[int, set[str]]] = {w: {} for w in workers}
    pool = [rng.getrandbits(64) for _ in range(120)]
    rewrites = 0
    for step in range(6000):
        worker = rng.choice(workers)
        start = rng.randrange(len(pool))
        keys = pool[start:start + rng.randrange(1, 12)]
        tier = rng.choice([GPU] * 9 + [CPU, DISK, SHARED])
        adding = rng.random() < 0.5
        wid = index._ids.get(worker)
        length = len(index._arrivals[wid].keys) if wid is not None else 0
        if adding:
            index.add(worker, keys, tier)
        else:
            index.remove(worker, keys, tier)
        _reference_step(order, worker, keys, tier, adding)
        wid = index._ids.get(worker)
        if wid is not None:
            arrivals = index._arrivals[wid]
            rewrites += adding and len(arrivals.keys) < length
            assert index._held_in_order(wid) == list(order[worker]), step
            assert arrivals.held == len(order[worker])
            if len(arrivals.keys) > length:  # an add that appended rewrites the log if need be (removals only
                # make appearances stale)
                assert len(arrivals.keys) <= 2 * arrivals.held + index.STALE_SLACK
        if step % 700 == 699:
            index.clear(worker)
            order[worker] = {}
            assert index.holds(worker) == set()
    assert rewrites > 10  # the logs were rewritten, and the order survived it
    assert index.entries() == sum(len(held) for held in order.values())


def test_the_bound_drops_each_workers_oldest_blocks_in_proportion() -> None:
    rng = random.Random(5)
    index = InMemoryKvIndex(max_entries=2000)
    order: dict[str, dict[int, set[str]]] = {"a": {}, "b": {}}
    keys = [rng.getrandbits(64) for _ in range(3000)]
    # 'a' gets 1,200 blocks, loses some of its first and gets them back (they are then its newest)
    index.add("a", keys[:1200], GPU)
    _reference_step(order, "a", keys[:1200], GPU, True)
    index.remove("a", keys[:100], GPU)
    _reference_step(order, "a", keys[:100], GPU, False)
    index.add("a", keys[:100], DISK)
    _reference_step(order, "a", keys[:100], DISK, True)
    index.add("b", keys[1200:1800], CPU)
    _reference_step(order, "b", keys[1200:1800], CPU, True)
    assert index.dropped == 0 and index.entries() == 1800
    index.add("b", keys[1800:2300], GPU)  # 2,300 > 2,000: down to 1,800
    _reference_step(order, "b", keys[1800:2300], GPU, True)
    share = 1 - 1800 / 2300
    kept = {}
    for worker, held in order.items():
        ordered = list(held)
        kept[worker] = set(ordered[math.ceil(len(ordered) * share):])
    for worker in order:
        assert {key for key, _tier in index.holds(worker)} == kept[worker]
    assert index.dropped == sum(len(held) - len(kept[w]) for w, held in order.items())
    assert set(keys[:100]) <= kept["a"]  # arrived again last: not among the oldest
