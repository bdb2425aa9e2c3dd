"""The simulator's Prometheus metrics, with vLLM's names and labels (`model_name`, `engine`).

Nothing is updated per request through prometheus_client: the engine keeps plain counters and histograms, and a
collector turns them into metric families when `/metrics` is scraped, so the hot path pays one addition.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# vLLM's buckets for vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# vLLM's request_tokens buckets (1-2-5 up to the model length; these go to 1M)
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5))


@dataclass
class Histogram:
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out = []
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), float(running)))
        out.append(("+Inf", float(self.n)))
        return out


@dataclass
class EngineCounters:
    """What the engine counts; read at scrape time."""

    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    # observed when a request finishes, as vLLM does: scheduled to first token, tokens computed (not cached), prompt
    prefill: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    prefill_computed: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    prompt: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))


@dataclass
class EngineGauges:
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_queries: int
    prefix_hits: int
    external_queries: int = 0
    external_hits: int = 0
    external_hits_by_source: dict[str, int] = field(default_factory=dict)
    num_gpu_blocks: int = 0  # the cache configuration (vLLM's cache_config_info), 0: not exported
    block_size: int = 0


# vLLM's CacheHitSource values, every one exported (as vLLM initialises them)
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


class SimCollector(Collector):
    def __init__(self, model_name: str, counters: EngineCounters, gauges: Callable[[], EngineGauges]) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.counters = counters
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        g = self.gauges()
        c = self.counters

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        def histogram(name: str, doc: str, h: Histogram) -> Metric:
            m = HistogramMetricFamily(name, doc, labels=names)
            m.add_metric(values, h.cumulative(), h.total)
            return m

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", g.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g.kv_cache_usage)
        if g.num_gpu_blocks:  # vLLM's info gauge: the configuration in its labels, the value 1
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=[*names, "block_size", "num_gpu_blocks"])
            info.add_metric([*values, str(g.block_size), str(g.num_gpu_blocks)], 1.0)
            yield info
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      g.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      g.prefix_hits)
        yield counter("vllm:external_prefix_cache_queries",
                      "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
                      "number of queried tokens.", g.external_queries)
        yield counter("vllm:external_prefix_cache_hits",
                      "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
                      "number of cached tokens.", g.external_hits)
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
            "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            labels=[*names, "source"])
        for source in CACHE_HIT_SOURCES:
            value = g.prefix_hits if source == "device" else g.external_hits_by_source.get(source, 0)
            by_source.add_metric([*values, source], value)
        yield by_source
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                      c.prompt_tokens_cached)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*names, "finished_reason"])
        for reason, count in c.success.items():
            success.add_metric([*values, reason], count)
        yield success
        yield histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", c.ttft)
        yield histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", c.itl)
        yield histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", c.e2e)
        yield histogram("vllm:request_queue_time_seconds",
                        "Histogram of time spent in WAITING phase for request.", c.queue)
        yield histogram("vllm:request_prefill_time_seconds",
                        "Histogram of time spent in PREFILL phase for request.", c.prefill)
        yield histogram("vllm:request_prefill_kv_computed_tokens",
                        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                        c.prefill_computed)
        yield histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", c.prompt)


def metrics_registry(collector: SimCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
