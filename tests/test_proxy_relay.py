"""The proxy past the first byte and its header handling: what a client's request carries to a worker, what a
worker's answer carries back, and what a worker that goes quiet mid-answer does to the client and the gateway.
Real gateway, raw-socket workers on loopback that record what they were sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web

from bench.procs import free_port
from router.proxy import end_to_end
from tests.abuse_servers import MODELS, raw_worker
from tests.conftest import eventually, running_gateway

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
CHUNK = b'data: {"choices": [{"index": 0, "text": " t0"}]}\n\n'
BODY = b'{"choices": [{"index": 0, "text": "hi"}]}'


def answering(reply: bytes, then: Callable[[asyncio.StreamWriter], Awaitable[None]] | None = None,
              ) -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
    """A worker's answer to a generation request: `reply`, then whatever `then` does."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(reply)
        await writer.drain()
        if then is not None:
            await then(writer)

    return answer


def _reply(status: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return f"HTTP/1.1 {status}\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def _metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as resp:
        return await resp.text()


# --- headers ------------------------------------------------------------------------------------------------------


async def test_hop_by_hop_response_headers_stay_at_the_gateway_end_to_end_ones_pass(
        http: aiohttp.ClientSession) -> None:
    """RFC 9110 7.6.1: the hop-by-hop headers, and any header the worker's `Connection` names, describe its
    connection to the gateway, not the answer; the rest (request ids, timing, repeated headers) reaches the client."""
    reply = _reply("200 OK", [
        ("Content-Type", "application/json"), ("Connection", "keep-alive, X-Worker-Hop"), ("X-Worker-Hop", "secret"),
        ("Keep-Alive", "timeout=5"), ("Proxy-Authenticate", "Basic"), ("Upgrade", "h2c"), ("Server", "worker/1.0"),
        ("Proxy-Connection", "keep-alive"), ("TE", "trailers"), ("Trailer", "X-Checksum"),
        ("X-Request-Id", "req-42"), ("openai-processing-ms", "12"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"),
    ], BODY)
    async with (raw_worker(answering(reply)) as worker, running_gateway([worker]) as gw,
                http.post(gw.url + "/v1/completions", json=COMPLETION) as resp):
        assert resp.status == 200 and await resp.read() == BODY
        names = {k.lower() for k in resp.headers}
        assert resp.headers["X-Request-Id"] == "req-42" and resp.headers["openai-processing-ms"] == "12"
        assert resp.headers.getall("Set-Cookie") == ["a=1", "b=2"]
        assert resp.headers["Content-Length"] == str(len(BODY))
        for hop in ("x-worker-hop", "keep-alive", "proxy-authenticate", "upgrade", "proxy-connection", "te", "trailer"):
            assert hop not in names, hop
        assert resp.headers.get("Server", "") != "worker/1.0"


def test_every_connection_header_names_what_stays_at_the_gateway() -> None:
    """Names in any of several `Connection` headers, in any case, are dropped wherever they stand; a worker's
    `Connection: keep-alive` alone drops only the hop-by-hop headers, and the kept pairs keep their order."""
    headers = [("x-early", "1"), ("Connection", "Keep-Alive, X-Early"), ("Content-Type", "application/json"),
               ("X-Late", "2"), ("connection", " x-late ,"), ("X-Request-Id", "r"), ("Date", "today")]
    assert end_to_end(headers) == [("Content-Type", "application/json"), ("X-Request-Id", "r")]
    assert end_to_end([("Server", "nginx"), ("Content-Type", "text/plain"), ("Connection", "keep-alive"),
                       ("X-A", "1"), ("X-A", "2")]) == [("Content-Type", "text/plain"), ("X-A", "1"), ("X-A", "2")]


async def test_only_end_to_end_request_headers_reach_the_worker(http: aiohttp.ClientSession) -> None:
    """Cookies, proxy credentials, the client's own hop-by-hop headers and a client's choice of data-parallel rank
    stay at the gateway; request ids and trace context reach the worker, whose Host is its own."""
    heads: list[bytes] = []

    reply = _reply("200 OK", [("Content-Type", "application/json")], BODY)
    async with raw_worker(answering(reply), heads=heads) as worker, running_gateway([worker]) as gw:
        sent = {"Cookie": "session=abc", "Proxy-Authorization": "Basic eA==", "X-Client-Hop": "x",
                "Connection": "keep-alive, X-Client-Hop", "X-data-parallel-rank": "3", "X-Request-Id": "req-7",
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        async with http.post(gw.url + "/v1/completions", json=COMPLETION, headers=sent) as resp:
            assert resp.status == 200
    generation = [h for h in heads if h.startswith(b"POST ")]
    assert len(generation) == 1
    lines = generation[0].decode().split("\r\n")
    got = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    assert got["host"] == worker.removeprefix("http://")
    assert got["x-request-id"] == "req-7" and got["traceparent"] == sent["traceparent"]
    for private in ("cookie", "proxy-authorization", "x-client-hop", "x-data-parallel-rank"):
        assert private not in got, private


@pytest.mark.parametrize("path", [b"/v1/../sleep?level=1", b"/v1/%2e%2e/reset_prefix_cache",
                                  b"/v1/models/..%2F..%2Fcollective_rpc", b"/v1/./completions"])
async def test_a_path_with_dot_segments_is_refused_not_passed_on(path: bytes) -> None:
    """The passthrough matched `/v1/{tail}` on the path as written and sent it to the worker as written: a worker
    (or anything before it) that resolves `..` would serve its own non-/v1 endpoints (`/sleep`, `/collective_rpc`),
    and `/v1/./completions` skip the gateway's generation path (its tenant's cache_salt). nginx resolves dot
    segments before it routes; here they are a 400, and the worker sees nothing."""
    heads: list[bytes] = []
    async with raw_worker(answering(_reply("200 OK", [], b"{}")), heads=heads) as worker, \
            running_gateway([worker]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
        writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400 ") and b'"invalid_path"' in answer
        assert [h for h in heads if h.startswith(b"POST ")] == []


async def test_a_worker_that_wants_a_key_on_v1_is_probed_with_upstream_api_key(http: aiohttp.ClientSession) -> None:
    """vLLM's `--api-key` guards every /v1/ path, /v1/models included (not /health, /metrics): the pool read the
    worker's models without `upstream_api_key`, was answered 401, and the worker never became healthy (every
    request a 503)."""
    key = "fleet-key"
    seen: list[tuple[str, str | None]] = []

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                    ) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("Authorization")))
        if request.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=MODELS, content_type="application/json")

    async def completions(request: web.Request) -> web.Response:
        return web.Response(body=BODY, content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application(middlewares=[guard])
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with running_gateway([f"http://127.0.0.1:{port}"], upstream_api_key=key) as gw:
            await eventually(lambda: bool(gw.gateway.pool.healthy()), timeout=5)
            async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
                assert (resp.status, await resp.read()) == (200, BODY)
    finally:
        await runner.cleanup()
    assert {auth for _, auth in seen} == {f"Bearer {key}"}  # the probes of /health and /metrics carry it too


# --- after the first byte -----------------------------------------------------------------------------------------


async def _silence(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


async def test_a_stream_that_goes_quiet_after_its_first_chunk_is_cut_within_the_read_timeout(
        http: aiohttp.ClientSession) -> None:
    """Nothing retries once a byte reached the client: a worker silent after its first chunk costs the client
    `read_timeout_s`, then a broken stream (never a clean end that passes a short answer off as whole); the gateway
    counts a 502, releases the worker and keeps serving."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    first = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
    async with (raw_worker(answering(head + first, _silence)) as worker,
                running_gateway([worker], read_timeout_s=0.5) as gw):
        started = time.monotonic()
        async with http.post(gw.url + "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            assert resp.status == 200
            assert await resp.content.readany() == CHUNK
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        # the silence began after the first chunk; the worker would hold the stream open for 30 s
        assert 0.5 <= time.monotonic() - started < 5.0
        pooled = gw.gateway.pool.all()[0]
        await eventually(lambda: pooled.in_flight == 0)
        assert pooled.last_error is not None and "stream broke" in pooled.last_error
        assert 'kvgate_requests_total{model="tiny",status="502"' in await _metrics(http, gw.url)
        async with http.get(gw.url + "/health") as health:
            assert health.status == 200


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(("reply", "then", "error"), [
    # the worker holds the connection open after: the malformed chunk alone breaks the stream
    (SSE_HEAD + b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK) + b"zz\r\nnot a chunk\r\n", _silence, "malformed"),
    (SSE_HEAD + b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK) + b"%x\r\n%s\r\n" % (10, CHUNK[:10]), None, "closed"),
    (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 500\r\n\r\n" + CHUNK, None, "closed"),
], ids=["invalid-chunk-size", "closed-mid-event", "closed-short-of-content-length"])
async def test_a_stream_that_breaks_after_its_first_chunk_reaches_the_client_broken(
        http: aiohttp.ClientSession, reply: bytes, then: Callable[[asyncio.StreamWriter], Awaitable[None]] | None,
        error: str) -> None:
    """After the first byte nothing is retried: a worker whose stream turns malformed, or ends mid-event, or short
    of its Content-Length, gives the client what came before and then, at once, a broken stream (as nginx: no last
    chunk), a 502 in the metrics, the worker released."""
    async with raw_worker(answering(reply, then)) as url, running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        started = time.monotonic()
        async with http.post(gw.url + "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            assert resp.status == 200
            got = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async for piece in resp.content.iter_any():
                    got += piece
            assert got.startswith(CHUNK)
        assert time.monotonic() - started < 5.0
        worker = gw.gateway.pool.get(url)
        assert worker is not None
        await eventually(lambda: worker.in_flight == 0)
        assert worker.last_error is not None and error in worker.last_error
        assert f'kvgate_requests_total{{model="tiny",status="502",worker="{url}"}} 1.0' in await _metrics(http, gw.url)


async def test_a_whole_answer_that_goes_quiet_mid_body_is_a_504(http: aiohttp.ClientSession) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    async with (raw_worker(answering(head + b'{"choices": [', _silence)) as worker,
                running_gateway([worker], read_timeout_s=0.5) as gw):
        async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
            body = orjson.loads(await resp.read())
            assert resp.status == 504 and body["error"]["code"] == "upstream_timeout"
        await eventually(lambda: gw.gateway.pool.all()[0].in_flight == 0)


async def test_an_error_answered_to_a_stream_request_is_relayed_whole(http: aiohttp.ClientSession) -> None:
    """A worker that refuses a streaming request answers JSON, not events: the client gets its status and body."""
    error = b'{"error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}}'
    reply = _reply("400 Bad Request", [("Content-Type", "application/json")], error)
    async with (raw_worker(answering(reply)) as worker, running_gateway([worker]) as gw,
                http.post(gw.url + "/v1/completions", json={**COMPLETION, "stream": True}) as resp):
        assert resp.status == 400 and await resp.read() == error
        assert resp.headers["Content-Type"] == "application/json"


# --- answers too large to hold ------------------------------------------------------------------------------------


async def _endless_head(writer: asyncio.StreamWriter) -> None:
    """A status line, then header lines for as long as the gateway reads them (bounded: 64 MiB)."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    for _ in range(64 * 1024):
        writer.write(line)
        await writer.drain()
    writer.write(b"Content-Length: 2\r\n\r\n{}")


async def test_a_response_head_that_does_not_end_is_cut_at_a_bound(http: aiohttp.ClientSession) -> None:
    """A worker whose headers go on and on: the gateway held every header line it sent (64 MiB and counting, until
    the answer's timeout) and relayed them all; now it cuts the connection once the head passes 64 KiB, retries
    elsewhere, and says 502 when nowhere answers, the same connection's next request served."""
    async with raw_worker(_endless_head) as url, running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        started = time.monotonic()
        async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
            error = await resp.json()
            assert resp.status == 502 and error["error"]["code"] == "upstream_failed"
        assert time.monotonic() - started < 5
        async with http.get(gw.url + "/health") as resp:
            assert resp.status == 200


async def test_a_whole_answer_over_the_limit_is_a_502_and_the_gateway_keeps_serving(
        http: aiohttp.ClientSession) -> None:
    """A non-streamed answer is held whole before it is relayed: one larger than `max_response_bytes` is a 502 with
    its own code, not retried (the worker did its job) and no mark against the worker; one at the limit passes."""
    limit = 1 << 20
    sizes = iter([limit + 1, limit, limit * 8])

    async def answer(writer: asyncio.StreamWriter) -> None:
        body = b'"' + b"x" * (next(sizes) - 2) + b'"'
        writer.write(_reply("200 OK", [("Content-Type", "application/json")], body))
        await writer.drain()

    async with raw_worker(answer) as url, running_gateway([url], max_response_bytes=limit) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        for expected in (502, 200, 502):
            async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
                body = await resp.read()
                assert resp.status == expected
                if expected == 502:
                    assert orjson.loads(body)["error"]["code"] == "upstream_response_too_large"
                else:
                    assert len(body) == limit
        worker = gw.gateway.pool.get(url)
        assert worker is not None and worker.healthy and worker.consecutive_failures == 0
        assert "kvgate_retries_total{" not in await _metrics(http, gw.url)


async def test_a_metrics_page_too_large_to_read_is_not_read(http: aiohttp.ClientSession) -> None:
    """The pool's scrapes of a worker (health, models, metrics) read at most 16 MiB: a /metrics page of 32 MiB
    (vLLM's is tens of kB) leaves the worker's load as it was, and the worker serves."""
    page = b"vllm:num_requests_waiting 7\n" + b"# " + b"x" * (32 << 20) + b"\n"
    async with raw_worker(answering(_reply("200 OK", [], BODY)), metrics=page) as url, \
            running_gateway([url], strategy="least_load") as gw:
        worker = gw.gateway.pool.get(url)
        assert worker is not None
        await eventually(lambda: worker.healthy)
        await asyncio.sleep(0.5)  # two scrapes' time (metrics_interval_s 0.2)
        assert worker.load_scraped_at == 0 and worker.waiting == 0
        async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
            assert (resp.status, await resp.read()) == (200, BODY)


# --- what a worker sends past its answer's end --------------------------------------------------------------------


@pytest.mark.parametrize(("reply", "status", "body"), [
    (_reply("200 OK", [("Content-Type", "application/json")], BODY) + _reply("200 OK", [], b"EVIL!"), 200, BODY),
    (b"HTTP/1.1 204 No Content\r\n\r\nstray", 204, b""),
    (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\nstray", 304, b""),
], ids=["second-answer", "204-with-body", "304-with-body"])
async def test_bytes_past_the_end_of_an_answer_are_not_relayed(
        http: aiohttp.ClientSession, reply: bytes, status: int, body: bytes) -> None:
    """An answer ends where its framing says (no body on a 204 or 304, whatever it declares); what the worker sends
    after that is no part of it and no answer to anything: the client gets the answer as it ended, the connection is
    not used again, the worker keeps serving (as nginx: "upstream sent more data than specified"). A second answer
    in the same read was spliced into the first (its headers added, its body appended), and stray bytes after a
    204 or 304 made that complete answer a 502 and ejected the worker."""
    async with raw_worker(answering(reply)) as url, running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
            assert (resp.status, await resp.read()) == (status, body)
            assert "Content-Length" not in resp.headers or resp.headers["Content-Length"] == str(len(body))
        worker = gw.gateway.pool.get(url)
        assert worker is not None and worker.healthy and worker.last_error is None
        assert "kvgate_retries_total{" not in await _metrics(http, gw.url)


# --- a client that leaves, a deadline that passes -----------------------------------------------------------------


async def test_a_client_that_leaves_before_the_answer_is_counted_once_as_499(http: aiohttp.ClientSession) -> None:
    """A client that gives up on a whole answer while the worker generates it (before its headers) is a 499, the
    worker released; it was counted nowhere (the 499 covered only a body being read)."""

    async def slow(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3)
        writer.write(_reply("200 OK", [("Content-Type", "application/json")], BODY))

    async with raw_worker(slow) as url, running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await http.post(gw.url + "/v1/completions", json=COMPLETION)
        worker = gw.gateway.pool.get(url)
        assert worker is not None
        await eventually(lambda: worker.in_flight == 0)
        counted = [line for line in (await _metrics(http, gw.url)).splitlines()
                   if line.startswith("kvgate_requests_total{")]
        assert counted == [f'kvgate_requests_total{{model="tiny",status="499",worker="{url}"}} 1.0']


async def test_a_whole_answer_cut_by_the_total_timeout_is_a_504_not_also_a_499(http: aiohttp.ClientSession) -> None:
    """A worker that trickles a whole answer past `total_timeout_s` is a 504 to the client and in the metrics; the
    deadline's cancellation was also counted as the client leaving (a 499 besides the 504)."""

    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        for _ in range(50):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.1)

    async with raw_worker(trickle) as url, running_gateway([url], total_timeout_s=1.0, read_timeout_s=0.5) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
            assert resp.status == 504
        text = await _metrics(http, gw.url)
        assert f'kvgate_requests_total{{model="tiny",status="504",worker="{url}"}} 1.0' in text
        assert 'status="499"' not in text


async def test_a_utf8_header_value_reaches_the_client_as_the_worker_sent_it(http: aiohttp.ClientSession) -> None:
    """Header values are relayed byte for byte where the gateway can write them so: a UTF-8 value was read as
    ISO-8859-1 and written as UTF-8, each of its non-ASCII bytes doubled (café became cafÃ©)."""
    reply = _reply("200 OK", [], BODY).replace(b"\r\n", b"\r\nX-Model-Name: caf\xc3\xa9 \xe2\x9c\x93\r\n", 1)
    async with (raw_worker(answering(reply)) as worker, running_gateway([worker]) as gw,
                http.post(gw.url + "/v1/completions", json=COMPLETION) as resp):
        assert resp.status == 200 and await resp.read() == BODY
        assert (b"X-Model-Name", b"caf\xc3\xa9 \xe2\x9c\x93") in resp.raw_headers


async def test_clients_that_leave_mid_stream_leave_nothing_behind(http: aiohttp.ClientSession) -> None:
    """Forty clients hang up mid-stream, twenty at a time, on a worker that would stream forever: each is a 499,
    each worker connection is closed (the worker sees its request end), and the worker's in-flight count, the
    upstream pool's connections and slots all come back to rest."""
    ended = 0

    async def endless(writer: asyncio.StreamWriter) -> None:
        nonlocal ended
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                await writer.drain()
                await asyncio.sleep(0.02)
        except (ConnectionError, RuntimeError):  # (uvloop's, writing to a transport closed already)
            ended += 1

    async def leave() -> None:
        async with http.post(gw.url + "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            assert await resp.content.readline() == CHUNK.split(b"\n")[0] + b"\n"
            resp.close()

    async with raw_worker(endless) as url, running_gateway([url], strategy="ttft") as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        for _ in range(2):
            await asyncio.gather(*(leave() for _ in range(20)))
        worker = gw.gateway.pool.get(url)
        assert worker is not None
        await eventually(lambda: worker.in_flight == 0 and ended == 40)
        upstream = gw.gateway._upstream
        assert upstream is not None
        # (eventually: the pool's probes of the worker take a connection and a slot for a moment every 0.2 s)
        await eventually(lambda: not upstream._in_use and all(
            slots._value == gw.gateway.config.max_connections_per_worker for slots in upstream._slots.values()))
        assert f'kvgate_requests_total{{model="tiny",status="499",worker="{url}"}} 40.0' in await _metrics(http, gw.url)


# --- a stream relayed to a client that reads slowly, or speaks HTTP/1.0 ----------------------------------------------

EVENT = b"data: " + b"x" * 1000 + b"\n\n"


def _event_stream(events: int, sent: list[int]) -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
    """A worker that streams `events` chunked events as fast as it is let (counting them in `sent[0]`)."""

    async def stream(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(events):
            writer.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
            await writer.drain()
            sent[0] += 1
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    return stream


async def _raw_post(url: str, version: bytes, rcvbuf: int | None = None,
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    sock = None
    if rcvbuf is not None:  # a small receive window: the kernel holds little of what the client does not read
        import socket
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    # (a StreamReader reads ahead into its buffer up to twice its limit: kept small, it stops reading when told)
    reader, writer = (await asyncio.open_connection(sock=sock, limit=2**15) if sock is not None
                      else await asyncio.open_connection(host, int(port), limit=2**15))
    body = orjson.dumps({**COMPLETION, "stream": True})
    writer.write(b"POST /v1/completions " + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    return reader, writer


def _dechunk(data: bytes) -> bytes:
    out, at = bytearray(), 0
    while True:
        end = data.index(b"\r\n", at)
        size = int(data[at:end], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + size]
        assert data[end + 2 + size:end + 4 + size] == b"\r\n"
        at = end + 4 + size


async def test_a_client_that_stops_reading_a_stream_stops_the_worker_and_then_gets_every_byte() -> None:
    """A client that stops reading a long stream: the gateway stops reading the worker (what it holds is bounded),
    and once the client reads again it gets the whole stream, framed and in order, whichever way each chunk went
    (written straight to the client's transport while it kept up, through aiohttp's writer while it lagged)."""
    events, sent = 60_000, [0]  # 60 MB; the buffers on the way (the kernel's on three sockets, the gateway's) held
    # about 11,500 of them in a run on this machine
    async with raw_worker(_event_stream(events, sent)) as url, running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        reader, writer = await _raw_post(gw.url, b"HTTP/1.1", rcvbuf=64 * 1024)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
        await asyncio.sleep(1.5)  # not reading: what the worker got out is what the buffers on the way hold
        held = sent[0]
        assert held < events // 2, f"{held} events of 1 kB sent to a client that reads nothing"
        parts: list[bytes] = []
        async with asyncio.timeout(60):
            while not (parts and b"".join(parts[-2:]).endswith(b"\r\n0\r\n\r\n")):
                parts.append(await reader.read(2**16))
                assert parts[-1], "the gateway closed the stream before its end"
        writer.close()
        data = b"".join(parts)
        body = _dechunk(data)
        assert body == EVENT * events + b"data: [DONE]\n\n"


async def test_an_http_1_0_client_gets_the_stream_unchunked_until_the_close() -> None:
    """HTTP/1.0 has no chunked coding: the stream's bytes as they are, its end the connection's close."""
    sent = [0]
    async with raw_worker(_event_stream(50, sent)) as url, running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        reader, writer = await _raw_post(gw.url, b"HTTP/1.0")
        data = await asyncio.wait_for(reader.read(), 30)  # to the close
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
        assert body == EVENT * 50 + b"data: [DONE]\n\n"
