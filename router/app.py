"""The gateway's HTTP front: `create_app(config, strategy)` builds the aiohttp application with every endpoint."""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from typing import Any, TypeVar

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvcore.aio import WorkerThreads
from kvcore.config import ConfigError
from kvcore.http_errors import error_response
from kvcore.kv_events import dp_endpoint
from router.admission import Admission, Admitted
from router.config import GatewayConfig, WorkerSpec
from router.discovery import WorkerDiscovery
from router.errors import GatewayError, bad_request, no_worker
from router.kv_index import InMemoryKvIndex
from router.kv_subscriber import EventSource, KvEventHub
from router.listener import raise_open_file_limit, serving
from router.metrics import GatewayMetrics
from router.pool import PoolFull, Worker, WorkerPool
from router.processes import GatewayProcess
from router.prompt_tokens import CHARS_PER_TOKEN, PromptTokens
from router.proxy import FORWARDED_REQUEST_HEADERS, Proxy
from router.requests import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ApiRequest,
    LargePrompt,
    parse_body,
    parse_json_object,
    with_tenant,
)
from router.routing import RouteRequest, Strategy
from router.sibling_routes import SiblingRoutes
from router.trace_recorder import TraceEntry, TraceRecorder
from router.turn_broker import SharedPrefillTurns, TurnBroker
from router.upstream import UpstreamPool

log = logging.getLogger(__name__)

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
DOT_SEGMENTS = frozenset({".", ".."})  # of a request's path, percent-decoded


class Gateway:
    """The running gateway's parts, owned by one application."""

    def __init__(self, config: GatewayConfig, strategy: Strategy, process: GatewayProcess | None = None) -> None:
        self.config = config
        self.process = process  # which of several gateway processes this is (`--processes`), if there are several
        # this gateway's name in the `Via` header of what it sends to workers (every process of one gateway the
        # same): a request that comes back with it went round a loop (the gateway listed as its own worker)
        self.hop = "kvgate-" + (hashlib.sha256(process.sockets.encode()).hexdigest()[:12] if process is not None
                                else os.urandom(6).hex())
        self.metrics = GatewayMetrics()
        self.admission = Admission(config.max_in_flight_requests, config.max_in_flight_bytes, self.metrics)
        self.strategy = strategy
        self.strategy.register_metrics(self.metrics.registry)
        # CPU work off the event loop (tokenizing, parsing large bodies), one pool, started before serving
        self.threads = WorkerThreads(config.tokenizer_threads, "kvgate-work")
        # tokenizing costs CPU: only for strategies that read the prompt's tokens, or to record the traffic
        self.prompts = (PromptTokens(config, self.metrics, self.threads)
                        if self.strategy.needs_prompt_tokens or config.record_trace else None)
        self.recorder: TraceRecorder | None = None
        self._upstream: UpstreamPool | None = None
        self._pool: WorkerPool | None = None
        self._proxy: Proxy | None = None
        self._discovery: WorkerDiscovery | None = None
        self.kv_events: KvEventHub | None = None
        self._turn_broker: TurnBroker | None = None  # process 0 of several: the gateway's prefill turns, for all
        self.prefill_turns: SharedPrefillTurns | None = None  # several processes: this one's turns at the broker
        self.sibling_routes: SiblingRoutes | None = None  # several processes: what each routes, told to the others

    @property
    def pool(self) -> WorkerPool:
        assert self._pool is not None, "gateway not started"
        return self._pool

    @property
    def proxy(self) -> Proxy:
        assert self._proxy is not None, "gateway not started"
        return self._proxy

    async def start(self) -> None:
        cfg = self.config
        self.threads.start()
        if cfg.record_trace:
            self.recorder = self._recorder()
            self.recorder.start()
        self._upstream = UpstreamPool(
            limit_per_host=cfg.max_connections_per_worker, connect_timeout=cfg.connect_timeout_s
        )
        if self.strategy.uses_kv_events:
            index = InMemoryKvIndex(cfg.kv_index_max_entries)
            self.kv_events = KvEventHub(index, self.metrics, self._base_model, replay_timeout_s=cfg.kv_replay_timeout_s,
                                        resync_s=cfg.kv_resync_s, block_size=cfg.block_size,
                                        identity_blocks=cfg.kv_identity_blocks)
            self.strategy.attach_kv(index, self.kv_events.trusted, self.kv_events.any_sources)
        self._pool = WorkerPool(cfg, self._upstream, self.metrics, on_added=self._worker_added,
                                on_removed=self._worker_removed, hop=self.hop)
        for spec in cfg.worker:
            self._pool.add(spec, configured=True)
        if self.process is not None:
            if self.process.index == 0:
                self._turn_broker = TurnBroker(self.process.turns_socket)
                await self._turn_broker.start()
            self.prefill_turns = SharedPrefillTurns(self.process.turns_socket, self.metrics)
            self.prefill_turns.start()
            # a request's end comes within its total timeout: one that did not has been lost
            self.sibling_routes = SiblingRoutes(self.process.index, self.process.routes_socket, self.process.count,
                                                self.strategy, self._pool.get, self.metrics,
                                                record_ttl_s=cfg.total_timeout_s + 10.0)
            await self.sibling_routes.start()
        self._proxy = Proxy(cfg, self._pool, self.strategy, self.metrics, self._upstream,
                            self.kv_events.learn if self.kv_events is not None else None, hop=self.hop,
                            turns=self.prefill_turns, siblings=self.sibling_routes)
        if self.prompts is not None:
            await self.prompts.start()
        await self._pool.start()
        if cfg.discover:
            self._discovery = WorkerDiscovery(cfg, self._pool, self.metrics)
            await self._discovery.start()

    def _worker_added(self, worker: Worker) -> None:
        spec = worker.spec
        if self.kv_events is not None:
            # a data-parallel engine publishes per rank (port + rank); its node's tier agent serves every rank
            sources = [source for rank, _ in spec.caches() for source in (
                EventSource(worker.url, dp_endpoint(spec.events, rank),
                            dp_endpoint(spec.replay, rank) if spec.replay else None, "engine", rank)
                if spec.events else None,
                EventSource(worker.url, spec.agent_events, spec.agent_replay, "agent", rank)
                if spec.agent_events else None) if source is not None]
            try:
                self.kv_events.watch(sources)
            except BaseException:
                self.kv_events.forget_worker(worker.url)  # the pool undoes the add: leave nothing behind
                raise

    def _worker_removed(self, url: str) -> None:
        self.strategy.forget_worker(url)
        if self._upstream is not None:
            self._upstream.forget(url, [worker.url for worker in self.pool.all()])
        if self.kv_events is not None:
            self.kv_events.forget_worker(url)

    def _base_model(self, url: str) -> str | None:
        worker = self.pool.get(url)
        return worker.base_model if worker is not None else None

    def eligible(self, model: str | None) -> list[Worker]:
        """The workers that may take a request for `model` now; the right error when there are none."""
        workers = self.pool.eligible(model)
        if not workers:
            raise self.pool.unavailable(model)
        return workers

    async def route_request(self, api: ApiRequest, workers: Sequence[Worker], headers: Mapping[str, str],
                            raw: bytes | None = None) -> RouteRequest:
        """What the strategy sees of a request, built once: its prompt's keys when the strategy reads them (`raw`:
        the body as received). A LoRA adapter's prompt is tokenized by its base model's tokenizer and keyed under
        the adapter's name; an alias of a base model under the first name its workers serve it as."""
        model = api.model or ""
        if isinstance(api.prompt, LargePrompt):  # routed by load alone; its prefill counted by its size
            self.metrics.oversized_prompts.inc()
            return RouteRequest(model, api.path, headers, prompt_tokens=api.prompt.size // CHARS_PER_TOKEN,
                                stream=api.stream, max_tokens=api.max_tokens)
        if self.prompts is None or api.prompt is None:
            return RouteRequest(model, api.path, headers, stream=api.stream, max_tokens=api.max_tokens)
        base, lora = workers[0].key_names(model) if workers else (model, None)  # every eligible worker lists it
        found = await self.prompts.keys(api.prompt, base, lora=lora, raw=raw, alone=self.admission.requests <= 1)
        return RouteRequest(model, api.path, headers, found.token_ids, found.block_keys, found.prompt_tokens,
                            api.stream, api.max_tokens)

    @property
    def discovery(self) -> WorkerDiscovery | None:
        return self._discovery

    def _recorder(self) -> TraceRecorder:
        cfg = self.config
        secret = cfg.record_trace_secret.encode()
        if not secret:
            secret = os.urandom(32)
            log.info("record_trace: no record_trace_secret, block ids are hashed under a random key of this process "
                     "(ids are renumbered per file either way; set KVGATE_RECORD_TRACE_SECRET for one key per "
                     "deployment)")
        try:
            return TraceRecorder(cfg.record_trace, block_size=cfg.block_size,
                                 block_tokens=cfg.record_trace_block_tokens, secret=secret,
                                 max_bytes=cfg.record_trace_max_bytes, max_age_s=cfg.record_trace_max_age_s,
                                 registry=self.metrics.registry)
        except OSError as exc:
            raise ConfigError(f"record_trace: cannot write {cfg.record_trace}: {exc.strerror or exc}") from None

    def trace_entry(self, arrived: float) -> AbstractContextManager[TraceEntry | None]:
        """The request's entry in the trace from its arrival to its end (None when the traffic is not recorded)."""
        if self.recorder is None:
            return nullcontext()
        return self.recorder.request(arrived, self.strategy.name)

    async def stop(self) -> None:
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)
        if self._discovery is not None:
            await self._discovery.stop()
        if self.prompts is not None:
            await self.prompts.aclose()
        if self._pool is not None:
            await self._pool.stop()
        if self._proxy is not None:
            self._proxy.close()
        if self.prefill_turns is not None:
            await self.prefill_turns.close()
        if self.sibling_routes is not None:
            await self.sibling_routes.close()
        if self._turn_broker is not None:
            await self._turn_broker.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self._upstream is not None:
            self._upstream.close()
        self.threads.close()


GATEWAY = web.AppKey("gateway", Gateway)


def _bearer(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def _key_matches(given: str, keys: list[str]) -> bool:
    # compare_digest against every key so the time taken does not reveal which prefix matched
    return bool(given) and any([hmac.compare_digest(given.encode(), k.encode()) for k in keys])


def _check_header_bytes(request: web.Request, tenant_header: str) -> None:
    """The headers the gateway reads or passes on must be ASCII: their bytes become keys and upstream requests."""
    # the bytes as received, one pass: when all are ASCII, so is every decoded value (the common case; a lookup
    # per header name costs three times as much); otherwise the headers the gateway reads, one by one
    for _, raw in request.raw_headers:
        if not raw.isascii():
            break
    else:
        return
    headers = request.headers
    for name in _CHECKED_HEADERS:
        value = headers.get(name)
        if value is not None and not value.isascii():
            raise bad_request(f"header {name} holds bytes that are not ASCII", "invalid_header")
    if tenant_header:
        value = headers.get(tenant_header)
        if value is not None and not value.isascii():
            raise bad_request(f"header {tenant_header} holds bytes that are not ASCII", "invalid_header")


_CHECKED_HEADERS = (*FORWARDED_REQUEST_HEADERS, "Authorization", "Via")  # and the tenant header, if the gateway has one


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Authentication, and the one place where every failure becomes an OpenAI-style JSON error."""
    gateway = request.app[GATEWAY]
    cfg = gateway.config
    try:
        _check_header_bytes(request, cfg.tenant_header)
        via = request.headers.get("Via")
        if via is not None and gateway.hop in via:
            raise GatewayError(508, "the request came back to this gateway: is the gateway listed as one of its own "
                               "workers?", code="loop_detected")
        path = request.path
        if path not in OPEN_PATHS:
            # without an admin key, /admin/* takes the api keys only where allow_api_key_admin said so (the
            # config refuses api keys without either), and is open only when the whole gateway is
            keys = ([cfg.admin_key] if cfg.admin_key else cfg.api_key) if path.startswith("/admin") else cfg.api_key
            if keys and not _key_matches(_bearer(request), keys):
                raise GatewayError(401, "invalid or missing API key", type="authentication_error",
                                   code="invalid_api_key")
        return await handler(request)
    except GatewayError as exc:
        gateway.metrics.rejected.labels(str(exc.status), exc.code or "").inc()
        return exc.response()
    except web.HTTPException as exc:
        if exc.status == 413:
            message = f"request body exceeds the limit of {cfg.max_body_bytes} bytes"
            code = "body_too_large"
        else:
            message, code = exc.reason, exc.reason.lower().replace(" ", "_")
        gateway.metrics.rejected.labels(str(exc.status), code).inc()
        return error_response(exc.status, message, type="invalid_request_error", code=code,
                              headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"})
    except Exception:
        log.exception("unexpected error while handling %s %s", request.method, request.path)
        gateway.metrics.rejected.labels("500", "internal_error").inc()
        return error_response(500, "internal gateway error", type="internal_error", code="internal_error")


def _admit(request: web.Request) -> Admitted:
    """A slot in the gateway's in-flight caps for a request to proxy (a body over the limit is a 413 first)."""
    gateway = request.app[GATEWAY]
    return gateway.admission.admit(_check_declared_size(request, gateway.config.max_body_bytes) or 0)


def _too_large(limit: int) -> GatewayError:
    # the limit of the endpoint read (an admin request's is 64 KiB), not max_body_bytes: the 413 named that one
    return GatewayError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")


def _check_declared_size(request: web.Request, limit: int) -> int | None:
    """The declared Content-Length (None without one), a 413 over `limit`. (aiohttp parses the header again on
    every read of `content_length`.)"""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit)
    return declared


async def _read_body(request: web.Request, limit: int, admitted: Admitted | None = None) -> bytes:
    """The whole body within `body_timeout_s`; at most `limit` bytes (413), each counted as it arrives."""
    _check_declared_size(request, limit)
    if not request.body_exists:
        # aiohttp's empty payload is one object shared by every request, and its iter_chunks() ends only the first
        # time it is used: iterated again, it yields b"" forever without waiting, freezing the event loop
        return b""
    content = request.content
    if content.is_eof():  # all of it arrived with the headers (as small bodies do): nothing to wait for or time
        data = content.read_nowait()
        if len(data) > limit:
            raise _too_large(limit)
        if admitted is not None:
            admitted.hold(len(data))
        return data
    seconds = request.app[GATEWAY].config.body_timeout_s
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(seconds):
            # the pieces as they arrived (iter_any would join the buffered ones into a new bytes each time)
            async for chunk, _ in content.iter_chunks():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                if admitted is not None:
                    admitted.hold(size)
                chunks.append(chunk)
    except TimeoutError:
        raise GatewayError(408, f"request body not received within {seconds:g} s", code="body_timeout") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def generate(request: web.Request) -> web.StreamResponse:
    """`/v1/completions` and `/v1/chat/completions`: admit, validate, route, proxy."""
    started = time.perf_counter()
    gateway = request.app[GATEWAY]
    cfg = gateway.config
    with gateway.trace_entry(started) as entry, _admit(request) as admitted:
        body = await _read_body(request, cfg.max_body_bytes, admitted)
        tenant = request.headers.get(cfg.tenant_header) or None if cfg.tenant_header else None
        body, api = await _off_the_loop_if_large(gateway.threads, body, _read_generation, request.path, body, cfg,
                                                 tenant)
        route = await gateway.route_request(api, gateway.eligible(api.model), request.headers, body)
        if entry is not None:
            entry.routed(route, api.prompt.cache_salt if api.prompt is not None else None)
        return await gateway.proxy.forward(request, route, body, stream=api.stream, started=started,
                                           outcome=entry.outcome if entry is not None else None)


GC_YOUNG_THRESHOLD = 2000  # allocations between young collections in a serving process (Python's default: 700)
PARSE_INLINE_BYTES = 64 * 1024  # bodies larger than this are parsed in a thread


async def _off_the_loop_if_large(threads: WorkerThreads, body: bytes, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on the event loop for a small body, else in the gateway's threads: parsing a large one (and
    checking its prompt's tokens) would stall every other request meanwhile. (Not `asyncio.to_thread`: its pool
    starts a thread on the loop when none is idle, which holds every request until the OS runs it.)"""
    if len(body) <= PARSE_INLINE_BYTES:
        return work(*args)
    return await threads.run(work, *args)


def _read_generation(path: str, body: bytes, cfg: GatewayConfig, tenant: str | None) -> tuple[bytes, ApiRequest]:
    """A generation request's body read (its prompt not decoded when over `route_max_prompt_bytes`), with the
    tenant's cache_salt set when the gateway names tenants."""
    api = parse_body(path, body, model_required=True, large=cfg.route_max_prompt_bytes)
    if cfg.tenant_header:
        return with_tenant(body, api, tenant)
    return body, api


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other `/v1/*`, `/tokenize`, `/detokenize`: sent to a worker that serves the body's `model`."""
    if request.path in (COMPLETIONS, CHAT_COMPLETIONS, "/v1/models"):
        allowed = "GET" if request.path == "/v1/models" else "POST"
        raise web.HTTPMethodNotAllowed(request.method, [allowed])
    if not DOT_SEGMENTS.isdisjoint(request.path.split("/")):
        # the route matched the path as written, and the worker is sent it so: one that resolves `..` (or its
        # %2e%2e) would serve what no /v1/ route here lets through, `/v1/../sleep` or `/v1/./completions` unsalted
        raise bad_request("a path with `.` or `..` segments is not passed on", "invalid_path")
    started = time.perf_counter()
    gateway = request.app[GATEWAY]
    with _admit(request) as admitted:
        body: bytes | None = None
        api = ApiRequest(request.path, None, False)
        if request.method in ("POST", "PUT", "PATCH"):
            body = await _read_body(request, gateway.config.max_body_bytes, admitted)
            api = await _off_the_loop_if_large(gateway.threads, body, functools.partial(
                parse_body, model_required=False, large=gateway.config.route_max_prompt_bytes), request.path, body)
            if api.model is not None:
                gateway.eligible(api.model)
        route = RouteRequest(api.model or "", api.path, request.headers, stream=api.stream)
        return await gateway.proxy.forward(request, route, body, stream=api.stream, started=started)


async def list_models(request: web.Request) -> web.Response:
    return web.Response(body=request.app[GATEWAY].pool.models_listing(), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    healthy = request.app[GATEWAY].pool.healthy()
    if not healthy:
        raise no_worker("no healthy worker")
    return web.json_response({"status": "ready", "healthy_workers": len(healthy)})


async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    body = generate_latest(gateway.metrics.registry)
    if gateway.process is not None:  # every process's, each sample labelled with its process
        body = await gateway.process.sibling_metrics(body)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _fixed_pool(gateway: Gateway) -> None:
    if gateway.process is not None:
        raise GatewayError(409, f"the gateway runs as {gateway.process.count} processes, each with its own pool: "
                           "workers are added and removed with --worker or discovery", code="pool_is_fixed")


async def admin_list_workers(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    return web.json_response(
        {"strategy": gateway.strategy.name, "workers": [w.describe() for w in gateway.pool.all()]}, dumps=_dumps
    )


def _worker_spec(payload: dict[str, Any]) -> WorkerSpec:
    try:
        if isinstance(payload.get("worker"), str):
            return WorkerSpec.parse(payload["worker"])
        return WorkerSpec.from_yaml(payload)
    except ConfigError as exc:
        raise bad_request(str(exc), "invalid_worker") from None


async def admin_add_worker(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    _fixed_pool(gateway)
    spec = _worker_spec(parse_json_object(await _read_body(request, 64 * 1024)))
    try:
        worker = gateway.pool.add(spec)
    except KeyError:
        raise GatewayError(409, f"worker {spec.url} is already in the pool", code="worker_exists") from None
    except PoolFull as exc:
        raise GatewayError(409, str(exc), code="pool_full") from None
    # the new worker only: every worker's probe made each add wait for the slowest one (a hung worker's /health:
    # health_timeout_s) and thousands of adds cost the fleet a probe each
    await gateway.pool.probe([worker])
    return web.json_response(worker.describe(), status=201, dumps=_dumps)


async def admin_remove_worker(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    _fixed_pool(gateway)
    url = request.query.get("url")
    if url is None:
        url = _worker_spec(parse_json_object(await _read_body(request, 64 * 1024))).url
    try:
        worker = gateway.pool.remove(url)
    except KeyError:
        raise GatewayError(404, f"no worker {url} in the pool", type="NotFoundError",
                           code="worker_not_found") from None
    return web.json_response({"url": worker.url, "draining": worker.in_flight}, status=202, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def create_app(config: GatewayConfig, strategy: Strategy, process: GatewayProcess | None = None) -> web.Application:
    """Build the gateway application around `strategy` (one per app); its workers are probed when the app starts.
    `process`: which of several gateway processes on one port this app is (router/processes.py)."""
    # The body limit is enforced by _read_body with a JSON 413; aiohttp's own limit sits just above it.
    app = web.Application(middlewares=[edge_middleware], client_max_size=config.max_body_bytes + 1)
    gateway = Gateway(config, strategy, process)
    app[GATEWAY] = gateway

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post(COMPLETIONS, generate)
    app.router.add_post(CHAT_COMPLETIONS, generate)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/workers", admin_list_workers)
    app.router.add_post("/admin/workers", admin_add_worker)
    app.router.add_delete("/admin/workers", admin_remove_worker)
    for path in ("/tokenize", "/detokenize"):
        app.router.add_post(path, passthrough)
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
        app.router.add_route(method, "/v1/{tail:.*}", passthrough)
    return app


async def run_gateway(config: GatewayConfig, strategy: Strategy, process: GatewayProcess | None = None) -> None:
    """Serve until cancelled; client disconnects cancel their handler so upstream requests end at once. `process`:
    this is one of several gateway processes sharing the port."""
    files = raise_open_file_limit()
    app = create_app(config, strategy, process)
    async with serving(app, config, app[GATEWAY].metrics, reuse_port=process is not None) as connections, \
            _own_metrics(app[GATEWAY], process):
        log.info("kvgate listening on http://%s:%d (strategy %s, %d workers; at most %d client connections, "
                 "open-file limit %d%s)", config.host, config.port, config.strategy, len(config.worker),
                 connections.limit, files, f"; process {process.index + 1} of {process.count}" if process else "")
        if not config.api_key and not config.admin_key:
            log.warning("no api_key and no admin_key: anyone who reaches port %d can add workers (/admin/*) and so "
                        "receive every prompt; set admin_key unless this port is private", config.port)
        # what start-up made (modules, the app, the strategy) lives as long as the process: out of the cycle
        # collector's sight, or each full collection walks it with the GIL held (60,000 objects, 30-150 ms)
        gc.freeze()
        # a young collection every 2,000 allocations, not 700: most of a request's objects are gone by then
        # (collector CPU at c64 about 35 -> 18 us per request, its longest pause the same, 3-4 ms)
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        await asyncio.Event().wait()


@asynccontextmanager
async def _own_metrics(gateway: Gateway, process: GatewayProcess | None) -> AsyncIterator[None]:
    """With several gateway processes, this one's own /metrics on its Unix socket, for the siblings to gather."""
    if process is None:
        yield
        return

    async def own(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(gateway.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", own)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.UnixSite(runner, process.metrics_socket(process.index)).start()
        yield
    finally:
        await runner.cleanup()
