"""Prometheus metrics of the tier agent: per-tier occupancy and counters (read from the tiers at scrape time),
movements between tiers, and load/store latency histograms."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.store import TierStore
from agent.tiers.base import TierName
from agent.tiers.dram import DramTier

LATENCY_BUCKETS = (0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)

_TIER_COUNTERS = {
    "hits": "blocks found in the tier on load",
    "misses": "blocks looked for in the tier on load and not found (or unusable)",
    "stores": "blocks written to the tier",
    "refused": "blocks the tier could not take (too big, medium full, backend down)",
    "evictions": "blocks the tier dropped for room",
    "checksum_failures": "blocks whose payload failed its checksum (deleted, recomputed by the engine)",
    "read_errors": "blocks that could not be read (torn, foreign, I/O error)",
    "backend_errors": "medium or backend failures (disk full, Redis down, ...)",
    "dropped_announcements": "names announced on the shared tier's channel and not learned: not a block's name, "
                             "or naming a block the backend does not hold (or a deletion of one it holds)",
}


class TierCollector(Collector):
    def __init__(self, store: TierStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily("kvgate_agent_tier_bytes", "bytes held in the tier", labels=["tier"])
        blocks = GaugeMetricFamily("kvgate_agent_tier_blocks", "blocks held in the tier", labels=["tier"])
        capacity = GaugeMetricFamily("kvgate_agent_tier_capacity_bytes", "byte bound of the tier (0 = none)",
                                     labels=["tier"])
        counters = {name: CounterMetricFamily(f"kvgate_agent_{name}", text, labels=["tier"])
                    for name, text in _TIER_COUNTERS.items()}
        for tier in self.store.tiers:
            usage = tier.usage()
            used.add_metric([tier.name], usage.used_bytes)
            blocks.add_metric([tier.name], usage.blocks)
            capacity.add_metric([tier.name], usage.capacity_bytes)
            for name, family in counters.items():
                family.add_metric([tier.name], getattr(tier.stats, name))
        yield used
        yield blocks
        yield capacity
        yield from counters.values()
        flow = self.store.flow
        for kind, text in (("promotions", "blocks copied up into DRAM after a hit in a lower tier"),
                           ("demotions", "blocks moved down to a lower tier under pressure"),
                           ("write_through", "blocks written through to a lower tier right after a store")):
            family = CounterMetricFamily(f"kvgate_agent_{kind}", text, labels=["tier"])
            for tier_name, n in getattr(flow, kind).items():
                family.add_metric([tier_name], n)
            yield family
        yield GaugeMetricFamily("kvgate_agent_background_bytes", "bytes of write-throughs and demotions queued or "
                                "running: what the lower tiers do not hold yet of what they were sent",
                                value=self.store.background_bytes)
        yield CounterMetricFamily("kvgate_agent_dropped_background_writes",
                                  "write-throughs / demotions skipped because too many bytes were in flight",
                                  value=flow.dropped_background_writes)
        dram = self.store.dram
        if isinstance(dram, DramTier):
            buffers_now = dram.buffer_stats()
            yield GaugeMetricFamily("kvgate_agent_dram_free_buffer_bytes", "bytes of DRAM block buffers ready for "
                                    "the next stores (recycled or pre-faulted: their pages mapped)",
                                    value=buffers_now.free_bytes)
            yield GaugeMetricFamily("kvgate_agent_dram_prefaulting", "1 while the DRAM tier is being pre-faulted "
                                    "(--dram-prefault)", value=int(dram.prefaulting))
            buffers = CounterMetricFamily("kvgate_agent_dram_buffers", "blocks stored into DRAM by where their "
                                          "buffer came from: reused (recycled or pre-faulted) or new (allocated: its "
                                          "pages are faulted by the copy)", labels=["source"])
            buffers.add_metric(["reused"], buffers_now.reused)
            buffers.add_metric(["new"], buffers_now.new)
            yield buffers


class AgentMetrics:
    def __init__(self, store: TierStore, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(TierCollector(store))
        self.load_seconds = Histogram("kvgate_agent_load_seconds", "time to load one block from DRAM, or one "
                                      "run of blocks from a lower tier", ["tier"], buckets=LATENCY_BUCKETS,
                                      registry=self.registry)
        self.store_seconds = Histogram("kvgate_agent_store_seconds", "time to store the new blocks of one chain "
                                       "in a tier (one write where the medium allows)", ["tier"],
                                       buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("kvgate_agent_requests", "API requests", ["op"], registry=self.registry)
        self.request_errors = Counter("kvgate_agent_request_errors", "API requests answered with an error",
                                      ["op"], registry=self.registry)
        self.shm_clients = Gauge("kvgate_agent_shm_clients", "connected clients whose shared memory the agent "
                                 "mapped (the vLLM workers: 0 means no KV bytes can move)", registry=self.registry)
        self.unsent_bytes = Gauge("kvgate_agent_unsent_bytes", "bytes of answers written to clients and not yet "
                                  "taken by them, and of inline answers being made", registry=self.registry)
        self.frame_bytes = Gauge("kvgate_agent_frame_bytes", "bytes of big frames (over 1 MiB) being read or "
                                 "answered, over all connections (at most --frame-budget)", registry=self.registry)
        self.bytes_stored = Counter("kvgate_agent_bytes_stored", "payload bytes clients handed over to store",
                                    registry=self.registry)
        self.bytes_loaded = Counter("kvgate_agent_bytes_loaded", "payload bytes loaded into clients' memory",
                                    registry=self.registry)
        self.lookup_seconds = Histogram("kvgate_agent_lookup_seconds", "time to answer one lookup",
                                        buckets=LATENCY_BUCKETS, registry=self.registry)
        store.observe = self.observe

    def observe(self, op: str, tier: TierName, seconds: float) -> None:
        (self.load_seconds if op == "load" else self.store_seconds).labels(tier).observe(seconds)
