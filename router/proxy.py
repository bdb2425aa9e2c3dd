"""Proxying one request to a worker: choose, send, retry before the first byte, relay the answer untouched.

Non-streaming answers are read whole before anything reaches the client, so a worker that dies mid-answer is
retried elsewhere. Streaming answers are relayed chunk by chunk as they arrive; the client's response starts
with the first upstream chunk, so a worker that fails before producing one is still retried. Nothing is
retried once a byte has reached the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import orjson
from aiohttp import web

from router.config import GatewayConfig
from router.deadlines import Deadlines
from router.errors import GatewayError
from router.kv_transport import cache_name
from router.metrics import GatewayMetrics
from router.pool import Worker, WorkerPool, describe_error
from router.prefill_turns import PrefillTurns, Turn, TurnKeeper, hold_seconds
from router.requests import CHAT_COMPLETIONS, COMPLETIONS
from router.routing import Decision, RouteRequest, Strategy
from router.sibling_routes import SiblingRoutes
from router.upstream import UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTooLarge

log = logging.getLogger(__name__)

# Request headers passed on to workers; everything else (Host, hop-by-hop, cookies) stays at the gateway.
FORWARDED_REQUEST_HEADERS = ("Content-Type", "Accept", "X-Request-Id", "traceparent", "tracestate")
# Response headers the gateway sets itself or that describe the hop, not the content (Proxy-Connection: RFC 9110
# 7.6.1 names it among those to remove, though no Connection header lists it).
DROPPED_RESPONSE_HEADERS = frozenset(
    h.lower() for h in (
        "Connection", "Keep-Alive", "Transfer-Encoding", "Content-Length", "Date", "Server",
        "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection", "TE", "Trailer", "Upgrade",
    )
)
RETRYABLE_STATUSES = frozenset({502, 503})
CLIENT_CLOSED = "499"


# which rank of a data-parallel engine serves a request (vLLM 0.32 reads it in OpenAIServing._get_data_parallel_rank)
DP_RANK_HEADER = "X-data-parallel-rank"
# with predicted_ttft_header: the strategy's predicted time to first token of the answer, in ms
PREDICTED_TTFT_HEADER = "X-Kvgate-Predicted-Ttft-Ms"
# (a worker's cache, a request's block keys, cached tokens its answer reported): what the KV index learns from answers
Learn = Callable[[str, Sequence[int], int], None]


@dataclass(slots=True)
class Outcome:
    """What became of a forwarded request, for whoever records it (the trace): the last decision, the status
    relayed, first and last byte (seconds from arrival), and what the answer reported."""

    decision: Decision | None = None
    status: int | None = None
    ttfb_s: float | None = None
    duration_s: float | None = None
    usage: Usage | None = None
    output_tokens: int = 0  # the answer's completion_tokens, else (a stream) its data events but [DONE]

    def answered(self, status: int, ttfb_s: float, duration_s: float, usage: Usage | None, events: int = 0) -> None:
        self.status, self.ttfb_s, self.duration_s, self.usage = status, ttfb_s, duration_s, usage
        self.output_tokens = usage.completion if usage is not None and usage.completion is not None else events


class _Retry(Exception):
    """This attempt failed before any byte reached the client; another worker may take the request."""


@dataclass(slots=True)
class _OpenStream:
    """A streamed answer whose first chunk has arrived: everything needed to relay the rest."""

    upstream: UpstreamResponse
    route: RouteRequest
    decision: Decision
    chunks: AsyncIterator[bytes]
    first: bytes
    headers: list[tuple[str, str]]
    worker: Worker
    model_label: str
    must_end_with_done: bool  # an OpenAI completions stream: complete only with its final `data: [DONE]`


class Proxy:
    """Sends requests to workers chosen by the strategy and relays their answers."""

    def __init__(
        self,
        config: GatewayConfig,
        pool: WorkerPool,
        strategy: Strategy,
        metrics: GatewayMetrics,
        upstream: UpstreamPool,
        learn: Learn | None = None,
        *,
        hop: str = "kvgate",
        turns: TurnKeeper | None = None,
        siblings: SiblingRoutes | None = None,
    ) -> None:
        self._config = config
        self._hop = f"1.1 {hop}"  # this gateway's entry in the `Via` of what it sends (RFC 9110 7.6.3)
        self._pool = pool
        self._strategy = strategy
        self._metrics = metrics
        self._upstream = upstream
        self._learn = learn
        self.deadlines = Deadlines()  # the requests' timeouts, without an event-loop timer each
        # long prefills a worker is sent one at a time (Decision.serialize_prefill): this process's turns, or, with
        # several processes, the whole gateway's (router/turn_broker.py)
        self.prefill_turns: TurnKeeper = turns if turns is not None else PrefillTurns()
        self._siblings = siblings  # several processes: each request's placement told to the others

    def close(self) -> None:
        self.deadlines.close()

    async def _take_turn(self, decision: Decision, stream: bool) -> Turn:
        """The chosen engine's turn for a long prefill (a data-parallel rank's own), once its long prefill before
        has its first token (or has had its hold: `hold_seconds`)."""
        waited = time.perf_counter()
        engine = cache_name(decision.worker.url, decision.dp_rank)
        turn = await self.prefill_turns.take(engine, hold_seconds(decision.predicted_ttft_s, stream))
        self._metrics.prefill_holds.observe(time.perf_counter() - waited)
        return turn

    async def forward(
        self, request: web.Request, route: RouteRequest, body: bytes | None, *, stream: bool, started: float,
        outcome: Outcome | None = None,
    ) -> web.StreamResponse:
        """Route and proxy one request; raises GatewayError for answers the gateway gives itself. `outcome`, if
        given, is filled in with what became of it."""
        tried: set[str] = set()
        last_error = ""
        deadline = asyncio.get_running_loop().time() + self._config.total_timeout_s
        for _ in range(self._config.max_attempts):
            candidates = self._pool.eligible(route.model, exclude=tried)
            if not candidates:
                break
            decision = self._strategy.choose(route, candidates)
            if self._siblings is not None and decision.placement is not None:
                self._siblings.routed(id(route), decision.placement)
            worker = decision.worker
            tried.add(worker.spec.url)
            if outcome is not None:
                outcome.decision = decision
            self._metrics.decisions.labels(self._strategy.name, decision.reason).inc()
            self._pool.acquire(worker)
            try:
                try:
                    with self.deadlines.at(deadline):
                        turn = await self._take_turn(decision, stream) if decision.serialize_prefill else None
                        try:
                            answer = await self._attempt(request, route, decision, body, stream, started, outcome)
                        finally:  # its first chunk came (or all of it, or nothing will): the next may go
                            if turn is not None:
                                self.prefill_turns.release(turn)
                except TimeoutError:
                    self._metrics.requests.labels(route.model or "", worker.url, "504").inc()
                    raise GatewayError(
                        504, f"upstream did not answer within {self._config.total_timeout_s:g} s",
                        type="timeout", code="upstream_timeout",
                    ) from None
                except asyncio.CancelledError:  # the client left (the deadline's own became a TimeoutError)
                    self._metrics.requests.labels(route.model or "", worker.url, CLIENT_CLOSED).inc()
                    raise
                if isinstance(answer, _OpenStream):
                    return await self._relay(request, answer, started, deadline, outcome)
                return answer
            except _Retry as exc:
                last_error = str(exc)
            finally:
                self._pool.release(worker)
                self._strategy.on_finished(route, decision)
                if self._siblings is not None:
                    self._siblings.ended(id(route))
        if not tried:
            raise self._pool.unavailable(route.model)
        raise GatewayError(
            502, f"upstream failed after {len(tried)} attempt(s); last: {last_error}",
            type="upstream_error", code="upstream_failed",
        )

    def _upstream_headers(self, request: web.Request, decision: Decision) -> list[tuple[str, str]]:
        worker = decision.worker
        headers = [(name, value) for name in FORWARDED_REQUEST_HEADERS if (value := request.headers.get(name))]
        via = request.headers.get("Via")
        headers.append(("Via", f"{via}, {self._hop}" if via else self._hop))  # a loop through gateways is seen
        if decision.dp_rank is not None:
            headers.append((DP_RANK_HEADER, str(decision.dp_rank)))
        if self._config.upstream_api_key:
            headers.append(("Authorization", f"Bearer {self._config.upstream_api_key}"))
        elif worker.configured and "Authorization" in request.headers:
            # a worker added at run time may be anyone's listener: it never sees a client's key
            headers.append(("Authorization", request.headers["Authorization"]))
        return headers

    def _count_usage(self, route: RouteRequest, decision: Decision, usage: Usage | None) -> None:
        """Predicted against reported cached tokens, when the engine reports them (`--enable-prompt-tokens-details`):
        per strategy, and per worker (the index's drift); the KV block index learns from it."""
        if usage is None:
            return
        prompt, cached = usage.prompt, usage.cached
        name, worker = self._strategy.name, decision.worker.url
        predicted = min(decision.predicted_cached_tokens, prompt)
        self._metrics.actual_cached_tokens.labels(name).inc(cached)
        self._metrics.usage_prompt_tokens.labels(name).inc(prompt)
        self._metrics.usage_predicted_tokens.labels(name).inc(predicted)
        self._metrics.worker_reported_cached_tokens.labels(worker).inc(cached)
        self._metrics.worker_predicted_cached_tokens.labels(worker).inc(predicted)
        if self._learn is not None and route.token_ids is not None:  # text-mode keys are no engine's blocks
            self._learn(cache_name(worker, decision.dp_rank), route.block_keys, cached)

    def _connection_lost(self, worker: Worker, exc: BaseException) -> _Retry:
        self._pool.report_connection_error(worker, describe_error(exc))
        self._metrics.retries.labels("connection_error").inc()
        log.warning("request to %s failed: %s", worker.url, describe_error(exc))
        # the client is told what happened, never where: worker addresses stay inside the gateway
        reached = not isinstance(exc, UpstreamConnectError)
        return _Retry("the worker broke the connection" if reached else "the worker could not be reached")

    def _timeout(self, worker: Worker, model_label: str, what: str, seconds: float) -> GatewayError:
        worker.last_error = f"{what} after {seconds:g} s"
        self._metrics.requests.labels(model_label, worker.url, "504").inc()
        return GatewayError(504, f"worker {what} within {seconds:g} s", type="timeout", code="upstream_timeout")

    async def _attempt(
        self,
        request: web.Request,
        route: RouteRequest,
        decision: Decision,
        body: bytes | None,
        stream: bool,
        started: float,
        outcome: Outcome | None,
    ) -> web.Response | _OpenStream:
        """One try on one worker: a whole answer, or a stream whose first chunk has arrived."""
        cfg = self._config
        worker = decision.worker
        model_label = route.model or ""
        # a streamed answer's headers come at once; a whole answer's only when the generation is done
        headers_timeout = cfg.ttfb_timeout_s if stream else cfg.response_timeout_s
        try:
            with self.deadlines.after(headers_timeout):
                upstream = await self._upstream.request(
                    request.method, worker.spec.url + request.rel_url.raw_path_qs,
                    self._upstream_headers(request, decision), body, read_timeout=cfg.read_timeout_s,
                )
        except TimeoutError:
            raise self._timeout(worker, model_label, "did not answer", headers_timeout) from None
        except UpstreamError as exc:
            raise self._connection_lost(worker, exc) from None
        self._strategy.on_routed(route, decision)
        handed_over = False
        try:
            if upstream.status in RETRYABLE_STATUSES:
                worker.last_error = f"answered {upstream.status}"
                self._metrics.requests.labels(model_label, worker.url, str(upstream.status)).inc()
                self._metrics.retries.labels(f"status_{upstream.status}").inc()
                raise _Retry(f"the worker answered {upstream.status}")
            headers = end_to_end(upstream.headers)
            if cfg.predicted_ttft_header and decision.predicted_ttft_s is not None:
                headers.append((PREDICTED_TTFT_HEADER, f"{decision.predicted_ttft_s * 1e3:.3f}"))
            try:
                if stream and upstream.status == 200:
                    chunks = upstream.chunks()
                    first = await anext(chunks, b"")
                    handed_over = True
                    done = route.path in (COMPLETIONS, CHAT_COMPLETIONS) and _is_event_stream(upstream.headers)
                    return _OpenStream(upstream, route, decision, chunks, first, headers, worker, model_label, done)
                data = await upstream.read(cfg.max_response_bytes)
            except UpstreamTooLarge as exc:  # the worker did its job: no retry elsewhere, nothing to eject it for
                self._metrics.requests.labels(model_label, worker.url, "502").inc()
                raise GatewayError(502, str(exc), type="upstream_error", code="upstream_response_too_large") from None
            except UpstreamError as exc:
                raise self._connection_lost(worker, exc) from None
            except TimeoutError:
                raise self._timeout(worker, model_label, "went silent", cfg.read_timeout_s) from None
            elapsed = time.perf_counter() - started
            self._metrics.ttfb.labels(model_label).observe(elapsed)
            self._metrics.request_duration.labels(model_label).observe(elapsed)
            self._metrics.requests.labels(model_label, worker.spec.url, str(upstream.status)).inc()
            usage = answer_usage(data)
            if usage is not None:
                self._count_usage(route, decision, usage)
            if outcome is not None:
                outcome.answered(upstream.status, elapsed, elapsed, usage)
            return web.Response(status=upstream.status, body=data, headers=headers)
        finally:
            if not handed_over:
                upstream.close()

    async def _relay(
        self, request: web.Request, stream: _OpenStream, started: float, deadline: float, outcome: Outcome | None
    ) -> web.StreamResponse:
        """Relay a streamed answer byte for byte. Once bytes reached the client, a failure can only be told by
        closing the connection without the final chunk, so the client sees a broken stream, not a short one."""
        upstream, worker, label = stream.upstream, stream.worker, stream.model_label
        ttfb = time.perf_counter() - started
        self._metrics.ttfb.labels(label).observe(ttfb)
        strategy, route, decision = self._strategy, stream.route, stream.decision
        strategy.on_first_token(route, decision, ttfb)
        if self._siblings is not None:
            self._siblings.first_token(id(route))
        seen = SseWatch()
        if stream.first:
            strategy.on_chunk(route, decision, True, seen.feed(stream.first))
        response = web.StreamResponse(status=upstream.status, headers=stream.headers)
        status = str(upstream.status)
        delivered = False  # the client was sent the stream's final `data: [DONE]`: closing after it is no 499
        try:
            with self.deadlines.at(deadline):
                await response.prepare(request)
                # Chunks go to the client's transport framed here, one write each, while the client keeps up
                # (nothing of it buffered) on a chunked answer whose head aiohttp has sent (with the first chunk
                # it writes): an event through aiohttp's writer took 1.8 us more (two coroutines, three pieces
                # joined). Else through aiohttp's writer, which waits for a slow client.
                transport = request.transport
                chunked = response.headers.get("Transfer-Encoding") == "chunked" and not response.compression
                direct = False
                if stream.first:
                    await response.write(stream.first)
                    delivered = seen.ended_with_done
                    direct = chunked
                async for chunk in stream.chunks:
                    # as it arrived (the worker's step timing), with the tokens it carries: a loaded gateway reads
                    # several events in one chunk
                    strategy.on_chunk(route, decision, False, seen.feed(chunk))
                    if not chunk:
                        pass
                    elif (direct and transport is not None and not transport.get_write_buffer_size()
                            and not transport.is_closing()):
                        transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    else:
                        await response.write(chunk)
                        direct = chunked
                    delivered = seen.ended_with_done
                if stream.must_end_with_done and not seen.ended_with_done:
                    # the worker ended its answer cleanly at the HTTP level but mid-stream (it crashed, or
                    # something between cut it): relaying the end would pass a short answer off as complete
                    raise UpstreamError("the stream ended without its final `data: [DONE]`")
                await response.write_eof()
        except ConnectionResetError:
            status = status if delivered else CLIENT_CLOSED
        except asyncio.CancelledError:
            status = status if delivered else CLIENT_CLOSED
            raise
        except (UpstreamError, TimeoutError) as exc:
            worker.last_error = f"stream broke: {describe_error(exc)}"
            log.warning("stream from %s broke after its first byte: %s", worker.url, describe_error(exc))
            status = "502"
            if request.transport is not None:
                request.transport.close()
        finally:
            upstream.close()
            duration = time.perf_counter() - started
            self._metrics.requests.labels(label, worker.url, status).inc()
            self._metrics.request_duration.labels(label).observe(duration)
            self._count_usage(stream.route, stream.decision, seen.usage)
            if outcome is not None:
                outcome.answered(int(status), ttfb, duration, seen.usage, max(0, seen.events - 1))
        return response


CACHED_TOKENS = b'"cached_tokens"'
SSE_DONE = (b"data: [DONE]", b"data:[DONE]")  # the last event of an OpenAI stream


class SseWatch:
    """What a relayed SSE answer said, whatever its chunk boundaries: its `usage` (the last one: vLLM's
    continuous_usage_stats repeats it in every event) and whether its last event so far is `data: [DONE]`."""

    MAX_LINE = 1 << 20  # a longer unfinished line is not kept: it cannot be the usage event

    __slots__ = ("_last", "_line", "ended_with_done", "events", "usage")

    def __init__(self) -> None:
        self._line = b""  # the unfinished last line
        self._last = b""  # the last finished non-blank line, stripped
        self.usage: Usage | None = None
        self.events = 0  # `data:` events relayed, `[DONE]` included
        self.ended_with_done = False  # the last event so far is `data: [DONE]`

    def feed(self, chunk: bytes) -> int:
        """Take the next chunk; the `data:` events it completed, a final `[DONE]` not counted (each a step's
        tokens of this answer: one, more with speculative decoding). Called for every chunk relayed."""
        data = self._line + chunk if self._line else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._line = data if len(data) <= self.MAX_LINE else b""
            self.ended_with_done = (self._line.strip() or self._last) in SSE_DONE
            return 0
        if cut == len(data) - 1:  # whole lines (the usual chunk: whole events): read as they are, no copy
            lines = data
            self._line = b""
        else:
            lines, line = data[:cut], data[cut + 1:]
            self._line = line if len(line) <= self.MAX_LINE else b""
        events = lines.count(b"\ndata:") + lines.startswith(b"data:")  # not a "data:" inside a generated text
        self.events += events
        if CACHED_TOKENS in lines:
            self.usage = answer_usage(lines) or self.usage
        finished = lines.rstrip()
        if finished:
            self._last = finished[finished.rfind(b"\n") + 1:].strip()
        if events and self._last in SSE_DONE:  # the stream's last event, so among these lines
            events -= 1
        rest = self._line
        self.ended_with_done = ((rest.strip() or self._last) if rest else self._last) in SSE_DONE
        return events


def end_to_end(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """A worker's response headers that describe the answer: not the hop-by-hop ones, nor those its `Connection`
    header names (RFC 9110 7.6.1: they describe its connection to the gateway)."""
    kept: list[tuple[str, str]] = []
    named = ""  # the `Connection` headers' values
    for header in headers:  # one pass, each name lowered once, the pairs kept as they came
        name = header[0].lower()
        if name not in DROPPED_RESPONSE_HEADERS:
            kept.append(header)
        elif name == "connection":
            named = f"{named},{header[1]}" if named else header[1]
    if named:  # nginx's `Connection: keep-alive` names only a hop-by-hop header: no second pass for it
        extra = {part.strip() for part in named.lower().split(",")} - DROPPED_RESPONSE_HEADERS
        if extra:
            return [header for header in kept if header[0].lower() not in extra]
    return kept


def _is_event_stream(headers: Sequence[tuple[str, str]]) -> bool:
    return any(k.lower() == "content-type" and v.lower().startswith("text/event-stream") for k, v in headers)


class Usage(NamedTuple):
    """What an answer's `usage` reports: prompt tokens, of them cached (with `--enable-prompt-tokens-details`),
    and generated tokens."""

    prompt: int
    cached: int
    completion: int | None


def answer_usage(data: bytes) -> Usage | None:
    """An answer's `usage` — a JSON body or SSE events — if it reports cached tokens."""
    if CACHED_TOKENS not in data:
        return None
    if data.lstrip()[:1] == b"{":
        documents = [data]
    else:
        documents = [line[5:] for line in data.split(b"\n") if line.startswith(b"data:") and CACHED_TOKENS in line]
    for document in reversed(documents):  # the last usage: with continuous usage stats every event has one
        try:
            usage = orjson.loads(document).get("usage")
            prompt = _token_count(usage["prompt_tokens"])
            cached = _token_count((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
            completion = _token_count(usage.get("completion_tokens"))
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
            continue
        if prompt is not None and cached is not None and cached <= prompt:  # else no engine's figures: not counted
            return Usage(prompt, cached, completion)
    return None


def _token_count(value: object) -> int | None:
    """A count of tokens as an answer reports it: a non-negative integer (JSON's `true` is none)."""
    return value if type(value) is int and value >= 0 else None
