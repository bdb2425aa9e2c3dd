"""The gateway's upstream HTTP client against real servers, including ones that misbehave on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from bench.procs import free_port
from router.upstream import FETCH_MAX_BYTES, UpstreamConnectError, UpstreamError, UpstreamPool
from tests.abuse_servers import raw_server, read_request
from tests.conftest import running_standin


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(limit_per_host=4, connect_timeout=1.0)
    yield p
    p.close()


async def test_json_stream_and_keep_alive_reuse(pool: UpstreamPool) -> None:
    async with running_standin() as worker:
        for _ in range(3):
            resp = await pool.request("POST", worker.url + "/v1/completions", [("Content-Type", "application/json")],
                                      b'{"model": "tiny", "prompt": "x", "max_tokens": 3}')
            assert resp.status == 200
            assert b'" t0 t1 t2"' in await resp.read(FETCH_MAX_BYTES)
            resp.close()
        resp = await pool.request("POST", worker.url + "/v1/completions", [],
                                  b'{"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": true}')
        chunks = [c async for c in resp.chunks()]
        resp.close()
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
        assert len(pool._idle[("127.0.0.1", int(worker.url.rsplit(":", 1)[1]))]) == 1  # one connection, reused


async def test_connection_refused_is_a_connect_error(pool: UpstreamPool) -> None:
    with pytest.raises(UpstreamConnectError):
        await pool.request("GET", f"http://127.0.0.1:{free_port()}/health")


async def test_stale_idle_connection_is_replaced_not_reported(pool: UpstreamPool) -> None:
    """The server answers one request per connection, then closes when the next one arrives (as a server
    whose keep-alive timer fired just as the request was sent)."""
    served = dropped = 0

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served, dropped
        await read_request(reader)
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)
        dropped += 1

    async with raw_server(reply) as url:
        for _ in range(3):
            assert await pool.fetch(url + "/x", 2.0) == (200, b"ok")
        assert served == 3 and dropped == 2


async def test_a_fresh_connection_that_fails_is_not_sent_again(pool: UpstreamPool) -> None:
    """Only a reused connection that fails before any response byte is replaced: a fresh one failing so is the
    worker's error, whether it was the first try or the stale connection's replacement. Slots come back."""
    requests = 0
    answer_first = True

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests, answer_first
        await read_request(reader)
        requests += 1
        if answer_first:  # one answer, keep-alive; closed once the next request on it arrives
            answer_first = False
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await read_request(reader)
            requests += 1

    async with raw_server(reply) as url:
        assert await pool.fetch(url, 2.0) == (200, b"ok")
        with pytest.raises(UpstreamError, match="closed"):  # stale, then a fresh one that fails: two sends, no third
            await pool.fetch(url, 2.0)
        assert requests == 3
        for _ in range(5):  # a fresh connection each time (nothing idle): one send each; more than limit_per_host
            with pytest.raises(UpstreamError, match="closed"):
                await pool.fetch(url, 2.0)
        assert requests == 8


async def test_body_delimited_by_close_and_chunked(pool: UpstreamPool) -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"world")
        await writer.drain()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"6\r\n world\r\n0\r\n\r\n")
        await writer.drain()

    async with raw_server(close_delimited) as url:
        assert await pool.fetch(url, 2.0) == (200, b"hello world")
    async with raw_server(chunked) as url:
        assert await pool.fetch(url, 2.0) == (200, b"hello world")


async def test_truncated_and_malformed_answers_raise(pool: UpstreamPool) -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly a bit")
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    async with raw_server(truncated) as url:
        resp = await pool.request("GET", url)
        with pytest.raises(UpstreamError, match="closed"):
            await resp.read(FETCH_MAX_BYTES)
        resp.close()
    async with raw_server(garbage) as url:
        with pytest.raises(UpstreamError, match="malformed"):
            await pool.request("GET", url)


async def test_read_timeout_on_silence_and_slot_released(pool: UpstreamPool) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(2)

    async with raw_server(silent) as url:
        for _ in range(6):  # more than limit_per_host: slots must come back after each failure
            resp = await pool.request("GET", url, read_timeout=0.1)
            with pytest.raises(TimeoutError):
                await resp.read(FETCH_MAX_BYTES)
            resp.close()


async def test_request_line_and_host_header_per_url(pool: UpstreamPool) -> None:
    """The request target (path and query) and the Host header are each URL's own, though a URL is parsed once and
    remembered."""
    heads: list[bytes] = []

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                heads.append(await read_request(reader))
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async with raw_server(reply) as url:
        for path in ("/v1/models?a=1", "/v1/models?a=2", "/v1/models", "", "/v1/models?a=1"):
            assert await pool.fetch(url + path, 2.0) == (200, b"ok")
        with pytest.raises(UpstreamConnectError):
            await pool.request("GET", url.replace("http://", "https://") + "/x")
    netloc = url.removeprefix("http://").encode()
    assert [h.split(b"\r\n")[:2] for h in heads] == [
        [b"GET " + target + b" HTTP/1.1", b"Host: " + netloc]
        for target in (b"/v1/models?a=1", b"/v1/models?a=2", b"/v1/models", b"/", b"/v1/models?a=1")]


async def test_bytes_a_worker_sends_between_answers_do_not_reach_the_next_one(pool: UpstreamPool) -> None:
    """A keep-alive connection on which the worker wrote after its answer's end (here: an answer's head, left
    unfinished) is not used again: those bytes were read as the start of the next request's answer, its first bytes
    taken as the stale answer's body and the rest as a malformed response (UpstreamError on a healthy worker)."""

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
            await writer.drain()

    async with raw_server(reply) as url:
        for _ in range(3):
            assert await pool.fetch(url + "/x", 2.0) == (200, b"ok")
            await asyncio.sleep(0.3)  # the stray head arrives while the connection is idle


async def test_interim_answers_are_skipped(pool: UpstreamPool) -> None:
    """1xx answers (the gateway never asks for one) precede the answer and are skipped: the last of them was taken
    for the answer (a 103 with no body here), and the real one, arriving later, read as bytes after it."""

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_server(reply) as url:
        resp = await pool.request("GET", url + "/x")
        assert (resp.status, await resp.read(FETCH_MAX_BYTES)) == (200, b"ok")
        assert resp.headers == [("X-A", "1"), ("Content-Length", "2")]
        resp.close()


async def test_trailers_that_do_not_end_are_cut_at_a_bound(pool: UpstreamPool) -> None:
    """A chunked answer's trailer section is a head of its own, bounded as the head is: a worker that sent trailer
    lines without end after its last chunk had each kept (840,000 in 3 s, a GiB) until the read timeout."""

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n")
        line = b"X-Trailer: " + b"a" * 1000 + b"\r\n"
        with contextlib.suppress(ConnectionError):
            for _ in range(4096):  # bounded: 64 MiB
                writer.write(line * 16)
                await writer.drain()

    async with raw_server(reply) as url:
        resp = await pool.request("GET", url + "/x", read_timeout=10.0)
        started = time.monotonic()
        with pytest.raises(UpstreamError, match="65536 bytes"):
            async for chunk in resp.chunks():
                assert chunk == b"ok"
        resp.close()
        assert time.monotonic() - started < 5.0 and resp.headers == [("Transfer-Encoding", "chunked")]


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"gzip"])
async def test_a_transfer_coding_other_than_chunked_is_refused(pool: UpstreamPool, coding: bytes) -> None:
    """The client would get the coded bytes as if they were the answer (its Transfer-Encoding is the gateway's own,
    chunked or none): refused as nginx does ("upstream sent unknown Transfer-Encoding")."""

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = b"3\r\nabc\r\n0\r\n\r\n" if coding.endswith(b"chunked") else b"abc"
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()

    async with raw_server(reply) as url:
        with pytest.raises(UpstreamError, match="transfer coding"):
            await pool.fetch(url + "/x", 2.0)


async def test_the_read_timeout_is_each_wait_s_own_through_a_long_stream(pool: UpstreamPool) -> None:
    """The read timeout is one timer per answer, not one per chunk: it bounds each wait for the next chunk, not
    the stream. Chunks 0.15 s apart for 1.2 s under a 0.4 s timeout all arrive (a timer armed at the first wait and
    fired at its 0.4 s must let the wait in progress run its own 0.4 s); then a silence is cut within [0.4 s, 1.4 s).
    The connection is reused after a whole answer, and the earlier answer's timer never ends the next one's waits."""

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await read_request(reader)  # a whole stream, then the next answer's chunks after a pause each
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(8):
                writer.write(b"2\r\n%02d\r\n" % i)
                await writer.drain()
                await asyncio.sleep(0.15)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(3):
                await asyncio.sleep(0.3)
                writer.write(b"2\r\n%02d\r\n" % i)
                await writer.drain()
            await asyncio.sleep(30)  # silent, with the answer unfinished

    async with raw_server(reply) as url:
        resp = await pool.request("GET", url + "/s", read_timeout=0.4)
        assert [c async for c in resp.chunks()] == [b"%02d" % i for i in range(8)]
        resp.close()
        resp = await pool.request("GET", url + "/s", read_timeout=0.4)  # the same connection, taken from idle
        got: list[bytes] = []
        with pytest.raises(TimeoutError):
            async for chunk in resp.chunks():
                got.append(chunk)
                started = time.monotonic()
        silent = time.monotonic() - started
        resp.close()
        assert got == [b"00", b"01", b"02"] and 0.35 <= silent < 1.4
