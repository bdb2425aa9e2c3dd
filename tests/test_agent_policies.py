"""The tier stack's policies: write-through vs demotion, promotion, admission, watermarks, local lookup."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import pytest

from agent.block import HEADER_SIZE, BlockKey
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.policy import TierPolicy, UseCounter
from agent.store import TierStore, build_nvme_tier
from agent.tiers.base import TierName
from agent.tiers.dram import DramTier, block_charge
from kvcore.kv_events import BlockRemoved, BlockStored
from tests.conftest import ValkeyServer

LAYOUT = 7
SIZE = 1000
CHARGE = block_charge(SIZE)  # what a block counts against the agent's DRAM capacity (its bytes and bookkeeping)


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(SIZE))


def make_store(tmp_path: Path, **overrides: Any) -> TierStore:
    settings: dict[str, Any] = dict(dram_capacity=10 * CHARGE, nvme_dir=str(tmp_path / "nvme"),
                                    nvme_capacity=100 * (SIZE + HEADER_SIZE), nvme_fsync=False, nvme_min_free=0,
                                    shared_backend="fs", shared_dir=str(tmp_path / "shared"), io_threads=2)
    settings.update(overrides)
    return TierStore.from_config(AgentConfig(**settings).validate())


def outs(n: int) -> list[memoryview]:
    return [memoryview(bytearray(SIZE)) for _ in range(n)]


def media(events: list[Any], kind: type[BlockStored] | type[BlockRemoved]) -> dict[str | None, list[Any]]:
    found: dict[str | None, list[Any]] = {}
    for event in events:
        if isinstance(event, (BlockStored, BlockRemoved)) and isinstance(event, kind):
            found.setdefault(event.medium, []).extend(event.block_hashes)
    return found


def test_eager_writes_through_to_every_tier(tmp_path: Path) -> None:
    store = make_store(tmp_path, write_policy="eager")
    assert store.store_chain(LAYOUT, [1, 2, 3], [payload(i) for i in (1, 2, 3)]) == 3
    store.drain()
    assert store.lookup(LAYOUT, [1, 2, 3, 4]) == (3, "CCC")
    assert store.nvme is not None and store.shared is not None
    assert all(store.nvme.contains((LAYOUT, h)) and store.shared.contains((LAYOUT, h)) for h in (1, 2, 3))
    stored = media(store.drain_events(), BlockStored)
    assert sorted(stored["CPU"]) == [1, 2, 3] and sorted(stored["DISK"]) == [1, 2, 3]
    assert sorted(stored["SHARED"]) == [1, 2, 3]
    assert store.flow.write_through == {"nvme": 3, "shared": 3}
    store.close()


def test_lazy_demotes_on_pressure_and_promotes_on_hit(tmp_path: Path) -> None:
    store = make_store(tmp_path, write_policy="lazy")
    store.store_chain(LAYOUT, list(range(10)), [payload(i) for i in range(10)])
    store.drain()
    assert store.nvme is not None and store.nvme.usage().blocks == 0  # nothing moves without pressure
    store.store_chain(LAYOUT, list(range(100, 105)), [payload(i) for i in range(100, 105)])
    store.drain()
    assert store.nvme.usage().blocks == 5 and store.flow.demotions[TierName.NVME] == 5
    assert store.shared is not None and store.shared.usage().blocks == 0
    count, where = store.lookup(LAYOUT, list(range(10)))
    assert count == 10 and where.count("D") == 5 and where.count("C") == 5
    buffers = outs(10)
    assert store.load_chain(LAYOUT, list(range(10)), buffers) == [SIZE] * 10
    assert [bytes(b) for b in buffers] == [payload(i) for i in range(10)]
    assert store.flow.promotions[TierName.NVME] == 5
    assert store.dram is not None and all(store.dram.contains((LAYOUT, i)) for i in range(10))
    events = store.drain_events()
    assert len(media(events, BlockRemoved)["CPU"]) >= 5
    store.close()


def test_admission_by_reuse_count(tmp_path: Path) -> None:
    store = make_store(tmp_path, write_policy="eager", nvme_admit_reuse=2, shared_admit_reuse=3)
    store.store_chain(LAYOUT, [1], [payload(1)])
    store.drain()
    assert store.nvme is not None and store.shared is not None
    assert not store.nvme.contains((LAYOUT, 1))
    store.dram.delete((LAYOUT, 1))  # type: ignore[union-attr]
    store.store_chain(LAYOUT, [1], [payload(1)])  # second use: NVMe admits it, the shared tier not yet
    store.drain()
    assert store.nvme.contains((LAYOUT, 1)) and not store.shared.contains((LAYOUT, 1))
    assert store.load_chain(LAYOUT, [1], outs(1)) == [SIZE]  # third use (a hit)
    store.dram.delete((LAYOUT, 1))  # type: ignore[union-attr]
    store.store_chain(LAYOUT, [1], [payload(1)])
    store.drain()
    assert store.shared.contains((LAYOUT, 1))
    store.close()


def test_watermarks_demote_in_background(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_high_watermark=0.5, dram_low_watermark=0.3)
    store.store_chain(LAYOUT, list(range(8)), [payload(i) for i in range(8)])
    assert store.dram is not None and store.dram.usage().blocks == 8
    store.maintain()
    store.drain()
    assert store.dram.usage().blocks == 3
    assert store.nvme is not None and store.nvme.usage().blocks == 5
    assert store.lookup(LAYOUT, list(range(8)))[0] == 8


def test_nvme_pressure_demotes_to_shared(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_capacity=0, nvme_capacity=10 * (SIZE + HEADER_SIZE),
                       nvme_high_watermark=0.5, nvme_low_watermark=0.2, nvme_layout="files")  # exact LRU
    store.store_chain(LAYOUT, list(range(8)), [payload(i) for i in range(8)])
    store.maintain()
    assert store.nvme is not None and store.nvme.usage().blocks == 2
    assert store.shared is not None and store.shared.usage().blocks >= 6
    count, where = store.lookup(LAYOUT, list(range(8)))
    assert count == 8 and where == "SSSSSSDD"
    buffers = outs(8)
    assert store.load_chain(LAYOUT, list(range(8)), buffers) == [SIZE] * 8
    assert bytes(buffers[0]) == payload(0) and store.flow.promotions[TierName.SHARED] == 0  # no DRAM tier


@pytest.mark.parametrize("layout", ["segments", "files"])
def test_nvme_full_by_its_count_demotes_to_shared_in_the_background(tmp_path: Path, layout: str) -> None:
    """An NVMe tier holds a block per KiB of its capacity at most (INDEX_ENTRY_FLOOR): a tier of small blocks is
    full by that count long before its bytes. Its watermarks looked at bytes only, so background eviction never
    started; the blocks went one by one when a store met the count, dropped, never demoted to the shared tier (a
    16 KiB tier of 16 blocks, 12 held, its high watermark 8: maintain() left all 12). The count has the bytes'
    watermarks now."""
    store = make_store(tmp_path, dram_capacity=0, nvme_capacity=16 * 2**10, nvme_high_watermark=0.5,
                       nvme_low_watermark=0.2, nvme_layout=layout)
    assert store.nvme is not None and store.shared is not None
    for i in range(0, 12, 2):  # (six stores: the segments layout seals a segment at an eighth of the count)
        store.store_chain(LAYOUT, [i, i + 1], [bytes([i]) * 16, bytes([i + 1]) * 16])
    assert store.nvme.usage().blocks == 12 and store.nvme.usage().used_bytes < 2**10  # far under its bytes' mark
    store.maintain()
    assert store.nvme.usage().blocks <= 16 * 0.2
    assert store.shared.usage().blocks >= 12 - 3 and store.flow.demotions[TierName.SHARED] >= 9
    assert store.lookup(LAYOUT, list(range(12)))[0] == 12  # none lost: the oldest went to the shared tier


def test_load_stops_at_the_first_missing_or_bad_block(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_capacity=0, nvme_layout="files")
    store.store_chain(LAYOUT, [1, 2, 3], [payload(i) for i in (1, 2, 3)])
    assert store.nvme is not None
    path = next(p for p in (tmp_path / "nvme" / "blocks").rglob("*") if p.name.endswith(f"{2:016x}"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    assert store.load_chain(LAYOUT, [1, 2, 3], outs(3)) == [SIZE]
    assert store.nvme.stats.checksum_failures == 1
    assert store.lookup(LAYOUT, [1, 2, 3]) == (1, "D")


def test_shared_blocks_of_another_replica(valkey: ValkeyServer, tmp_path: Path) -> None:
    a = make_store(tmp_path / "a", shared_backend="redis", shared_url=valkey.url, write_policy="eager")
    b = make_store(tmp_path / "b", shared_backend="redis", shared_url=valkey.url)
    a.store_chain(LAYOUT, [1, 2, 3], [payload(i) for i in (1, 2, 3)])
    a.drain()
    assert b.lookup(LAYOUT, [1, 2, 3]) == (0, "")
    assert b.probe_shared(LAYOUT, [1, 2, 3]) == 3
    assert b.lookup(LAYOUT, [1, 2, 3]) == (3, "SSS")
    buffers = outs(3)
    assert b.load_chain(LAYOUT, [1, 2, 3], buffers) == [SIZE] * 3
    assert bytes(buffers[2]) == payload(3)
    assert b.lookup(LAYOUT, [1, 2, 3]) == (3, "CCC")  # promoted
    assert b.flow.promotions[TierName.SHARED] == 3
    a.close()
    b.close()


def test_lookup_of_1000_hashes_is_well_under_a_millisecond(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_capacity=2000 * block_charge(16), nvme_dir="")
    hashes = [(i * 2654435761) % 2**64 for i in range(1000)]
    store.store_chain(LAYOUT, hashes, [b"x" * 16] * 1000)
    assert store.lookup(LAYOUT, hashes) == (1000, "C" * 1000)
    timings = []
    for _ in range(50):
        started = time.process_time()
        store.lookup(LAYOUT, hashes)
        timings.append(time.process_time() - started)
    assert statistics.median(timings) < 0.001, timings


def test_config_rejects_bad_policies() -> None:
    import pytest

    from kvcore.config import ConfigError

    with pytest.raises(ConfigError):
        AgentConfig(write_policy="sometimes").validate()
    with pytest.raises(ConfigError):
        AgentConfig(dram_low_watermark=0.99, dram_high_watermark=0.5).validate()
    with pytest.raises(ConfigError, match="max_connecting_clients"):
        AgentConfig(max_connecting_clients=0).validate()
    assert dataclasses.replace(AgentConfig(), write_policy="eager").validate().write_policy == "eager"


def test_a_bad_nvme_copy_is_replaced_by_the_shared_one(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_capacity=0, write_policy="eager", nvme_layout="files")
    store.store_chain(LAYOUT, [1, 2, 3], [payload(i) for i in (1, 2, 3)])
    path = next(p for p in (tmp_path / "nvme" / "blocks").rglob("*") if p.name.endswith(f"{2:016x}"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    buffers = outs(3)
    assert store.load_chain(LAYOUT, [1, 2, 3], buffers) == [SIZE] * 3
    assert [bytes(b) for b in buffers] == [payload(i) for i in (1, 2, 3)]
    assert store.nvme is not None and store.nvme.stats.checksum_failures == 1
    assert store.shared is not None and store.shared.stats.hits == 1


def test_config_from_env_file_and_flags(tmp_path: Path) -> None:
    import argparse

    from agent.config import ENV_PREFIX
    from kvcore.config import add_config_arguments, load_config

    (tmp_path / "agent.yaml").write_text("nvme-dir: /data/kv\nshared_ttl_s: 60\n")
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, AgentConfig, ENV_PREFIX)
    args = parser.parse_args(["--config", str(tmp_path / "agent.yaml"), "--write-policy", "eager"])
    env = {"KVGATE_AGENT_DRAM_CAPACITY": "2GiB", "KVGATE_AGENT_WRITE_POLICY": "lazy",
           "KVGATE_AGENT_NVME_FSYNC": "false"}
    config = load_config(AgentConfig, ENV_PREFIX, args, environ=env).validate()
    assert config.dram_capacity == 2 * 2**30 and config.nvme_dir == "/data/kv" and config.shared_ttl_s == 60
    assert config.write_policy == "eager" and config.nvme_fsync is False  # flags beat env beats file


def test_every_tier_reports_the_blocks_it_loses(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_capacity=0, write_policy="eager", nvme_layout="files")
    store.store_chain(LAYOUT, [1, 2], [payload(1), payload(2)])
    assert media(store.drain_events(), BlockStored) == {"DISK": [1, 2], "SHARED": [1, 2]}
    for root in (tmp_path / "nvme" / "blocks", tmp_path / "shared"):  # both copies of block 2 vanish
        next(p for p in root.rglob("*") if p.name.endswith(f"{2:016x}")).unlink()
    assert store.load_chain(LAYOUT, [1, 2], outs(2)) == [SIZE]
    assert media(store.drain_events(), BlockRemoved) == {"DISK": [2], "SHARED": [2]}
    assert store.lookup(LAYOUT, [1, 2]) == (1, "D")


def test_policy_decisions() -> None:
    below = [TierName.NVME, TierName.SHARED]
    lazy = TierPolicy(eager=False, nvme_admit_reuse=2, shared_admit_reuse=1)
    assert lazy.write_through(below, 5) == []  # lazy: nothing moves on a store
    assert lazy.demote_to(below, 1) is TierName.SHARED  # NVMe wants a second use first
    assert lazy.demote_to(below, 2) is TierName.NVME
    assert lazy.demote_to([], 9) is None
    eager = TierPolicy(eager=True, nvme_admit_reuse=1, shared_admit_reuse=3)
    assert eager.write_through(below, 1) == [TierName.NVME]
    assert eager.write_through(below, 3) == below
    assert eager.demote_to(below, 9) is None  # written through already
    assert TierPolicy.from_config(AgentConfig(write_policy="eager", promote_on_hit=False)) == TierPolicy(
        eager=True, promote_on_hit=False)


def test_eager_with_admission_writes_a_block_through_once_it_is_used_enough(tmp_path: Path) -> None:
    """Issue 14: under eager with --nvme-admit-reuse 2 a block stored again (or hit) in DRAM never went below."""
    store = make_store(tmp_path, write_policy="eager", nvme_admit_reuse=2, shared_admit_reuse=3)
    assert store.nvme is not None and store.shared is not None
    store.store_chain(LAYOUT, [1, 2], [payload(1), payload(2)])
    store.drain()
    assert not store.nvme.contains((LAYOUT, 1))
    store.store_chain(LAYOUT, [1, 2], [payload(1), payload(2)])  # the same chain again, still in DRAM
    store.drain()
    assert store.nvme.contains((LAYOUT, 1)) and store.nvme.contains((LAYOUT, 2))
    assert not store.shared.contains((LAYOUT, 1))
    assert store.load_chain(LAYOUT, [1], outs(1)) == [SIZE]  # a DRAM hit is the third use
    store.drain()
    assert store.shared.contains((LAYOUT, 1)) and not store.shared.contains((LAYOUT, 2))
    assert store.flow.write_through == {"nvme": 2, "shared": 1}
    store.close()


def test_demotion_before_eviction_moves_blocks_in_groups(tmp_path: Path) -> None:
    """Issue 14: lazy demotion read and wrote one block at a time (a round trip / a write per block)."""
    store = make_store(tmp_path, dram_capacity=0, nvme_capacity=40 * (SIZE + HEADER_SIZE),
                       nvme_high_watermark=0.5, nvme_low_watermark=0.1, nvme_layout="files")
    writes: list[TierName] = []
    store.observe = lambda op, tier, _s: writes.append(tier) if op == "store" else None
    for i in range(24):  # one block per store: 24 NVMe writes
        store.store_chain(LAYOUT, [i], [payload(i)])
    writes.clear()
    store.maintain()
    assert store.flow.demotions[TierName.SHARED] >= 15
    assert writes.count(TierName.SHARED) == 1, writes
    count, where = store.lookup(LAYOUT, list(range(24)))
    assert count == 24 and where.count("S") >= 15
    buffers = outs(24)
    assert store.load_chain(LAYOUT, list(range(24)), buffers) == [SIZE] * 24
    assert [bytes(b) for b in buffers] == [payload(i) for i in range(24)]
    store.close()


@pytest.mark.parametrize("chain_events", [True, False])
def test_blocks_demoted_leaf_by_leaf_are_announced_per_chain_or_per_write(chain_events: bool) -> None:
    """vLLM's events name a chain per BlockStored; blocks DRAM pushes out leave one leaf at a time (a chain's
    tail first), so a demotion was an event per block. A reader that places announced blocks by their hash alone
    (the simulator's gateway) gets one event per write instead: the same blocks, in the same order."""
    from bench.sim.tier_model import InlineExecutor, NvmeModel

    store = TierStore(AgentConfig().validate(), dram=DramTier(4), nvme=NvmeModel(100, 0.95, 0.85),
                      executor=InlineExecutor(), chain_events=chain_events)
    store.store_chain(0, [1, 2, 3], [b"x"] * 3)
    store.drain_events()
    store.store_chain(0, [11, 12, 13], [b"x"] * 3)  # DRAM holds 4 blocks: 3 and 2 move down to NVMe
    disk = [e for e in store.drain_events() if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert [h for e in disk for h in e.block_hashes] == [3, 2]
    assert len(disk) == (2 if chain_events else 1)


class HeldExecutor(Executor):
    """Runs what is submitted only when told: background writes held back, as on a busy machine."""

    def __init__(self) -> None:
        self.held: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.held.append((fn, args))
        return Future()

    def run_held(self) -> None:
        held, self.held = self.held, []
        for fn, args in held:
            fn(*args)


def test_write_through_counts_each_block_once_when_a_hit_comes_before_the_store_write(tmp_path: Path) -> None:
    """A hit right after an eager store schedules a second write-through of the same blocks before the first
    has run; the second writes nothing, and counted every block again (write_through_total 20 for 10 blocks)."""
    config = AgentConfig(dram_capacity=10 * SIZE, nvme_dir=str(tmp_path / "nvme"),
                         nvme_capacity=100 * (SIZE + HEADER_SIZE), nvme_fsync=False, nvme_min_free=0,
                         write_policy="eager").validate()
    executor = HeldExecutor()
    store = TierStore(config, dram=DramTier(config.dram_capacity), nvme=build_nvme_tier(config), executor=executor)
    hashes = list(range(100, 110))
    assert store.store_chain(LAYOUT, hashes, [b"x" * SIZE] * 10) == 10
    assert store.load_chain(LAYOUT, hashes, outs(10)) == [SIZE] * 10
    assert len(executor.held) == 2  # the store's write-through and the hit's
    executor.run_held()
    assert store.nvme is not None and all(store.nvme.contains((LAYOUT, h)) for h in hashes)
    assert store.flow.write_through[TierName.NVME] == 10



def test_background_bytes_are_the_writes_not_done_yet(tmp_path: Path) -> None:
    """`kvgate_agent_background_bytes`: what the lower tiers were sent and do not hold yet, so a reader of a lower
    tier (tests/test_connector_parallel.py reads the NVMe files) can tell a write still on its way from one that
    never comes."""
    config = AgentConfig(dram_capacity=10 * SIZE, nvme_dir=str(tmp_path / "nvme"),
                         nvme_capacity=100 * (SIZE + HEADER_SIZE), nvme_fsync=False, nvme_min_free=0,
                         write_policy="eager").validate()
    executor = HeldExecutor()
    store = TierStore(config, dram=DramTier(config.dram_capacity), nvme=build_nvme_tier(config), executor=executor)
    registry = AgentMetrics(store).registry
    assert registry.get_sample_value("kvgate_agent_background_bytes") == 0
    assert store.store_chain(LAYOUT, [1, 2, 3], [payload(i) for i in (1, 2, 3)]) == 3
    assert store.nvme is not None and not any(store.nvme.contains((LAYOUT, h)) for h in (1, 2, 3))
    assert registry.get_sample_value("kvgate_agent_background_bytes") == 3 * SIZE
    executor.run_held()
    assert all(store.nvme.contains((LAYOUT, h)) for h in (1, 2, 3))
    assert registry.get_sample_value("kvgate_agent_background_bytes") == 0


def test_the_in_memory_part_of_a_store_writes_no_medium(tmp_path: Path) -> None:
    """What the agent's event loop does itself (`store_in_memory`): a chain longer than the DRAM tier keeps its head
    in DRAM and hands back its tail, which reaches NVMe only through `store_refused` (the request pool's part)."""
    store = make_store(tmp_path, dram_capacity=3 * CHARGE, shared_backend="none", write_policy="eager")
    held, refused = store.store_in_memory(LAYOUT, list(range(6)), [payload(i) for i in range(6)])
    assert held == 3 and [item.key[1] for item, _uses in refused] == [3, 4, 5]
    assert store.lookup(LAYOUT, list(range(6))) == (3, "CCC")
    assert store.store_refused(refused) == 3
    store.drain()
    assert store.lookup(LAYOUT, list(range(6))) == (6, "CCCDDD")
    loaded = outs(6)
    assert store.load_chain(LAYOUT, list(range(6)), loaded) == [SIZE] * 6
    assert [bytes(b) for b in loaded] == [payload(i) for i in range(6)]


def test_the_use_counter_forgets_its_oldest_half_when_full() -> None:
    """Past its limit the counter keeps the newer half of the blocks it counts (by first count), one at a time
    and in a chain alike, with their counts."""
    rng = random.Random(3)
    one, chains = UseCounter(limit=10), UseCounter(limit=10)
    reference: dict[BlockKey, int] = {}
    for _ in range(300):
        keys: list[BlockKey] = [(0, rng.randrange(40)) for _ in range(rng.randint(1, 6))]
        expected = []
        for key in keys:
            reference[key] = reference.get(key, 0) + 1
            expected.append(reference[key])
            if len(reference) > 10:
                for old in list(reference)[:5]:
                    del reference[old]
        assert [one.bump(k) for k in keys] == expected and chains.bump_all(keys) == expected
        assert [one.get(k) for k in reference] == list(reference.values()) == [chains.get(k) for k in reference]
        assert len(one._counts) == len(chains._counts) == len(reference)
