"""`kvgate bench vsim`: a whole fleet in virtual time, in one process, without HTTP.

The pieces are the real ones: the routing strategies (`strategies/`, with their clock set to virtual time), the
gateway's block keys (`router.block_keys`), the KV event applier and block index the `kv` strategy reads
(`router.kv_apply.KvEventApplier` applying the engines' own event batches), and the simulator's engine per
replica (`bench/sim`: vLLM's block pool, prefix cache, scheduler, and the profile's step-time model). An event
queue replaces the clock: arrivals, engine steps and metric scrapes happen at their virtual times, so a whole
Mooncake trace over 8-64 replicas replays in minutes.

Tiers (`--tiers`): each replica runs the tier agent's own tier stack (bench/sim/tier_model.py: the agent's
`TierStore` and policies over stand-in bytes, its DRAM tier's prefix order and NVMe as an LRU modelled, one
shared store for the fleet):
every chain of blocks the engine computes is handed to it, as the connector does; `lazy` demotes what DRAM and
NVMe push out, `eager` writes through to NVMe and shared at once; a block enters NVMe / shared only after
`admit_reuse` uses; a hit on NVMe / shared is promoted to DRAM; the watermark upkeep runs every 0.2 s. At
admission a replica loads the run of blocks after its GPU prefix hit from its tiers, which delays the request by
the transfer (latency + bytes / bandwidth per run of blocks from one tier, bench/sim/offload.py) and saves their
prefill; the agents' KV events (CPU / DISK / SHARED) go to the `kv` strategy. Capacities are in blocks;
bandwidths and latencies are flags.

A gateway of several processes (`--strategies ttft:p2`, `kvgate serve --processes 2`): each request goes to one of
them at random, each with its own strategy and its own count of requests in flight per replica, all fed the same
KV events and engine metrics; each tells the others where it routed a request, its first token and its end, in
batches `FLUSH_S` (2 ms) after the first record of each, as router/sibling_routes.py writes them (the socket's own
time not modelled); the long prefills' turns are per replica, as the gateway's are (process 0 keeps them).

Not modelled: the HTTP and tokenization time of the gateway, event delivery delay (events apply at the end of the
step that made them, plus `--event-delay-s`), the sim's engine lag.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gc
import heapq
import itertools
import math
import random
import shlex
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

import orjson
from tqdm import tqdm
from xxhash import xxh3_64_intdigest

from agent.config import AgentConfig
from agent.tiers.base import TierName
from bench import machine, vsim_report, workloads
from bench.calibrate import ttft_options
from bench.sim.hash_map import U64Map
from bench.sim.kv_cache import BlockPool, KvBlock, KvCacheManager
from bench.sim.offload import TierLink, transfer_seconds
from bench.sim.perf_model import PROFILES, Profile, load_profile
from bench.sim.scheduler import Scheduler, SimRequest
from bench.sim.tier_model import UPKEEP_S, FleetBackend, ReplicaAgent
from bench.stats import percentile
from bench.sweep import Job, run_sweep
from bench.traces import Trace, TraceError, TraceSource
from bench.workloads import PromptVocabulary, RequestSource, Workload, WorkloadSource
from kvcore.config import ConfigError, load_config
from kvcore.kv_events import DISK, GPU, BlockHash, BlockStored, KvEvent
from kvcore.vllm_hash import BlockHasher, Digest
from kvgate.serve import assemble
from router.block_keys import BlockKey, block_keys, chain_key, chain_keys, root_key
from router.config import WorkerSpec
from router.kv_apply import KvEventApplier
from router.kv_index import InMemoryKvIndex
from router.kv_transport import EventSource, cache_name
from router.metrics import GatewayMetrics
from router.pool import Worker
from router.prefill_turns import hold_seconds
from router.routing import Decision, RouteRequest, Strategy
from router.sibling_routes import FLUSH_S
from strategies import strategy_class
from strategies.balance import PrefillBalance
from strategies.kv import KvAware

MODEL = "tiny"
# The engines hash blocks with a chain of 64-bit xxh3 from a root of their own (the digest is the 64-bit int, which
# is also the event hash) instead of vLLM's sha256 of pickle: events carry 64 bits either way, it costs a tenth,
# and it is still unlike the gateway's keys, so the KV event applier maps engine hashes to its own keys from the
# events' token ids exactly as it does for a real engine.
ENGINE_ROOT = root_key("vsim-engine")
TIERS = ("gpu", *(tier.value for tier in TierName))
_TIER_OF_MEDIUM = {tier.medium: tier.value for tier in TierName}
TRAFFIC_BUCKET_S = 10.0  # the window of a tier's peak traffic
PREDICTION_PAIRS = 4000  # predicted / observed TTFT pairs kept per configuration, for the plot
ROUTED, FIRST_TOKEN, ENDED = "routed", "first_token", "ended"  # what a gateway process tells its siblings


@dataclass(frozen=True)
class TierSettings:
    """Per-replica DRAM / NVMe capacity and the fleet's shared capacity, in blocks; transfer costs; policies."""

    dram_blocks: int = 20_000
    nvme_blocks: int = 200_000
    shared_blocks: int = 2_000_000
    dram_gbps: float = 25.0        # host -> GPU copy (PCIe Gen5 x16, achieved)
    nvme_gbps: float = 5.0
    shared_gbps: float = 10.0
    dram_latency_s: float = 50e-6
    nvme_latency_s: float = 200e-6
    shared_latency_s: float = 2e-3
    write_policy: str = "lazy"     # the agent's write_policy: lazy | eager
    promote_on_hit: bool = True
    nvme_admit_reuse: int = 1
    shared_admit_reuse: int = 1

    def dram_note(self, gpu_blocks: int) -> str | None:
        """A warning when the DRAM tier cannot hold more than a replica's GPU cache: a stored block enters DRAM as it
        is computed, so DRAM then keeps about what the GPU keeps and is almost never hit."""
        if self.dram_blocks > gpu_blocks:
            return None
        return (f"note: --dram-blocks {self.dram_blocks:,} is not larger than a replica's GPU cache "
                f"({gpu_blocks:,} blocks): DRAM keeps about what the GPU keeps and will rarely be hit")

    def agent_config(self) -> AgentConfig:
        """The agent's settings (everything not named here: the agent's defaults, watermarks and TTL included)."""
        return AgentConfig(write_policy=self.write_policy, promote_on_hit=self.promote_on_hit,
                           nvme_admit_reuse=self.nvme_admit_reuse,
                           shared_admit_reuse=self.shared_admit_reuse).validate()

    def ttft_options(self) -> dict[str, float]:
        """The `ttft` strategy's tier links: the same transfer rates and latencies."""
        return {"ttft_cpu_gbps": self.dram_gbps, "ttft_disk_gbps": self.nvme_gbps,
                "ttft_shared_gbps": self.shared_gbps, "ttft_cpu_latency_s": self.dram_latency_s,
                "ttft_disk_latency_s": self.nvme_latency_s, "ttft_shared_latency_s": self.shared_latency_s}

    def links(self, speedup: float = 1.0) -> dict[str, TierLink]:
        """The links a replica's loads take, `speedup` times faster than these settings (`--tiers-sped-up`)."""
        return {TierName.DRAM.code: TierLink(self.dram_gbps * 1e9 * speedup, self.dram_latency_s / speedup),
                TierName.NVME.code: TierLink(self.nvme_gbps * 1e9 * speedup, self.nvme_latency_s / speedup),
                TierName.SHARED.code: TierLink(self.shared_gbps * 1e9 * speedup, self.shared_latency_s / speedup)}


@dataclass
class VRequest:
    """A request in flight (what it needs while it runs; its results go to the simulation's totals)."""

    index: int
    token_ids: list[int]
    keys: list[int]
    digests: list[Digest]  # the engines' digests of the same blocks
    max_tokens: int
    arrival: float = 0.0
    sent: float = 0.0  # when the gateway sent it to its replica: its arrival, or the end of its hold there
    replica: int = -1
    ttft: float | None = None
    # what it waited for before its first step: the engine's step in progress when it was admitted (0 on an
    # idle replica), and its whole wait from arrival (tier loads and the requests ahead included)
    step_wait: float = 0.0
    tier_tokens: dict[str, int] = field(default_factory=dict)
    route: RouteRequest | None = None
    decision: Decision | None = None
    gateway: VirtualGateway | None = None  # the gateway process that routed it


@dataclass(eq=False)
class VirtualGateway:
    """One process of a gateway of several (`kvgate serve --processes N`): its own strategy (routing memory and
    requests in flight) and its own view of the workers (its requests in flight on each), fed the same KV events
    and engine metrics as the others."""

    index: int
    strategy: Strategy
    workers: list[Worker]
    requests: int = 0
    outbox: list[tuple[VRequest, str]] = field(default_factory=list)  # records for the siblings, not yet written


@dataclass(slots=True, eq=False)
class Turn:
    """A long prefill's turn on its replica: the next long prefill goes there once this one has its first token, or
    at `until` (its hold from when it was sent), as the gateway's `PrefillTurns` send them."""

    req: VRequest
    until: float


class VirtualReplica:
    def __init__(self, index: int, profile: Profile, block_size: int, num_blocks: int, max_model_len: int,
                 hasher: BlockHasher, events: bool) -> None:
        self.index = index
        self.url = f"http://replica-{index}:8000"
        self.profile = profile
        # digests are event hashes; evictions announced per allocation, not per block
        self.pool = BlockPool(num_blocks, block_size, None, enable_events=events, removals_per_block=False)
        self.kv = KvCacheManager(self.pool, max_model_len)
        self.scheduler = Scheduler(self.kv, hasher, profile.max_num_seqs, profile.max_num_batched_tokens,
                                   max_model_len)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.busy = False
        self.step_end = 0.0  # when the step in progress ends (while busy)
        self.step_seq = -1  # the queue's sequence number of that step's end (an entry with another is cancelled)
        # while the engine repeats a decode step in place: when each of those steps ends, the last one's end queued
        # (`FleetSimulation._repeat_run`)
        self.run_ends: list[float] = []
        self.out: Any = None
        self.tiers: ReplicaAgent | None = None
        # the gateway's long prefills sent here one at a time (router/prefill_turns.py): the one whose turn it is,
        # and those it holds until that one has its first token or its hold runs out
        self.turn: Turn | None = None
        self.held: deque[VRequest] = deque()
        self.upkeep_due = False
        self.requests = 0
        self.prompt_tokens = 0

    def view(self) -> Worker:
        """The replica in a gateway process's pool. Its cache configuration is known from the start (a gateway reads
        vllm:cache_config_info in the scrape that follows its first health probe)."""
        return Worker(spec=WorkerSpec(self.url), healthy=True, models=frozenset({MODEL}), kv_blocks=self.num_blocks,
                      kv_block_size=self.block_size)


def default_max_model_len(longest: int, block_size: int) -> int:
    """The engines' max_model_len for a workload whose longest request (prompt and answer) is `longest` tokens."""
    return max(256, int(math.ceil((longest + 1) / block_size) * block_size))


def replica_gpu_blocks(profile: Profile, block_size: int, gpu_blocks: int | None, max_model_len: int) -> int:
    """KV blocks per replica: `gpu_blocks`, or what the profile's GPU holds; at least one longest request's."""
    return max(gpu_blocks or profile.num_gpu_blocks(block_size), max_model_len // block_size + 2)


class FleetSimulation:
    """Replays one workload through one strategy over a virtual fleet."""

    def __init__(self, requests: Workload | RequestSource, vocab: PromptVocabulary | None = None, *, strategy: str,
                 replicas: int, profile: str | Profile = "llama-3.1-8b-h100", block_size: int = 16,
                 gpu_blocks: int | None = None, max_model_len: int | None = None, tiers: TierSettings | None = None,
                 concurrency: int | None = None, arrivals: Sequence[float] | None = None,
                 event_delay_s: float = 0.002, metrics_interval_s: float = 1.0, seed: int = 0,
                 speedup: float = 1.0, tiers_sped_up: bool = False, config_overrides: dict[str, Any] | None = None,
                 processes: int = 1, progress: Callable[[int, float], None] | None = None) -> None:
        if isinstance(requests, Workload):
            if vocab is None:
                raise ValueError("a Workload needs its PromptVocabulary")
            requests = WorkloadSource(requests, vocab, arrivals)
        if concurrency is None and not requests.timed:
            raise ValueError(f"{requests.name}: requests without arrival times need a concurrency or arrivals")
        self.source = requests
        self.profile = (profile if isinstance(profile, Profile) else load_profile(profile)).sped_up(speedup)
        self.block_size = block_size
        self.max_model_len = max_model_len or default_max_model_len(requests.longest, block_size)
        self.gpu_blocks = blocks = replica_gpu_blocks(self.profile, block_size, gpu_blocks, self.max_model_len)
        settings: dict[str, Any] = {"strategy": strategy, "block_size": block_size}
        if strategy == "ttft":  # what `kvgate bench calibrate` would find for this fleet, and its tiers' links
            settings.update(ttft_options(self.profile))
            if tiers is not None:
                settings.update(tiers.ttft_options())
        if processes < 1:
            raise ValueError(f"a gateway has at least one process, not {processes}")
        random.seed(seed)  # least_load breaks ties with the module's random
        self.replicas = [VirtualReplica(i, self.profile, block_size, blocks, self.max_model_len, _engine_hash,
                                        events=True) for i in range(replicas)]
        # `--processes N`: each request goes to one of them at random, as the kernel spreads the clients'
        # connections over them (SO_REUSEPORT); each strategy's own randomness seeded apart
        self.gateways: list[VirtualGateway] = []
        for i in range(processes):
            config, routing = assemble({**settings, **(config_overrides or {})})
            balance = getattr(routing, "balance", None)  # prefix and kv: seeded, and on virtual time
            if isinstance(balance, PrefillBalance):
                balance.random.seed(seed + i)
                balance.clock = lambda: self.now
                balance.trie.clock = lambda: self.now  # a prefix expires after its TTL in virtual time
                balance.trie.compact_tables()
            self.gateways.append(VirtualGateway(i, routing, [r.view() for r in self.replicas]))
            if i == 0:
                self.config, self.strategy = config, routing
        self._spread = random.Random(seed)
        self.now = 0.0
        # KV events go straight to the gateway's applier, in order and complete: no transport, nothing to recover
        self.kv: KvEventApplier | None = None
        self.sources = [EventSource(r.url, f"vsim://{r.index}") for r in self.replicas]
        if self.strategy.uses_kv_events:
            # the NVMe tier's maps in arrays (`U64Map`): the engines' digests and the gateway's keys are 64-bit ints,
            # and its blocks are most of the index's (1.4 M on the conversation trace at 8 replicas); a mask of
            # workers fits 64 bits up to 64 replicas
            index = InMemoryKvIndex()
            index.compact_tables({DISK: U64Map} if replicas <= 64 else None)
            self.kv = KvEventApplier(index, GatewayMetrics(), lambda url: MODEL, clock=lambda: self.now)
            self.kv.compact_tables({DISK: cast(Callable[[], MutableMapping[BlockHash, int]], U64Map)})
            for gateway in self.gateways:  # each process applies the same events: one index stands for theirs
                gateway.strategy.attach_kv(self.kv.index, lambda url: True)
        self.tier_settings = tiers
        if tiers is not None:
            fleet = FleetBackend(tiers.shared_blocks, clock=lambda: self.now)
            for r in self.replicas:
                r.tiers = ReplicaAgent(tiers.agent_config(), tiers.dram_blocks, tiers.nvme_blocks, fleet)
            # the fleet's links; `ttft` is told the settings' own rates either way, as `kvgate bench compare` tells
            # a live gateway the hardware's links while its `kvgate sim --speedup` replicas load that much faster
            self.links = tiers.links(speedup if tiers_sped_up else 1.0)
        self.bytes_per_block = self.profile.model.kv_bytes_per_token * block_size
        # a step that only decodes is repeated in place (`Scheduler.repeat_decodes`) unless the strategy hears of
        # every chunk (`ttft` times the engines' steps by them)
        self._repeat_decodes = type(self.strategy).on_chunk is Strategy.on_chunk
        self.event_delay_s = event_delay_s
        self.metrics_interval_s = metrics_interval_s
        self.concurrency = concurrency
        self.progress = progress
        self.root = root_key(MODEL)
        self._blocks = PromptBlocks(block_size, self.root)
        self._arrivals = enumerate(requests)
        self._queue: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._pending_events: list[tuple[int, list[KvEvent]]] = []
        self.decisions: list[int] = []
        self._by_id: dict[str, VRequest] = {}
        self._arrived = 0
        self._done = 0
        # what finished requests leave behind
        self._ttft = array("d")
        self._wait = array("d")       # arrival to first scheduled step, per request
        self._step_wait = array("d")  # of it, the step in progress when the request was admitted
        self._predicted: list[tuple[float, float]] = []  # (predicted, observed) TTFT, where the strategy predicts
        self._e2e = array("d")
        self._query_tokens = 0
        self._tier_tokens = dict.fromkeys(TIERS, 0)
        # bytes each tier carried (loads read from it, blocks written to it), per TRAFFIC_BUCKET_S of virtual time
        self._traffic: dict[tuple[str, str], dict[int, int]] = {}

    # --- events ---------------------------------------------------------------------------------------------

    def _push(self, at: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._queue, (at, next(self._seq), kind, payload))

    def _push_arrival(self, req: VRequest) -> None:
        """An arrival at its time, before anything else due at that time (in arrival order)."""
        heapq.heappush(self._queue, (max(req.arrival, self.now), req.index - self.source.count, "arrive", req))

    def _flush_events(self, replica: VirtualReplica) -> None:
        """The step's engine events (and the tier events they cause) go to the applier after `event_delay_s`."""
        if not replica.pool.events and (replica.tiers is None or not replica.tiers.has_events()):
            return  # most steps: a decode token inside a block, nothing cached, stored or evicted
        events = replica.pool.take_events()
        if events:
            self._pending_events.append((replica.index, events))
            if replica.tiers is not None:
                for event in events:
                    if type(event) is BlockStored and event.medium == GPU:
                        # the engines' digests are ints, their own event hashes
                        replica.tiers.save(cast(list[int], event.block_hashes),
                                           cast(int | None, event.parent_block_hash))
        if replica.tiers is not None:
            tier_events = replica.tiers.events()
            if tier_events:
                self._pending_events.append((replica.index, tier_events))
                written: dict[str, int] = {}
                for event in tier_events:
                    if type(event) is BlockStored:
                        medium = event.medium or ""
                        written[medium] = written.get(medium, 0) + len(event.block_hashes)
                for medium, blocks in written.items():
                    self._carried(_TIER_OF_MEDIUM[medium], "write", blocks)
                if not replica.upkeep_due:
                    replica.upkeep_due = True
                    self._push(self.now + UPKEEP_S, "upkeep", replica)
        if self._pending_events:
            batch, self._pending_events = self._pending_events, []
            if self.kv is not None:
                self._push(self.now + self.event_delay_s, "events", batch)

    def _apply_events(self, batch: list[tuple[int, list[KvEvent]]]) -> None:
        assert self.kv is not None
        for replica, events in batch:
            self.kv.apply(self.sources[replica], events)

    # --- requests -------------------------------------------------------------------------------------------

    def _take(self) -> VRequest | None:
        """The next request of the source, with its block keys (None when there is none left)."""
        taken = next(self._arrivals, None)
        if taken is None:
            return None
        i, arrival = taken
        keys, digests = self._blocks.of(arrival.token_ids)
        return VRequest(i, arrival.token_ids, keys, digests, arrival.max_tokens, arrival.at or 0.0)

    def _arrive(self, req: VRequest) -> None:
        req.arrival = self.now
        self._arrived += 1
        if self.concurrency is None:
            following = self._take()
            if following is not None:
                self._push_arrival(following)
        # streamed: every token a step samples is relayed as a chunk (`on_chunk`), the first one reported
        route = RouteRequest(MODEL, "/v1/completions", {}, req.token_ids, req.keys, len(req.token_ids), stream=True,
                             max_tokens=req.max_tokens)
        gateways = self.gateways
        gateway = gateways[self._spread.randrange(len(gateways))] if len(gateways) > 1 else gateways[0]
        gateway.requests += 1
        decision = gateway.strategy.choose(route, gateway.workers)
        worker = decision.worker
        worker.in_flight += 1
        worker.routed += 1
        gateway.strategy.on_routed(route, decision)
        req.route, req.decision, req.gateway = route, decision, gateway
        self._tell_siblings(req, ROUTED)
        replica = self.replicas[gateway.workers.index(worker)]
        req.replica = replica.index
        self.decisions.append(replica.index)
        replica.requests += 1
        replica.prompt_tokens += len(req.token_ids)
        if decision.serialize_prefill and replica.turn is not None:
            replica.held.append(req)  # the long prefill before it there has no first token yet
            return
        self._send(replica, req)

    def _tell_siblings(self, req: VRequest, record: str) -> None:
        """The other gateway processes hear of the request's placement, first token or end, with the rest of the
        batch it goes in (`_sibling`)."""
        if len(self.gateways) > 1 and req.decision is not None and req.decision.placement is not None:
            assert req.gateway is not None
            outbox = req.gateway.outbox
            if not outbox:
                self._push(self.now + FLUSH_S, "siblings", outbox)
            outbox.append((req, record))

    def _sibling(self, req: VRequest, record: str) -> None:
        """What `router.sibling_routes.SiblingRoutes` does with a sibling's record, in each other process."""
        assert req.decision is not None and req.decision.placement is not None
        placement = req.decision.placement
        key = -1 - req.index  # never a request's `id` in that process
        for gateway in self.gateways:
            if gateway is req.gateway:
                continue
            strategy = gateway.strategy
            if record == ROUTED:
                gateway.workers[req.replica].sibling_in_flight += 1
                strategy.sibling_routed(key, placement)
            elif record == FIRST_TOKEN:
                strategy.sibling_first_token(key, placement)
            else:
                gateway.workers[req.replica].sibling_in_flight -= 1
                if isinstance(strategy, KvAware):  # pending blocks stay for the grace period, in virtual time
                    strategy.sibling_request_ended(key, placement)
                    self._push(self.now + strategy.pending_grace_s, "discard",
                               (strategy, cache_name(placement.worker, placement.rank), placement.keys))
                else:
                    strategy.sibling_ended(key, placement)

    def _send(self, replica: VirtualReplica, req: VRequest) -> None:
        """The gateway sends the request to its replica (at once, or once its hold there ended)."""
        assert req.decision is not None
        req.sent = self.now
        if req.decision.serialize_prefill:
            replica.turn = turn = Turn(req, self.now + hold_seconds(req.decision.predicted_ttft_s, stream=True))
            self._push(turn.until, "turn", turn)
        sim = SimRequest(str(req.index), req.token_ids, req.max_tokens, [5] * 8, req.digests, self.now)
        sim.listener = None
        sim.scheduled_time = -1.0  # not yet: set by the first step that schedules it
        delay = 0.0
        if replica.tiers is not None:
            delay = self._load_from_tiers(replica, sim, req)
        if delay > 0:
            self._push(self.now + delay, "admit", (replica, sim, req))
        else:
            self._admit(replica, sim, req)

    def _load_from_tiers(self, replica: VirtualReplica, sim: SimRequest, req: VRequest) -> float:
        """Blocks after the GPU prefix hit that the tiers hold are loaded into the GPU cache before admission."""
        assert replica.tiers is not None
        pool = replica.pool
        hashes = sim.block_hashes[: (len(sim.all_token_ids) - 1) // self.block_size]
        gpu: list[KvBlock] = []
        for digest in hashes:
            block = pool.get_cached_block(digest)
            if block is None:
                break
            gpu.append(block)
        rest = cast(list[int], hashes[len(gpu):])  # the engines' digests are their event hashes
        if not rest:
            return 0.0
        where = replica.tiers.load(rest)
        seconds = transfer_seconds(where, self.bytes_per_block, self.links)
        n = len(where)
        pool.touch(gpu)  # keep the GPU run while loading next to it
        n = min(n, pool.num_free_blocks)
        if n > 0:
            fresh = pool.get_new_blocks(n)
            pool.cache_full_blocks([*gpu, *fresh], hashes, len(gpu), len(gpu) + n, sim.all_token_ids)
            pool.free_blocks(reversed([*gpu, *fresh]))
        else:
            pool.free_blocks(reversed(gpu))
        for code in dict.fromkeys(where[:n]):  # each tier the blocks came from, in order of first use
            tier = TierName.from_code(code).value
            blocks = where.count(code, 0, n)
            req.tier_tokens[tier] = req.tier_tokens.get(tier, 0) + blocks * self.block_size
            self._carried(tier, "read", blocks)
        self._flush_events(replica)
        return seconds if n else 0.0

    def _next_turn(self, replica: VirtualReplica) -> None:
        """The long prefill whose turn it was there has its first token, or has had its hold: the next one held
        goes."""
        replica.turn = None
        if replica.held:
            self._send(replica, replica.held.popleft())

    def _admit(self, replica: VirtualReplica, sim: SimRequest, req: VRequest) -> None:
        if replica.run_ends:
            self._cut_run(replica)
        sim.arrival_time = req.sent
        req.step_wait = replica.step_end - self.now if replica.busy else 0.0
        replica.scheduler.add_request(sim)
        self._by_id[sim.request_id] = req
        if not replica.busy:
            self._step(replica)

    def _step(self, replica: VirtualReplica) -> None:
        out = replica.scheduler.schedule()
        self._flush_events(replica)
        if out.empty:
            replica.busy = False
            return
        replica.busy = True
        replica.out = out
        now = self.now
        for c in out.chunks:
            if c.request.scheduled_time < 0:
                c.request.scheduled_time = now
        self._start_step(replica, self.profile.step_time([(c.num_new_tokens, c.num_context_tokens)
                                                          for c in out.chunks]))

    def _start_step(self, replica: VirtualReplica, duration: float) -> None:
        self._step_ends(replica, self.now + duration)

    def _step_ends(self, replica: VirtualReplica, at: float) -> None:
        """The replica's step in progress ends `at` (an end queued before is cancelled)."""
        replica.step_end = at
        replica.step_seq = next(self._seq)
        heapq.heappush(self._queue, (at, replica.step_seq, "step", replica))

    def _repeat_run(self, replica: VirtualReplica, repeats: int) -> None:
        """The step that just ended is repeated in place `repeats` times in a row (`Scheduler.repeat_decodes`: what
        the rest would do for such a step, tokens that nobody hears of, no event, the same batch again): one end is
        queued, after them all, and the tokens are appended then, or where a request is admitted meanwhile up to
        the step in progress (`_cut_run`). Each step's end is the previous one's plus its time, as step by step."""
        chunks = replica.out.chunks
        n = len(chunks)
        context = sum([c.request.num_computed_tokens for c in chunks])  # each repeat's own context, n more each
        decodes_time = self.profile.decodes_time
        at = self.now
        ends = replica.run_ends
        for k in range(repeats):
            at += decodes_time(n, context + k * n)
            ends.append(at)
        self._step_ends(replica, at)

    def _cut_run(self, replica: VirtualReplica) -> None:
        """A request is admitted during a run of repeated steps: the steps that ended before now (and the one in
        progress, the batch it repeats) happen; the one in progress ends the run. (An arrival at the very time a
        step ends comes first, as the queue orders it.)"""
        ends = replica.run_ends
        done = bisect.bisect_left(ends, self.now) + 1
        replica.scheduler.repeat_decodes(replica.out, done)
        if done < len(ends):
            self._step_ends(replica, ends[done - 1])
        replica.run_ends = []

    def _step_done(self, replica: VirtualReplica) -> None:
        if replica.run_ends:  # the end of a run of repeated steps: they happen now, then this one as any other
            replica.scheduler.repeat_decodes(replica.out, len(replica.run_ends))
            replica.run_ends = []
        elif self._repeat_decodes and (repeats := replica.scheduler.decode_repeats(replica.out)):
            self._repeat_run(replica, repeats)
            return
        sampled, finished = replica.scheduler.update_from_output(replica.out, self.now)
        for sim in sampled:
            req = self._by_id[sim.request_id]
            assert req.route is not None and req.decision is not None and req.gateway is not None
            strategy = req.gateway.strategy
            if len(sim.output_token_ids) == 1:
                req.ttft = self.now - req.arrival + self.profile.request_overhead_s
                self._wait.append(sim.scheduled_time - req.arrival)
                self._step_wait.append(req.step_wait)
                strategy.on_first_token(req.route, req.decision, req.ttft)
                self._tell_siblings(req, FIRST_TOKEN)
                if replica.turn is not None and replica.turn.req is req:
                    self._next_turn(replica)
                if req.decision.predicted_ttft_s is not None:
                    self._predicted.append((req.decision.predicted_ttft_s, req.ttft))
                cached = max(sim.num_cached_tokens, 0)
                loaded = sum(req.tier_tokens.values())
                req.tier_tokens["gpu"] = max(0, cached - loaded)
                if cached < loaded:  # loaded blocks were evicted again before the request was scheduled
                    req.tier_tokens = {"gpu": 0, **_scale(req.tier_tokens, cached)}
            # every token a step samples is a streamed chunk, relayed at the step's end (the gateway's per-chunk hook)
            strategy.on_chunk(req.route, req.decision, len(sim.output_token_ids) == 1)
        for sim in finished:
            req = self._by_id.pop(sim.request_id)
            self._finished(req)
            assert req.route is not None and req.decision is not None and req.gateway is not None
            req.decision.worker.in_flight -= 1
            strategy = req.gateway.strategy
            if isinstance(strategy, KvAware):  # pending blocks stay for the grace period, in virtual time
                strategy.request_ended(req.route, req.decision)
                self._push(self.now + strategy.pending_grace_s, "discard",
                           (strategy, cache_name(req.decision.worker.url, req.decision.dp_rank), req.keys))
            else:
                strategy.on_finished(req.route, req.decision)
            self._tell_siblings(req, ENDED)
            if self.concurrency is not None:
                self._next_closed()
        self._flush_events(replica)
        self._step(replica)

    def _finished(self, req: VRequest) -> None:
        self._done += 1
        self._e2e.append(self.now - req.arrival)
        if req.ttft is not None:
            self._ttft.append(req.ttft)
        self._query_tokens += len(req.token_ids)
        for tier, tokens in req.tier_tokens.items():
            self._tier_tokens[tier] += tokens
        if self.progress is not None:
            self.progress(self._done, self.now)

    def _carried(self, tier: str, direction: str, blocks: int) -> None:
        buckets = self._traffic.setdefault((tier, direction), {})
        at = int(self.now // TRAFFIC_BUCKET_S)
        buckets[at] = buckets.get(at, 0) + blocks * self.bytes_per_block

    def traffic(self) -> dict[str, dict[str, float]]:
        """GB/s each tier carried: read (loads into the GPUs), written, and the busiest TRAFFIC_BUCKET_S of
        the two together, at the profile's KV bytes per token."""
        out: dict[str, dict[str, float]] = {}
        duration = max(self.now, 1e-9)
        for tier in TIERS[1:]:
            reads = self._traffic.get((tier, "read"), {})
            writes = self._traffic.get((tier, "write"), {})
            both = {b: reads.get(b, 0) + writes.get(b, 0) for b in reads.keys() | writes.keys()}
            out[tier] = {"read_gbps": sum(reads.values()) / duration / 1e9,
                         "write_gbps": sum(writes.values()) / duration / 1e9,
                         "peak_gbps": max(both.values(), default=0) / TRAFFIC_BUCKET_S / 1e9}
        return out

    def _next_closed(self) -> None:
        req = self._take()
        if req is not None:
            self._push(self.now, "arrive", req)

    def _scrape(self) -> None:
        for r in self.replicas:
            running, waiting, usage = float(len(r.scheduler.running)), float(len(r.scheduler.waiting)), r.pool.usage()
            for gateway in self.gateways:  # each process scrapes the same engine
                worker = gateway.workers[r.index]
                worker.running, worker.waiting, worker.kv_usage = running, waiting, usage
                worker.load_scraped_at = self.now  # as the gateway's pool stamps a scrape

    def run(self) -> dict[str, Any]:
        """Replay the whole source; the result row. Python's cyclic garbage collector is off meanwhile: a replay
        holds millions of long-lived objects (blocks, index entries, tier bookkeeping) and makes no cycles
        (tests/test_vsim_results.py checks), so its collections only scanned live objects, again and again as
        they grew: a quarter of a tiered replay's CPU time on the first 1,500 requests of the conversation
        trace, more later."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if collecting:
                gc.enable()

    def _run(self) -> dict[str, Any]:
        wall = time.perf_counter()
        if self.concurrency is not None:
            for _ in range(self.concurrency):
                self._next_closed()
        else:
            first = self._take()
            if first is not None:
                self._push_arrival(first)
        self._push(0.0, "scrape")
        while self._queue:
            at, seq, kind, payload = heapq.heappop(self._queue)
            self.now = at
            if kind == "arrive":
                self._arrive(payload)
            elif kind == "step":
                if seq == payload.step_seq:  # (else cancelled)
                    self._step_done(payload)
            elif kind == "admit":
                self._admit(*payload)
            elif kind == "turn":
                replica = self.replicas[payload.req.replica]
                if replica.turn is payload:  # (else it ended with its first token)
                    self._next_turn(replica)
            elif kind == "events":
                self._apply_events(payload)
            elif kind == "upkeep":
                payload.upkeep_due = False
                payload.tiers.maintain()
                self._flush_events(payload)
            elif kind == "discard":
                strategy, cache, keys = payload
                strategy.pending.discard(cache, keys)
            elif kind == "siblings":
                batch = payload[:]
                payload.clear()
                for req, record in batch:
                    self._sibling(req, record)
            elif kind == "scrape":
                self._scrape()
                if self._done < self.source.count:
                    self._push(self.now + self.metrics_interval_s, "scrape")
        return self.summary(time.perf_counter() - wall)

    def summary(self, wall_s: float) -> dict[str, Any]:
        queries = self._query_tokens
        by_tier = self._tier_tokens
        ttft = self._ttft
        reqs = [float(r.requests) for r in self.replicas]
        toks = [float(r.prompt_tokens) for r in self.replicas]

        def imbalance(v: list[float]) -> float | None:
            mean = sum(v) / len(v)
            return max(v) / mean if mean else None

        out: dict[str, Any] = {
            "strategy": self.config.strategy, "replicas": len(self.replicas), "tiers": self.tier_settings is not None,
            "requests": self._arrived, "completed": self._done,
            "query_tokens": queries, "hit_rate": sum(by_tier.values()) / queries if queries else 0.0,
            "hit_rate_by_tier": {t: by_tier[t] / queries if queries else 0.0 for t in TIERS},
            "request_imbalance": imbalance(reqs), "prompt_token_imbalance": imbalance(toks),
            "requests_per_replica": reqs, "virtual_s": self.now, "wall_s": wall_s,
        }
        if len(self.gateways) > 1:
            out["requests_per_process"] = [g.requests for g in self.gateways]
        if self.tier_settings is not None:
            out["tier_traffic"] = self.traffic()
            t = self.tier_settings
            out["tier_links_gbps"] = {"dram": t.dram_gbps, "nvme": t.nvme_gbps, "shared": t.shared_gbps}
        for q in (0.5, 0.9, 0.99):
            p = percentile(ttft, q)
            out[f"ttft_ms_p{int(q * 100)}"] = None if p is None else p * 1e3
        # the wait before a request's first step, and of it the engine's step in progress: a busy engine takes a
        # new request at its next step, which no router choosing among busy replicas avoids (the TTFT limit has
        # an idle replica)
        for name, values in (("wait", self._wait), ("step_wait", self._step_wait)):
            for q in (0.5, 0.9):
                p = percentile(values, q)
                out[f"{name}_ms_p{int(q * 100)}"] = None if p is None else p * 1e3
        out["ttft_ms_mean"] = sum(ttft) / len(ttft) * 1e3 if ttft else None
        out["e2e_ms_p50"] = (percentile(self._e2e, 0.5) or 0.0) * 1e3
        if self._predicted:
            out["ttft_prediction"] = vsim_report.prediction_summary(self._predicted, PREDICTION_PAIRS)
        return out


class PromptBlocks:
    """The gateway's keys and the engines' digests of a prompt's full blocks, kept by segments of `SEGMENT` blocks:
    a trace's prompts repeat their prefixes (a conversation's every turn is its whole history again), so most of
    a prompt's segments were seen before, and each costs one hash of its tokens instead of two per block (the
    keys and digests of the conversation trace cost the sweep's eight replays 2-3 ms per request each).

    A segment is named by a hash of its tokens chained to the name of the segment before it: a name stands for
    the whole prefix up to the segment's end, as a block key does (two prefixes whose 64-bit names collided would
    be one prefix, as for the gateway's keys). The last `KEPT` segments used are kept (when there are more, the
    older half is forgotten). A segment's keys and digests are the same int objects for every prompt and replica
    that has it: a replay's tiers, use counters and block pools hold a digest per block by the million, and each
    replica that computes a block (round_robin sends a conversation's every turn elsewhere) made an object of its
    own for it (48 bytes). The values are those `block_keys` and `engine_hashes` give; only which objects hold
    them changes."""

    SEGMENT = 32  # blocks: 512 tokens at vLLM's 16
    KEPT = 1 << 13

    def __init__(self, block_size: int, root: BlockKey) -> None:
        self.block_size = block_size
        self.root = root
        # a segment's name -> its keys and its digests
        self._segments: dict[int, tuple[tuple[BlockKey, ...], tuple[Digest, ...]]] = {}

    def of(self, token_ids: Sequence[int]) -> tuple[list[BlockKey], list[Digest]]:
        """(`block_keys(token_ids, block_size, root)`, `engine_hashes(token_ids, block_size)`)."""
        ids = array("I", token_ids)
        data = memoryview(ids).cast("B")
        bs = self.block_size
        span = self.SEGMENT * bs  # tokens
        size = ids.itemsize
        segments = self._segments
        keys: list[BlockKey] = []
        digests: list[Digest] = []
        name = key = self.root
        digest = ENGINE_ROOT
        for end in range(span, len(ids) + 1, span):
            name = xxh3_64_intdigest(data[(end - span) * size:end * size], name)
            known = segments.pop(name, None)
            if known is None:
                tokens = ids[end - span:end]
                known = (tuple(chain_keys(tokens, bs, key)),
                         tuple(cast(list[Digest], chain_keys(tokens, bs, digest))))
            segments[name] = known  # the most recently used
            keys += known[0]
            digests += known[1]
            key, digest = known[0][-1], cast(int, known[1][-1])
        rest = ids[len(keys) * bs:]
        keys += chain_keys(rest, bs, key)
        digests += cast(list[Digest], chain_keys(rest, bs, digest))
        if len(segments) > self.KEPT:
            self._segments = dict(itertools.islice(segments.items(), len(segments) // 2, None))
        return keys, digests


def engine_hashes(token_ids: Sequence[int], block_size: int) -> list[Digest]:
    """The simulated engines' digest of every full block of a prompt: a 64-bit int, which is also its event hash
    (the block pool is told so), instead of 8 bytes converted at every use."""
    return cast(list[Digest], block_keys(token_ids, block_size, ENGINE_ROOT))


def _engine_hash(parent: Digest | None, token_ids: Sequence[int], extra: object = None) -> Digest:
    """One block's digest on the simulated engines (a block filled by decoding)."""
    return cast(Digest, chain_key(ENGINE_ROOT if parent is None else cast(int, parent), token_ids))


def _scale(tiers: dict[str, int], cached: int) -> dict[str, int]:
    out = {}
    for tier in (t.value for t in TierName):
        take = min(tiers.get(tier, 0), cached)
        out[tier] = take
        cached -= take
    return out


# --- the command ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.workload_options import DEFAULT_TRACE, add_workload_arguments

    parser.add_argument("--strategies", default="round_robin,least_load,prefix,kv,ttft",
                        help="comma-separated; a strategy may name settings of its own for its rows, side by side "
                             "with others: ttft:ttft_tie_s=0.0005:ttft_step_phase=false; and pN for a gateway of N "
                             "processes (kvgate serve --processes N), each request to one of them at random: ttft:p2")
    parser.add_argument("--replicas", default="8,16", help="comma-separated fleet sizes")
    parser.add_argument("--profile", default="llama-3.1-8b-h100",
                        help=f"one of {', '.join(sorted(PROFILES))}, or a calibrated profile's JSON file "
                             "(kvgate bench calibrate)")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="the engines run this many times faster than the profile (as `kvgate sim --speedup`; "
                        "TTFTs are then in the faster fleet's time)")
    parser.add_argument("--tiers-sped-up", action="store_true",
                        help="the tier links run --speedup times faster too, as the loads of `kvgate sim --speedup` "
                        "replicas with agents do (kvgate bench compare --with-agents); `ttft` is still told the "
                        "links' own rates, as a live gateway is")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=None, help="per replica (default: the profile's)")
    parser.add_argument("--tiers", choices=["off", "on", "both"], default="both")
    parser.add_argument("--write-policy", choices=["lazy", "eager"], default="lazy")
    parser.add_argument("--dram-blocks", type=int, default=TierSettings.dram_blocks)
    parser.add_argument("--nvme-blocks", type=int, default=TierSettings.nvme_blocks)
    parser.add_argument("--shared-blocks", type=int, default=TierSettings.shared_blocks)
    for tier, what in (("dram", "host DRAM -> GPU"), ("nvme", "NVMe -> GPU"), ("shared", "shared tier -> GPU")):
        parser.add_argument(f"--{tier}-gbps", type=float, default=getattr(TierSettings, f"{tier}_gbps"),
                            help=f"{what}, GB/s of KV a load moves (`ttft` is told the same); `python -m "
                                 "bench.gpu_check` measures the agent's DRAM path on a GPU")
    parser.add_argument("--concurrency", type=int, default=None, help="closed loop instead of arrival times")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals for untimed workloads")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--jobs", type=int, default=1, help="configurations simulated at once, one process each")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (a line per configuration)")
    parser.add_argument("--out", default="out/vsim.json")
    add_workload_arguments(parser)
    parser.set_defaults(workload="mooncake", limit=None, trace=str(DEFAULT_TRACE))


@dataclass(frozen=True)
class VsimJob:
    """One configuration of a sweep, everything its process needs (picklable)."""

    workload: dict[str, Any]  # the workload options, as parsed
    strategy: str
    replicas: int
    profile: str
    block_size: int
    gpu_blocks: int | None
    tiers: TierSettings | None
    concurrency: int | None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    speedup: float = 1.0
    tiers_sped_up: bool = False

    @property
    def label(self) -> str:
        return f"{self.replicas} replicas {'tiers' if self.tiers else 'gpu'} {self.strategy}"

    @property
    def strategy_name(self) -> str:
        return strategy_variant(self.strategy)[0]

    @property
    def cost(self) -> float:
        """What the configuration takes relative to others, for a sweep to start the costliest first: CPU seconds
        of the whole conversation trace at 8 replicas (README, 'What a replay costs'), per replica."""
        gpu, tiered = RELATIVE_COST.get(self.strategy_name, (100.0, 200.0))
        return (tiered if self.tiers else gpu) * self.replicas / 8


# CPU seconds a configuration took on the conversation trace at 8 replicas, without and with tiers (50250bc):
# with tiers round_robin and least_load cost four times as much, prefix and kv two
RELATIVE_COST = {"round_robin": (46.0, 182.0), "least_load": (45.0, 181.0), "prefix": (65.0, 114.0),
                 "kv": (99.0, 215.0)}


def strategy_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """`--strategies`' entry: a strategy's name and the settings of its own the entry gives it, typed as its
    `Options` declare them (`ttft:ttft_tie_s=0.0005:ttft_step_phase=false`), and `pN` for a gateway of N processes
    (`ttft:p2`, as `kvgate bench compare`'s target `kvgate:ttft:p2`: settings' `processes`); ConfigError for an
    unknown strategy or setting, or a malformed value."""
    name, *pairs = spec.split(":")
    options = strategy_class(name).Options
    known = {f.name for f in dataclasses.fields(options)}
    raw: dict[str, str] = {}
    processes: dict[str, Any] = {}
    for pair in pairs:
        if pair[:1] == "p" and pair[1:].isdigit() and int(pair[1:]) >= 1 and not processes:
            processes["processes"] = int(pair[1:])
            continue
        key, sep, value = pair.partition("=")
        if not sep or key not in known:
            raise ConfigError(f"{spec}: {pair!r} is neither one of {name}'s settings as name=value nor pN (N "
                              "gateway processes)")
        raw[key] = value
    typed = load_config(options, "", argparse.Namespace(**raw), environ={})
    return name, {**{key: getattr(typed, key) for key in raw}, **processes}


def request_source(args: argparse.Namespace, vocab: PromptVocabulary, report: TextIO | None = None) -> RequestSource:
    """The workload the options name, as a stream: a trace is read as it is replayed; a generated workload is
    built in memory (open loop without times: Poisson arrivals at --rate)."""
    from bench.workload_options import build_workload

    if args.workload == "mooncake":
        return TraceSource(Trace(args.trace, offset=args.offset, limit=args.limit, report=report), vocab,
                           time_scale=args.time_scale, block_tokens=args.block_tokens,
                           max_output_tokens=args.max_output_tokens)
    workload = build_workload(args, vocab)
    arrivals = None
    if not workload.timed and args.concurrency is None:
        arrivals = workloads.poisson_arrivals(len(workload.requests), args.rate or 10.0, args.seed)
    return WorkloadSource(workload, vocab, arrivals)


def simulate(job: VsimJob, progress: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """Run one configuration (in a sweep's process): its workload read afresh, its result row."""
    from bench.make_model import bench_model_dir

    args = argparse.Namespace(**job.workload)
    source = request_source(args, PromptVocabulary.from_model_dir(bench_model_dir(args.model_dir)))
    name, own = strategy_variant(job.strategy)
    processes = own.pop("processes", 1)
    sim = FleetSimulation(source, strategy=name, replicas=job.replicas, profile=job.profile,
                          block_size=job.block_size, gpu_blocks=job.gpu_blocks, tiers=job.tiers,
                          concurrency=job.concurrency, seed=args.seed, speedup=job.speedup,
                          tiers_sped_up=job.tiers_sped_up,
                          config_overrides={**own, **job.config_overrides}, processes=processes, progress=progress)
    row = sim.run()
    row["strategy"] = job.strategy  # a variant's row is named by its whole entry
    return row


def print_row(line: str) -> None:
    """A configuration's row as soon as it finished, also when stdout is a pipe (tqdm.write does not flush)."""
    tqdm.write(line)
    sys.stdout.flush()


def describe_row(row: dict[str, Any]) -> str:
    t = row["hit_rate_by_tier"]
    return (f"{row['replicas']:3d} replicas {'tiers' if row['tiers'] else 'gpu  '} {row['strategy']:12s} "
            f"hit {row['hit_rate']:.3f} (gpu {t['gpu']:.3f} dram {t['dram']:.3f} nvme {t['nvme']:.3f} "
            f"shared {t['shared']:.3f})  TTFT p50 {row['ttft_ms_p50']:.0f} p90 {row['ttft_ms_p90']:.0f} "
            f"p99 {row['ttft_ms_p99']:.0f} ms  first step after p50 {row.get('wait_ms_p50') or 0:.1f} ms (step in "
            f"progress {row.get('step_wait_ms_p50') or 0:.1f})  imbalance {row['request_imbalance']:.2f}  "
            f"[{row['wall_s']:.0f} s wall, "
            f"{row.get('cpu_s', 0):.0f} s CPU, {row.get('peak_rss_mb', 0):.0f} MB]")


def run(args: argparse.Namespace) -> int:
    from bench.make_model import bench_model_dir

    try:
        profile = load_profile(args.profile).sped_up(args.speedup)
        for spec in args.strategies.split(","):
            strategy_variant(spec)
        vocab = PromptVocabulary.from_model_dir(bench_model_dir(args.model_dir))
        source = request_source(args, vocab, report=sys.stderr)
    except (TraceError, ValueError) as exc:  # ConfigError is a ValueError
        print(f"kvgate bench vsim: {exc}", file=sys.stderr)
        return 2
    bound = source.ideal(args.block_size)
    limit = vsim_report.ttft_limit(bound, profile)
    causal = vsim_report.causal_limit(source, args.block_size, profile)
    replicas = [int(x) for x in args.replicas.split(",")]
    per_replica = replica_gpu_blocks(profile, args.block_size, args.gpu_blocks,
                                     default_max_model_len(source.longest, args.block_size))
    hashed = vsim_report.hashed_prompts(source, args.block_size)
    fleet_cache = ({"skipped": f"over {vsim_report.FLEET_CACHE_MAX_BLOCKS:,} blocks"} if hashed is None else
                   vsim_report.fleet_cache_limit(hashed, args.block_size,
                                                 {str(n): n * per_replica for n in replicas}, profile))
    del hashed
    tier_modes = {"off": [False], "on": [True], "both": [False, True]}[args.tiers]
    settings = TierSettings(dram_blocks=args.dram_blocks, nvme_blocks=args.nvme_blocks,
                            shared_blocks=args.shared_blocks, dram_gbps=args.dram_gbps, nvme_gbps=args.nvme_gbps,
                            shared_gbps=args.shared_gbps, write_policy=args.write_policy)
    jobs = [VsimJob(vars(args), strategy, n, args.profile, args.block_size, args.gpu_blocks,
                    settings if tiered else None, args.concurrency, speedup=args.speedup,
                    tiers_sped_up=args.tiers_sped_up)
            for n in replicas for tiered in tier_modes
            for strategy in args.strategies.split(",")]
    print(f"{source.name}: {source.count} requests, {bound.query_tokens} prompt tokens; ideal single-cache hit rate "
          f"{bound.hit_rate:.3f}, TTFT limit p50 {limit['ttft_ms_p50'] or 0:.0f} p90 {limit['ttft_ms_p90'] or 0:.0f} "
          f"ms" + (f" (for the arrivals, a prefix there once computed: p50 {causal['ttft_ms_p50'] or 0:.0f} p90 "
                   f"{causal['ttft_ms_p90'] or 0:.0f} ms)" if causal else "")
          + f"; {len(jobs)} configurations, {args.jobs} at a time", flush=True)
    print(vsim_report.describe_fleet_cache(fleet_cache), flush=True)
    before = machine.probe()
    print(before.describe(), flush=True)
    note = settings.dram_note(args.gpu_blocks or profile.num_gpu_blocks(args.block_size)) if any(tier_modes) else None
    if note:
        print(note, file=sys.stderr, flush=True)
    started = time.perf_counter()
    outcome = run_sweep([Job(job.label, source.count, job, cost=job.cost) for job in jobs], simulate,
                        processes=args.jobs, show_progress=not args.no_progress,
                        on_result=lambda i, row: print_row(describe_row(row)))
    wall_s = time.perf_counter() - started
    after = machine.probe()
    print(after.describe(), flush=True)
    results = [outcome.results[i] for i in sorted(outcome.results)]
    vsim_report.add_gaps(results, limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "vsim", "command": shlex.join(["kvgate", *sys.argv[1:]]),
        "workload": {"name": source.name, "params": source.params}, "profile": args.profile,
        "speedup": args.speedup, "tiers_sped_up": args.tiers_sped_up,
        "block_size": args.block_size, "tier_settings": settings.__dict__, "upper_bound": bound.hit_rate,
        "ttft_limit": limit, "ttft_limit_causal": causal, "ttft_limit_fleet_cache": fleet_cache, "jobs": args.jobs,
        "wall_s": wall_s,
        "machine_speed": machine.probes(before, after),
        "peak_total_rss_mb": outcome.peak_rss_mb,
        "peak_total_pss_mb": outcome.peak_pss_mb,
        "interrupted": outcome.interrupted,
        "unfinished": [jobs[i].label for i in range(len(jobs)) if i not in outcome.results],
        "errors": {jobs[i].label: e for i, e in outcome.errors.items()}, "results": results}
    plot = out.with_name(out.stem + "-ttft-predicted.png")
    if vsim_report.write_prediction_plot(report, plot):
        report["prediction_plot"] = plot.name
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    vsim_report.write_markdown(report, out.with_suffix(".md"))
    for i, error in outcome.errors.items():
        print(f"{jobs[i].label}: failed: {error}", file=sys.stderr)
    state = "interrupted; " if outcome.interrupted else ""
    print(f"{state}{len(results)} of {len(jobs)} configurations in {wall_s:.0f} s wall, at most "
          f"{outcome.peak_rss_mb:.0f} MB resident at once ({outcome.peak_pss_mb:.0f} MB counting shared pages once); "
          f"wrote {out}")
    return 130 if outcome.interrupted else 1 if outcome.errors else 0
