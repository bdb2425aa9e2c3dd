"""The gateway's Prometheus metrics, registered in a registry owned by one app (no global state)."""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, values

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKENIZE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class _BoundChildren:
    """`labels()` for label sets seen before is one dict lookup: prometheus_client's checks every argument and
    takes a lock on every call, which the request path pays a dozen times per request."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        if labelvalues and not labelkwargs:
            children: dict[tuple[str, ...], Any] = self._metrics  # type: ignore[attr-defined]
            child = children.get(labelvalues)  # the children by their label values, as strings
            if child is not None:
                return child
        return super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]


# The gateway updates its metrics on the event loop's thread alone (the tokenizer threads return results, the
# loop counts them), so a child's value needs no lock there: `inc` and `observe` add to it directly, which costs a
# quarter of prometheus_client's call chain (a check, a method, a lock per value; the request path updates about
# fourteen values per request). Not with prometheus_client's multiprocess values, whose writes go to a file. A metric
# counted from another thread takes prometheus_client's own classes (the trace recorder's writer thread does).
_PLAIN_VALUES = values.ValueClass is values.MutexValue


class Counter(_BoundChildren, prometheus_client.Counter):
    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        """prometheus_client's `inc`; for a counter that has a value (a child, or one without labels), no exemplar
        and a non-negative amount, added without the lock (above)."""
        try:
            value = self._value
        except AttributeError:  # a labelled counter's parent: prometheus_client's own error
            value = None
        if value is None or exemplar is not None or amount < 0 or not _PLAIN_VALUES:
            super().inc(amount, exemplar)
            return
        value._value += amount


class Gauge(_BoundChildren, prometheus_client.Gauge):
    pass


class Histogram(_BoundChildren, prometheus_client.Histogram):
    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        """prometheus_client's `observe`, its bucket found by bisection instead of a Python loop over the bounds
        (the request path observes a few histograms per request)."""
        if exemplar is not None or amount != amount:  # an exemplar, or NaN (counted in no bucket): the original
            super().observe(amount, exemplar)
            return
        try:
            buckets = self._buckets
        except AttributeError:  # a labelled histogram's parent: prometheus_client's own error
            buckets = None
        if buckets is None or not _PLAIN_VALUES:
            self._raise_if_not_observable()  # type: ignore[no-untyped-call]
            self._sum.inc(amount)
            self._buckets[bisect_left(self._upper_bounds, amount)].inc(1)
            return
        # without the locks (above); the first bound >= amount (+Inf last)
        self._sum._value += amount
        buckets[bisect_left(self._upper_bounds, amount)]._value += 1


class GatewayMetrics:
    """Every metric the gateway exports, prefixed `kvgate_`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvgate_requests", "Proxied requests by model, worker and HTTP status",
            ["model", "worker", "status"], registry=r,
        )
        self.rejected = Counter(
            "kvgate_rejected_requests", "Requests answered by the gateway itself with an error, by status and code",
            ["status", "code"], registry=r,
        )
        # admission and connections (router/admission.py, router/listener.py); the admission's two gauges are read
        # when scraped (`set_function`), never set per request
        self.requests_in_flight = Gauge(
            "kvgate_requests_in_flight", "Proxied requests in flight, against max_in_flight_requests", registry=r,
        )
        self.request_bytes_in_flight = Gauge(
            "kvgate_request_bytes_in_flight", "Request-body bytes held by requests in flight, against "
            "max_in_flight_bytes", registry=r,
        )
        self.client_connections = Gauge(
            "kvgate_client_connections", "Open client connections, against max_client_connections", registry=r,
        )
        self.client_connections_refused = Counter(
            "kvgate_client_connections_refused", "Client connections answered 503 and closed at the connection cap",
            registry=r,
        )
        self.request_duration = Histogram(
            "kvgate_request_duration_seconds", "Time from request arrival to the last byte sent to the client",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttfb = Histogram(
            "kvgate_time_to_first_byte_seconds", "Time from request arrival to the first body byte from the worker",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(  # read when scraped, as above
            "kvgate_worker_in_flight_requests", "Requests the gateway has outstanding on each worker",
            ["worker"], registry=r,
        )
        self.healthy = Gauge(
            "kvgate_worker_healthy", "1 when the worker passes its health probes, else 0", ["worker"], registry=r,
        )
        self.worker_waiting = Gauge(
            "kvgate_worker_waiting_requests", "vllm:num_requests_waiting last scraped from the worker",
            ["worker"], registry=r,
        )
        self.worker_running = Gauge(
            "kvgate_worker_running_requests", "vllm:num_requests_running last scraped from the worker",
            ["worker"], registry=r,
        )
        self.worker_kv_usage = Gauge(
            "kvgate_worker_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc last scraped from the worker (0-1)",
            ["worker"], registry=r,
        )
        self.prefill_holds = Histogram(
            "kvgate_prefill_hold_seconds", "Time a long prefill was held before it was sent, for the worker's long "
            "prefill before it to have its first token (strategies that ask: `ttft`)", buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # router/turn_broker.py (`--processes N`): the gateway's turns, kept by process 0 for all
        self.prefill_turns_shared = Gauge(
            "kvgate_prefill_turns_shared", "1 while this process takes its long prefills' turns from the gateway's "
            "turn broker (--processes above 1), else 0", registry=r,
        )
        self.prefill_turns_local = Counter(
            "kvgate_prefill_turns_local", "Long prefills sent in a turn of this process's own because the gateway's "
            "turn broker could not give one, by reason (unreachable: no connection to it; timeout: no answer in "
            "time; lost: the connection closed while the request waited)", ["reason"], registry=r,
        )
        # router/sibling_routes.py (`--processes N`): each process's routes told to the others
        self.sibling_records = Counter(
            "kvgate_sibling_records", "Records of requests routed (placed, first token, ended) told to sibling "
            "processes (sent: once per sibling), applied from them, and dropped, by outcome (disconnected: the "
            "sibling's connection closed with them in flight; expired: their end never came; unknown_worker: a "
            "worker this process does not have; too_large: more keys than a frame holds)", ["outcome"], registry=r,
        )
        self.siblings_connected = Gauge(
            "kvgate_siblings_connected", "Sibling processes connected to tell routes to (direction to) and to hear "
            "them from (from)", ["direction"], registry=r,
        )
        self.sibling_connections_dropped = Counter(
            "kvgate_sibling_connections_dropped", "Connections of sibling routes dropped, by reason (garbage: a "
            "frame that could not be read; not_reading: the sibling left too much unread; closed: it closed it)",
            ["reason"], registry=r,
        )
        self.retries = Counter(
            "kvgate_retries", "Requests re-sent to another worker before any byte reached the client, by reason",
            ["reason"], registry=r,
        )
        self.decisions = Counter(
            "kvgate_routing_decisions", "Routing decisions by strategy and reason", ["strategy", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "kvgate_worker_ejections", "Times a worker was marked unhealthy", ["worker"], registry=r,
        )
        # worker discovery (router/discovery.py)
        self.discovered_workers = Gauge(
            "kvgate_discovered_workers", "Workers each discovery source sees now", ["source"], registry=r,
        )
        self.discovery_errors = Counter(
            "kvgate_discovery_errors", "Discovery rounds a source failed (its last answer kept)", ["source"],
            registry=r,
        )
        # prompts (strategies that read them)
        self.tokenize_duration = Histogram(
            "kvgate_tokenize_duration_seconds", "Time to tokenize and hash one prompt, by mode (tokens or text)",
            ["mode"], buckets=TOKENIZE_BUCKETS, registry=r,
        )
        self.tokenize_fallbacks = Counter(
            "kvgate_tokenize_fallbacks", "Prompts routed in text mode although tokenizers are configured, by reason "
            "(no_tokenizer: none found or loaded for the model; refused: its template or tokenizer refused the "
            "request; tokenizer_unavailable: no tokenizer process answered in time)", ["reason"], registry=r,
        )
        self.oversized_prompts = Counter(
            "kvgate_oversized_prompts", "Generation requests over route_max_prompt_bytes, routed by load alone",
            registry=r,
        )
        self.client_template_renders = Counter(
            "kvgate_client_template_renders", "Chat requests with a template of their own, by outcome (ok; else "
            "routed in text mode: untrusted, busy, timeout, crashed, memory, output, error)", ["outcome"],
            registry=r,
        )
        # KV events and the block index (strategies that read them: `kv`)
        self.kv_events_applied = Counter(
            "kvgate_kv_events_applied", "KV events applied to the block index, by worker and event type",
            ["worker", "type"], registry=r,
        )
        self.kv_gaps = Counter(
            "kvgate_kv_event_gaps", "Sequence gaps seen in a worker's KV event stream", ["worker"], registry=r,
        )
        self.kv_duplicates = Counter(
            "kvgate_kv_event_duplicates", "KV event batches received again after they were applied (skipped)",
            ["worker"], registry=r,
        )
        self.kv_replays = Counter(
            "kvgate_kv_event_replays",
            "Replay requests by outcome (repaired, timeout; a gap left unrepaired: too_frequent, or backoff after a "
            "timeout)",
            ["worker", "outcome"], registry=r,
        )
        self.kv_resets = Counter(
            "kvgate_kv_state_resets",
            "Times a worker's known blocks were forgotten, by reason (gap, publisher_restart, late_start, apply_error, "
            "disconnected)",
            ["worker", "reason"], registry=r,
        )
        self.kv_decode_errors = Counter(
            "kvgate_kv_event_decode_errors", "Malformed KV event messages dropped, by reason", ["worker", "reason"],
            registry=r,
        )
        self.kv_event_mismatches = Counter(
            "kvgate_kv_event_mismatches",
            "KV events not indexed because they do not fit the gateway: by reason (block_size: another block size "
            "than --block-size; group: a KV-cache group other than the full-attention one indexed)",
            ["worker", "reason"], registry=r,
        )
        self.kv_waiting_announcements = Gauge(
            "kvgate_kv_waiting_announcements",
            "Tier announcements without token ids waiting for the engine to name their block", registry=r,
        )
        self.kv_unmapped_blocks = Counter(
            "kvgate_kv_unmapped_blocks", "Stored blocks whose gateway key could not be derived (unknown parent)",
            ["worker"], registry=r,
        )
        self.kv_worker_trusted = Gauge(
            "kvgate_kv_worker_trusted",
            "1 while the block index's picture of the worker is complete (routed by it), 0 while it is routed by "
            "the approximate trie (missed events, bad input, just started)", ["worker"], registry=r,
        )
        self.kv_index_entries = Gauge(
            "kvgate_kv_index_entries", "(block, worker) entries in the KV block index", registry=r,
        )
        self.actual_cached_tokens = Counter(
            "kvgate_actual_cached_tokens",
            "Prompt tokens the engines reported cached (usage.prompt_tokens_details.cached_tokens)",
            ["strategy"], registry=r,
        )
        self.usage_prompt_tokens = Counter(
            "kvgate_usage_prompt_tokens", "Prompt tokens of answers that reported cached tokens (their denominator)",
            ["strategy"], registry=r,
        )
        self.usage_predicted_tokens = Counter(
            "kvgate_usage_predicted_cached_tokens",
            "Predicted cached tokens of the answers that reported cached tokens (compare with actual)",
            ["strategy"], registry=r,
        )
        self.worker_predicted_cached_tokens = Counter(
            "kvgate_worker_predicted_cached_tokens",
            "Cached tokens the strategy predicted for the answers that reported cached tokens, by worker (against "
            "kvgate_worker_reported_cached_tokens_total: the routing index's drift)", ["worker"], registry=r,
        )
        self.worker_reported_cached_tokens = Counter(
            "kvgate_worker_reported_cached_tokens",
            "Cached tokens the worker's answers reported (usage.prompt_tokens_details.cached_tokens), by worker",
            ["worker"], registry=r,
        )
        self.worker_prefix_hits = Gauge(
            "kvgate_worker_prefix_cache_hit_tokens", "vllm:prefix_cache_hits_total last scraped from the worker",
            ["worker"], registry=r,
        )
        self.worker_prefix_queries = Gauge(
            "kvgate_worker_prefix_cache_query_tokens",
            "vllm:prefix_cache_queries_total last scraped from the worker", ["worker"], registry=r,
        )

    def forget_worker(self, url: str) -> None:
        """Drop every label set naming a removed worker (or one of its data-parallel ranks' caches, `URL#dpN`), so
        dashboards stop showing it and a fleet whose workers come and go (discovery, /admin/workers) does not grow
        the metrics without bound."""
        rank = url + "#dp"
        for metric in vars(self).values():
            if not isinstance(metric, prometheus_client.metrics.MetricWrapperBase):
                continue
            names = metric._labelnames
            if "worker" not in names:
                continue
            at = names.index("worker")
            for labels in [k for k in list(metric._metrics)
                           if k[at] == url or (k[at].startswith(rank) and k[at][len(rank):].isdigit())]:
                with contextlib.suppress(KeyError):
                    metric.remove(*labels)
