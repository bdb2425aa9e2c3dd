"""The worker pool: which replicas exist, which are healthy, what they serve and how loaded they are.

Each worker has one background task that probes `GET /health`, refreshes `GET /v1/models` and scrapes the
load gauges from vLLM's `/metrics`. Live traffic reports connection errors here too, so a dead worker is
ejected at once rather than after the next probe. Removed workers drain: they take no new requests and are
forgotten once their in-flight requests finish.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import operator
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from router.config import GatewayConfig, WorkerSpec
from router.errors import GatewayError, no_worker, unknown_model
from router.metrics import GatewayMetrics
from router.prom_text import info_labels, sum_samples
from router.upstream import FETCH_MAX_BYTES, UpstreamError, UpstreamPool, UpstreamTooLarge

log = logging.getLogger(__name__)

# The vLLM gauges the pool scrapes, and the Worker attribute each one feeds.
LOAD_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    # per finished request (vLLM observes these histograms when a request ends): their sums and count
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
    "vllm:request_prefill_time_seconds_count": "prefill_requests",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_computed_tokens",
    "vllm:request_prompt_tokens_sum": "prefill_prompt_tokens",
}


MAX_CACHE_BLOCKS = 1 << 40  # KV blocks in one engine's cache, at most (more than any GPU's)
MAX_BLOCK_SIZE = 1 << 20  # tokens in one block, at most
# a /metrics page is read this many bytes at a time as it arrives (each about 3 ms; a data-parallel engine's page
# has a sample per rank: megabytes are legal)
PAGE_SLICE_BYTES = 1 << 20
# a /metrics line longer than this is skipped unread: the lines read here (load gauges, cache_config_info) are
# hundreds of bytes; a longer one is a label set no engine writes, or a broken or hostile page
MAX_LINE_BYTES = 64 << 10


class PoolFull(Exception):
    """The pool holds `max_workers` workers already."""


@dataclass(eq=False)
class Worker:
    """One upstream replica as the gateway sees it."""

    spec: WorkerSpec
    # listed in the gateway's own configuration (--worker): only such a worker receives a client's
    # Authorization; one added at run time (admin, discovery) gets upstream_api_key or nothing
    configured: bool = False
    models: frozenset[str] = frozenset()
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)
    healthy: bool = False
    draining: bool = False
    in_flight: int = 0
    # the gateway's sibling processes' requests in flight here (`--processes N`: router/sibling_routes.py), so that
    # what weighs load (`outstanding`, the prefill balance) weighs the whole gateway's, as one process would
    sibling_in_flight: int = 0
    routed: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    # the engine's KV cache as its cache configuration says (`vllm:cache_config_info`): blocks (vLLM's
    # num_gpu_blocks, its null block included; per data-parallel rank) and tokens per block; 0 while unknown
    kv_blocks: int = 0
    kv_block_size: int = 0
    prefix_hits: float = 0.0  # tokens, the engine's own counters
    prefix_queries: float = 0.0
    # the engine's own prefill timings, cumulative: seconds from scheduled to first token, requests, tokens computed
    # (not cached) and prompt tokens, over the requests it finished (the `ttft` strategy learns its rate from them)
    prefill_seconds: float = 0.0
    prefill_requests: float = 0.0
    prefill_computed_tokens: float = 0.0
    prefill_prompt_tokens: float = 0.0
    models_fetched_at: float = 0.0
    load_scraped_at: float = 0.0
    # the base model this worker serves (its model card without a `parent`): the root of the block keys of its KV
    # events; None while its models are unknown. Found once per listing (`take_listing`): it is asked per request and
    # per event batch, and a listing may name 100,000 adapters
    base_model: str | None = None
    _listing_digest: int | None = field(default=None, repr=False)  # of the last /v1/models body taken
    # `key_names`'s last answer (asked per request) for the listing taken last: (model, names)
    _key_names: tuple[str, tuple[str, str | None]] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def outstanding(self) -> float:
        """Requests ahead of a new one on this worker: the gateway's own in-flight (all its processes') plus the
        engine's queue."""
        return self.in_flight + self.sibling_in_flight + self.waiting

    def serves(self, model: str) -> bool:
        return self.healthy and not self.draining and model in self.models

    def take_listing(self, cards: dict[str, dict[str, Any]]) -> None:
        """This worker's model cards (its /v1/models listing, by id), and what is derived from them once."""
        self.model_cards = cards
        self.models = frozenset(cards)
        self.base_model = next((m for m, card in cards.items() if card.get("parent") in (None, m)), None)
        self._key_names = None

    def key_names(self, model: str) -> tuple[str, str | None]:
        """What a request for `model` is keyed under on this worker, as its engine names the blocks: (base model,
        LoRA adapter or None). Every alias of the base model (`--served-model-name a b`) is keyed as the first."""
        known = self._key_names
        if known is not None and known[0] == model:
            return known[1]
        base = self.lora_base(model)
        if base is not None:
            names: tuple[str, str | None] = (base, model)
        else:
            canonical = self.base_model if model in self.model_cards else None
            names = (canonical or model, None)
        self._key_names = (model, names)
        return names

    def lora_base(self, model: str) -> str | None:
        """The base model of the LoRA adapter this worker serves as `model` (vLLM's model card names it
        `parent`); None for a base model, or a model this worker does not list."""
        card = self.model_cards.get(model)
        parent = card.get("parent") if card is not None else None
        return parent if isinstance(parent, str) and parent and parent != model else None

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "events": self.spec.events,
            "replay": self.spec.replay,
            "agent_events": self.spec.agent_events,
            "agent_replay": self.spec.agent_replay,
            "dp_ranks": self.spec.dp_ranks,
            "models": sorted(self.models),
            "configured": self.configured,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "sibling_in_flight": self.sibling_in_flight,
            "requests_routed": self.routed,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "load": {"running": self.running, "waiting": self.waiting, "kv_cache_usage": self.kv_usage},
            "prefix_cache": {"hit_tokens": self.prefix_hits, "query_tokens": self.prefix_queries},
        }


def parse_load_gauges(text: str) -> dict[str, float]:
    """The load gauges of a vLLM `/metrics` page, by Worker attribute, summed over label sets; one whose total no
    engine could report (NaN, infinite, negative) is left out, so the worker keeps its last value (a NaN load made
    every strategy's comparisons false and every request a 500), and the cache usage is at most 1."""
    return load_gauges(sum_samples(text, LOAD_GAUGES))


def load_gauges(totals: dict[str, float]) -> dict[str, float]:
    """`parse_load_gauges` of a page whose samples `sum_samples` summed already."""
    values = {LOAD_GAUGES[name]: value for name, value in totals.items() if math.isfinite(value) and value >= 0}
    if "kv_usage" in values:
        values["kv_usage"] = min(values["kv_usage"], 1.0)
    return values


def parse_cache_config(text: str) -> tuple[int, int] | None:
    """(num_gpu_blocks, block_size) of a vLLM `/metrics` page's `vllm:cache_config_info` (one data-parallel rank's:
    each rank has its own cache of that size); None when it is absent or does not say them."""
    return cache_config(info_labels(text, "vllm:cache_config_info"))


def cache_config(labels: dict[str, str] | None) -> tuple[int, int] | None:
    """`parse_cache_config` of the labels of the page's first `vllm:cache_config_info` sample."""
    try:
        blocks, block_size = (int(labels["num_gpu_blocks"]), int(labels["block_size"])) if labels else (0, 0)
    except (KeyError, ValueError):
        return None  # older vLLM, or num_gpu_blocks "None" before the engine has profiled
    # a size no engine could have (the strategies compute with it as a float: 10^400 blocks raised there) is not read
    return (blocks, block_size) if 0 < blocks <= MAX_CACHE_BLOCKS and 0 < block_size <= MAX_BLOCK_SIZE else None


class PageReader:
    """`parse_load_gauges` and `parse_cache_config` of a `/metrics` page fed as it arrives, read PAGE_SLICE_BYTES
    at a time (cut at line ends), never the whole page at once: a 16 MiB page joined, decoded and searched in one
    go held the event loop for 47-52 ms (the join's first touch of 16 fresh MiB alone: 12 ms). A line longer than
    MAX_LINE_BYTES is skipped as it arrives: a page with no line end was kept whole and read in one go at its end
    (39 ms for 16 MiB). `feed` raises UnicodeDecodeError for a page that is not UTF-8."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(LOAD_GAUGES, 0.0)
        self.labels: dict[str, str] | None = None
        self._pending: list[bytes] = []
        self._size = 0
        self._skipping = False  # inside a line too long to read: its bytes are dropped up to its end

    def feed(self, chunk: bytes) -> None:
        if self._skipping:
            end = chunk.find(b"\n") + 1
            if not end:
                return
            self._skipping = False
            chunk = chunk[end:]
        self._pending.append(chunk)
        self._size += len(chunk)
        if self._size < PAGE_SLICE_BYTES:
            return
        # cut at the last line end; what follows is one line still arriving (each byte is joined at most twice:
        # read again at every chunk, a line of megabytes was quadratic, 25 times the CPU of 16 MiB of samples)
        data = b"".join(self._pending)
        cut = data.rfind(b"\n") + 1
        rest = data[cut:]
        if len(rest) > MAX_LINE_BYTES:
            rest, self._skipping = b"", True
        self._pending, self._size = [rest], len(rest)
        self._read(memoryview(data)[:cut])

    def result(self) -> tuple[dict[str, float], tuple[int, int] | None]:
        if not self._skipping:
            self._read(b"".join(self._pending))
        self._pending, self._size, self._skipping = [], 0, False
        return load_gauges(self.totals), cache_config(self.labels)

    def _read(self, data: bytes | memoryview) -> None:
        if not data:
            return
        text = str(data, "utf-8")
        for name, value in sum_samples(text, LOAD_GAUGES).items():
            self.totals[name] += value
        if self.labels is None:
            self.labels = info_labels(text, "vllm:cache_config_info")


class WorkerPool:
    """The set of workers, their health and load, kept fresh by one background task per worker."""

    def __init__(
        self,
        config: GatewayConfig,
        upstream: UpstreamPool,
        metrics: GatewayMetrics,
        on_added: Callable[[Worker], None] | None = None,
        on_removed: Callable[[str], None] | None = None,
        hop: str = "kvgate",
    ) -> None:
        self._config = config
        self._upstream = upstream
        self._metrics = metrics
        self._on_added = on_added
        self._on_removed = on_removed
        # the probes' headers: upstream_api_key, as every request to a worker carries it (vLLM's `--api-key` guards
        # /v1/models: without it no such worker would ever be healthy)
        key = config.upstream_api_key
        self._probe_headers = [("Authorization", f"Bearer {key}")] if key else []
        # and the gateway's `Via`: a gateway listed as its own worker answers its probes 508, and is never healthy
        self._probe_headers.append(("Via", f"1.1 {hop}"))
        self._workers: dict[str, Worker] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._drains: set[asyncio.Task[None]] = set()
        self._idle: dict[str, asyncio.Event] = {}
        self._running = False
        # GET /v1/models's body and the healthy workers' listings it was made of (see models_listing)
        self._listing: tuple[list[dict[str, dict[str, Any]]], bytes] | None = None

    # --- membership -------------------------------------------------------------------------------------------

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url.rstrip("/"))

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def eligible(self, model: str | None, exclude: Container[str] = ()) -> list[Worker]:
        """Workers that may take a new request for `model` now (any healthy one when the request names no
        model), but none whose URL is in `exclude` (those tried already)."""
        # `serves` and `url` written out: a call per worker, twice per request, cost more than the tests
        workers = ([w for w in self._workers.values() if w.healthy and not w.draining and model in w.models]
                   if model else self.healthy())
        return [w for w in workers if w.spec.url not in exclude] if exclude else workers

    def unavailable(self, model: str | None) -> GatewayError:
        """Why no worker may take a request for `model` now: the error to answer it with."""
        if model and any(model in w.models for w in self._workers.values()):
            return no_worker(f"no healthy worker serves model `{model}` right now")
        if not self.healthy() or not model:
            return no_worker("no healthy worker available")
        return unknown_model(model)

    def healthy(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.healthy and not w.draining]

    def models_listing(self) -> bytes:
        """GET /v1/models's body: the de-duplicated union of the models the healthy workers serve, as OpenAI model
        cards by id. Made again only when the healthy workers or one of their listings changed (a worker's
        `model_cards` is replaced by `Worker.take_listing`, never changed in place): a listing may hold 100,000
        adapters, 87 ms to sort and serialise on the event loop at every call."""
        listings = [worker.model_cards for worker in self.healthy()]
        made = self._listing
        if made is not None and len(made[0]) == len(listings) and all(map(operator.is_, made[0], listings)):
            return made[1]
        cards: dict[str, dict[str, Any]] = {}
        for listing in listings:
            for model_id, card in listing.items():
                cards.setdefault(model_id, card)
        body = orjson.dumps({"object": "list", "data": [cards[k] for k in sorted(cards)]})
        self._listing = (listings, body)  # the listings held, so none's id is reused while this is kept
        return body

    async def start(self) -> None:
        """Start probing every configured worker and wait (bounded) for the first round of probes."""
        self._running = True
        for worker in list(self._workers.values()):
            self._start_task(worker)
        await self.probe_all()

    async def probe_all(self) -> None:
        await self.probe(self._workers.values())

    async def probe(self, workers: Iterable[Worker]) -> None:
        """Probe these workers once now, all at once (one just added is routed to once a probe passes)."""
        probing = [w for w in workers if not w.draining]
        if probing:
            await asyncio.gather(*(self._probe(w) for w in probing), return_exceptions=True)

    def add(self, spec: WorkerSpec, *, configured: bool = False) -> Worker:
        """Raises KeyError for a URL in the pool already (draining ones too), PoolFull beyond `max_workers`."""
        if spec.url in self._workers:
            raise KeyError(spec.url)
        if len(self._workers) >= self._config.max_workers:
            # each worker costs a watching task, probes, connections and KV-event sockets: a DNS answer of thousands
            # of records (a broken or hostile server) made as many, and held the event loop for seconds each round
            raise PoolFull(f"the pool holds max_workers ({self._config.max_workers}) workers already")
        worker = Worker(spec=spec, configured=configured)
        self._workers[spec.url] = worker
        if self._on_added is not None:
            try:
                self._on_added(worker)
            except BaseException:
                del self._workers[spec.url]  # all or nothing: no half-added worker
                raise
        self._metrics.healthy.labels(spec.url).set(0)
        self._metrics.in_flight.labels(spec.url).set_function(lambda: worker.in_flight)  # read when scraped
        if self._running:
            self._start_task(worker)
        return worker

    def remove(self, url: str) -> Worker:
        """Stop routing to a worker; it is forgotten once its in-flight requests finish (or the drain times out)."""
        worker = self._workers[url.rstrip("/")]
        worker.draining = True
        task = self._tasks.pop(worker.url, None)
        if task is not None:
            task.cancel()
        if worker.in_flight == 0:
            self._forget(worker)
        else:
            # the event exists before the drain task first runs, so a release in between is not missed
            idle = self._idle[worker.url] = asyncio.Event()
            drain = asyncio.get_running_loop().create_task(self._drain(worker, idle))
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        return worker

    async def _drain(self, worker: Worker, idle: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(idle.wait(), self._config.drain_timeout_s)
        except TimeoutError:
            log.warning("drain of %s timed out with %d requests in flight", worker.url, worker.in_flight)
        self._forget(worker)

    def _forget(self, worker: Worker) -> None:
        if self._workers.get(worker.url) is worker:
            del self._workers[worker.url]
            self._idle.pop(worker.url, None)
            self._metrics.forget_worker(worker.url)
            if self._on_removed is not None:
                self._on_removed(worker.url)
            log.info("worker %s removed", worker.url)

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._tasks.values(), *self._drains]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    # --- live traffic -----------------------------------------------------------------------------------------

    def acquire(self, worker: Worker) -> None:
        worker.in_flight += 1
        worker.routed += 1

    def release(self, worker: Worker) -> None:
        worker.in_flight -= 1
        if worker.draining and worker.in_flight == 0 and worker.url in self._idle:
            self._idle[worker.url].set()

    def report_connection_error(self, worker: Worker, error: str) -> None:
        """A live request could not reach the worker: eject it now; the probe re-admits it when it recovers."""
        worker.last_error = error
        worker.consecutive_failures = max(worker.consecutive_failures, self._config.unhealthy_after)
        self._set_health(worker, False)

    # --- probing ----------------------------------------------------------------------------------------------

    def _start_task(self, worker: Worker) -> None:
        self._tasks[worker.url] = asyncio.get_running_loop().create_task(
            self._watch(worker), name=f"watch {worker.url}"
        )

    async def _watch(self, worker: Worker) -> None:
        """Probe health on one cadence and scrape load on another, until the worker is removed."""
        cfg = self._config
        next_probe = time.monotonic() + cfg.health_interval_s
        while True:
            now = time.monotonic()
            try:
                if now >= next_probe:
                    next_probe = now + cfg.health_interval_s
                    await self._probe(worker)
                    next_probe = time.monotonic() + cfg.health_interval_s
                if worker.healthy:
                    await self._scrape_load(worker)
            except Exception as exc:  # whatever a worker answers, its watcher keeps watching
                log.exception("watching %s failed", worker.url)
                self._failed_probe(worker, f"health probe failed: {describe_error(exc)}")
            wake = min(next_probe, time.monotonic() + cfg.metrics_interval_s)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))

    async def _probe(self, worker: Worker) -> None:
        cfg = self._config
        try:
            status, _ = await self._upstream.fetch(worker.url + "/health", cfg.health_timeout_s,
                                                   headers=self._probe_headers)
            ok = status == 200
            error = None if ok else f"health probe answered {status}"
            if ok and (
                not worker.healthy or time.monotonic() - worker.models_fetched_at > cfg.models_refresh_s
            ):
                await self._fetch_models(worker)
        except (UpstreamError, TimeoutError, ValueError) as exc:
            ok, error = False, f"health probe failed: {describe_error(exc)}"
        if ok:
            worker.consecutive_failures = 0
            self._set_health(worker, True)
        else:
            self._failed_probe(worker, error or "health probe failed")

    def _failed_probe(self, worker: Worker, error: str) -> None:
        worker.consecutive_failures += 1
        worker.last_error = error
        if worker.consecutive_failures >= self._config.unhealthy_after:
            self._set_health(worker, False)

    async def _fetch_models(self, worker: Worker) -> None:
        """Raises ValueError when the listing is missing or malformed."""
        status, body = await self._upstream.fetch(worker.url + "/v1/models", self._config.health_timeout_s,
                                                  headers=self._probe_headers)
        if status != 200:
            raise ValueError(f"/v1/models answered {status}")
        digest = xxhash.xxh3_64_intdigest(body)
        if digest == worker._listing_digest:  # the same listing: not parsed again (it may be megabytes)
            worker.models_fetched_at = time.monotonic()
            return
        listing = orjson.loads(body)
        if not isinstance(listing, dict) or not isinstance(listing.get("data", []), list):
            raise ValueError("/v1/models did not answer a JSON object with a `data` list")
        cards = {
            card["id"]: card
            for card in listing.get("data", [])
            if isinstance(card, dict) and isinstance(card.get("id"), str)
        }
        worker.take_listing(cards)
        worker.models_fetched_at = time.monotonic()
        worker._listing_digest = digest

    async def _scrape_load(self, worker: Worker) -> None:
        page = PageReader()
        try:
            async with asyncio.timeout(self._config.health_timeout_s):
                response = await self._upstream.request("GET", worker.url + "/metrics", self._probe_headers)
                try:
                    if response.status != 200:
                        return
                    size = 0
                    async for chunk in response.chunks():  # each in a turn of the event loop of its own
                        size += len(chunk)
                        if size > FETCH_MAX_BYTES:
                            raise UpstreamTooLarge(f"the worker's /metrics exceeds {FETCH_MAX_BYTES} bytes")
                        page.feed(chunk)
                finally:
                    response.close()
            values, cache = page.result()
        except (UpstreamError, TimeoutError, UnicodeDecodeError):
            return  # load is advisory; health is decided by the probe
        for attr, value in values.items():
            setattr(worker, attr, value)
        if cache is not None:
            worker.kv_blocks, worker.kv_block_size = cache
        worker.load_scraped_at = time.monotonic()
        m = self._metrics
        m.worker_running.labels(worker.url).set(worker.running)
        m.worker_waiting.labels(worker.url).set(worker.waiting)
        m.worker_kv_usage.labels(worker.url).set(worker.kv_usage)
        m.worker_prefix_hits.labels(worker.url).set(worker.prefix_hits)
        m.worker_prefix_queries.labels(worker.url).set(worker.prefix_queries)

    def _set_health(self, worker: Worker, healthy: bool) -> None:
        if worker.healthy == healthy:
            return
        worker.healthy = healthy
        if worker.draining:
            return
        self._metrics.healthy.labels(worker.url).set(1 if healthy else 0)
        if healthy:
            log.info("worker %s is healthy (%s)", worker.url, _models_named(worker.models))
        else:
            self._metrics.ejections.labels(worker.url).inc()
            log.warning("worker %s ejected: %s", worker.url, worker.last_error)


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _models_named(models: frozenset[str], most: int = 8) -> str:
    """A worker's models for a log line: its own strings, so escaped (a newline would forge a line) and a few of
    them at most (a listing may name 100,000)."""
    shown = [repr(model[:200])[1:-1] for model in heapq.nsmallest(most, models)]
    more = ", ..." if len(models) > most else ""
    return f"{len(models)} models: {', '.join(shown)}{more}"
