"""The gateway's HTTP/1.1 client to its workers: pooled keep-alive connections, one write per request.

Every proxied request pays for this client, so it is kept lean: requests are serialised into one buffer and
written with one call, responses are parsed by llhttp (through `httptools`) straight from the protocol's
`data_received`, and body chunks are handed over as they arrive. Measured on the proxy path it costs about a
third of aiohttp's client (see bench/overhead.py).

A connection taken from the idle pool may have been closed by the worker in the meantime (vLLM's keep-alive is
5 s): if it fails before any response byte arrives, the request is sent once more on a fresh connection, so a
stale socket is never mistaken for a dead worker.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import AsyncIterator, Iterable
from typing import cast
from urllib.parse import urlsplit

import httptools

# Idle connections older than this are closed rather than reused (below uvicorn's/vLLM's 5 s keep-alive).
IDLE_TTL_S = 4.0
# Above this many buffered body bytes the socket stops reading until the consumer catches up.
HIGH_WATER = 1 << 20
# A response head (status line and headers) still unfinished after this many bytes is no worker's: vLLM's are a
# few hundred bytes, and one that never ends would otherwise grow in the gateway until a timeout. The same bound
# holds for any bytes that bring nothing (no body byte, no end) once the head is in: a chunked answer's trailers.
MAX_HEAD_BYTES = 64 * 1024
# The largest body `fetch` reads (a worker's /health, /v1/models, /metrics: vLLM's /metrics is tens of kB).
FETCH_MAX_BYTES = 16 * 1024 * 1024


class UpstreamError(Exception):
    """The worker could not be reached, or the connection broke before the response was complete."""


class UpstreamConnectError(UpstreamError):
    """The connection could not be opened (refused, unreachable, connect timeout)."""


class UpstreamTooLarge(UpstreamError):
    """The response's body is larger than its reader's limit (the connection is dropped)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the response currently being read from it."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        # (kept: Python 3.11's get_running_loop() makes a getpid() system call, and a stream waits once an event)
        self.loop = asyncio.get_running_loop()
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.keep_alive = False
        self.got_bytes = False
        self.head_bytes = 0  # fed to the parser since it last gave anything (the head, body bytes, the end)
        self.headers_done = False
        self.close_delimited = False  # the body ends when the connection closes (no length, not chunked)
        self.complete = False
        self.error: BaseException | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        buffered = self._buffered
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("unexpected protocol upgrade from worker"))
        except httptools.HttpParserError as exc:
            if self.complete:
                # bytes after the answer's end (a body on a 204, more than its Content-Length, a second answer):
                # the answer stands, but the connection is not used again, or they would be read as the next
                # request's answer
                self.keep_alive = False
                self.abort()
            else:
                self._fail(UpstreamError(f"malformed HTTP response from worker: {exc}"))
        if not self.headers_done or (self._buffered == buffered and not self.complete):
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                what = "response head exceeds" if not self.headers_done else "trailers exceed"
                self._fail(UpstreamError(f"the worker's {what} {MAX_HEAD_BYTES} bytes"))
        else:
            self.head_bytes = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.complete:
            if self.headers_done and self.close_delimited and exc is None:
                self.on_message_complete()  # the body was delimited by the close
            else:
                self._fail(UpstreamError(f"worker closed the connection{': ' + str(exc) if exc else ''}"))

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self.complete:  # the parser goes on past the answer's end: stopped here (see data_received)
            raise UpstreamError("bytes after the end of the worker's answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.headers_done:  # a trailer: nothing relays it
            return
        try:  # aiohttp writes header values as UTF-8: so a UTF-8 value reaches the client as the worker sent it
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text = value.decode("latin-1")  # (obs-text, read as RFC 9110 says it once was: ISO-8859-1)
        self.headers.append((name.decode("latin-1"), text))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints), never asked for: the answer follows
            self.headers = []
            return
        framed = False  # by a Content-Length, or chunked
        for key, value in self.headers:
            name = key.lower()
            if name == "content-length":
                framed = True
            elif name == "transfer-encoding":
                if value.lower() != "chunked" and {c.strip() for c in value.lower().split(",")} != {"chunked"}:
                    # a coding the gateway does not undo (gzip...): its bytes would reach the client as the answer
                    self._fail(UpstreamError(f"unsupported transfer coding from worker: {value[:100]!r}"))
                    return
                framed = True
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        # a close before a Content-Length or chunked body is complete is a truncated answer, never its end
        self.close_delimited = not self.keep_alive and not framed
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        waiter = self._waiter  # (`_wake`, written out: once for every chunk)
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def on_message_complete(self) -> None:
        if self.headers_done:  # else the end of an interim answer
            self.complete = True
            self._wake()

    # --- consumer side ---

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def next_event(self) -> asyncio.Future[None]:
        """A future done at the next parser event (headers, a chunk, the end or an error): awaited where it is
        asked for, not through a coroutine of its own (the request path's every resumption passes each one)."""
        self._waiter = waiter = self.loop.create_future()
        return waiter

    def take(self) -> bytes:
        data = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def has_data(self) -> bool:
        return bool(self._chunks)

    @property
    def buffered(self) -> int:
        return self._buffered

    def send(self, payload: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(payload)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


@functools.lru_cache(maxsize=256)
def _split(url: str) -> tuple[str, str, int, str, str]:
    """A request URL's scheme, host, port, request target and Host header, parsed once per URL: the gateway sends
    the same few (a worker's generation endpoints) over and over, and `urlsplit` with its `hostname` and `port`
    is Python-level work on every call."""
    parts = urlsplit(url)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80), target,
            parts.netloc)


class UpstreamResponse:
    """A worker's response whose headers have arrived; read the body whole or chunk by chunk, then let go."""

    def __init__(self, pool: UpstreamPool, conn: _Connection, read_timeout: float | None) -> None:
        self._pool = pool
        self._conn = conn
        self._read_timeout = read_timeout
        self._done = False
        self.status = conn.status
        self.headers = conn.headers
        # the read timeout: one timer for the whole body, not one per chunk (a timer armed and cancelled for every
        # event of a stream was an eighth of the gateway's CPU relaying it). A wait records when it began; the
        # timer, when it fires, ends the wait in progress if that one is `read_timeout` old, else fires again when
        # it will be, and is armed anew by the next wait if none is in progress.
        self._waiter: asyncio.Future[None] | None = None
        self._waited_at = 0.0
        self._silence: asyncio.TimerHandle | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamError if the connection breaks, TimeoutError on silence."""
        conn = self._conn
        timeout = self._read_timeout
        loop = conn.loop
        while True:
            if conn._chunks:  # (`has_data` and `take`, written out: this runs twice for every chunk relayed)
                yield conn.take()
                continue
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                self._finish()
                return
            self._waiter = waiter = conn.next_event()
            if timeout:
                self._waited_at = now = loop.time()
                if self._silence is None:
                    self._silence = loop.call_at(now + timeout, self._check_silence)
            await waiter

    def _check_silence(self) -> None:
        self._silence = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self._read_timeout is None:
            return  # no wait in progress: the next one arms the timer again
        loop = self._conn.loop
        due = self._waited_at + self._read_timeout
        if loop.time() >= due:
            waiter.set_exception(TimeoutError())
        else:
            self._silence = loop.call_at(due, self._check_silence)

    def _stop_timer(self) -> None:
        if self._silence is not None:
            self._silence.cancel()
            self._silence = None
        self._waiter = None

    async def read(self, limit: int) -> bytes:
        """The whole body; UpstreamTooLarge once it exceeds `limit` bytes (what was read is let go)."""
        conn = self._conn
        if conn.complete and conn.error is None and conn.buffered <= limit:  # it came with the headers, as short
            data = conn.take()                                               # answers do
            self._finish()
            return data
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise UpstreamTooLarge(f"the worker's answer exceeds {limit} bytes")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _finish(self) -> None:
        self._stop_timer()
        if not self._done:
            self._done = True
            self._pool._release(self._conn)

    def close(self) -> None:
        """Let go of the response: a finished one returns its connection to the pool, an unfinished one
        drops it so the worker sees the request end."""
        self._stop_timer()
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.complete and not conn.has_data() and conn.error is None:
            self._pool._release(conn)
        else:
            self._pool._drop(conn)


class UpstreamPool:
    """Keep-alive connections to every worker, at most `limit_per_host` open per worker."""

    def __init__(self, *, limit_per_host: int, connect_timeout: float) -> None:
        self._limit = limit_per_host
        self._connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        self._slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._in_use: dict[_Connection, asyncio.Semaphore] = {}

    async def request(
        self,
        method: str,
        url: str,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes | None = None,
        *,
        read_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send a request and wait for the response headers (callers bound that wait with asyncio.timeout)."""
        scheme, host, port, target, netloc = _split(url)
        if scheme != "http":
            raise UpstreamConnectError(f"only http:// workers are supported, not {scheme}://")
        lines = [f"{method} {target} HTTP/1.1\r\nHost: {netloc}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}\r\n")
        lines.append("\r\n")
        payload = "".join(lines).encode("latin-1") + (body or b"")
        key = (host, port)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = asyncio.Semaphore(self._limit)
        await slots.acquire()
        try:
            # one coroutine frame from here to the socket: the exchange is written out, not a method awaited
            conn = self._take_idle(key)
            reused = conn is not None
            if conn is None:
                conn = await self._open(key)
            conn.send(payload)
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        if not reused or conn.got_bytes:
                            raise conn.error
                        # a stale keep-alive connection, failed before any response byte: once more, on a fresh one
                        conn.abort()
                        conn = await self._open(key)
                        reused = False
                        conn.send(payload)
                        continue
                    await conn.next_event()
            except BaseException:
                conn.abort()
                raise
        except BaseException:
            slots.release()
            raise
        self._in_use[conn] = slots
        return UpstreamResponse(self, conn, read_timeout)

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing() and now - conn.idle_since < IDLE_TTL_S:
                return conn
            if conn.transport is not None:
                conn.transport.close()
        return None

    async def _open(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(key), key[0], key[1])
        except TimeoutError:
            raise UpstreamConnectError(f"connect to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from None
        return conn

    def _release(self, conn: _Connection) -> None:
        slots = self._in_use.pop(conn, None)
        if slots is not None:
            slots.release()
        kept = slots is not None and self._slots.get(conn.key) is slots  # not when its worker was forgotten since
        if kept and conn.keep_alive and conn.transport is not None and not conn.transport.is_closing():
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.key, collections.deque()).append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def _drop(self, conn: _Connection) -> None:
        slots = self._in_use.pop(conn, None)
        if slots is not None:
            slots.release()
        if conn.transport is not None:
            conn.transport.abort()

    async def fetch(self, url: str, timeout: float, limit: int = FETCH_MAX_BYTES,
                    headers: Iterable[tuple[str, str]] = ()) -> tuple[int, bytes]:
        """GET a small resource (health, models, metrics) within `timeout` seconds and `limit` bytes."""
        async with asyncio.timeout(timeout):
            response = await self.request("GET", url, headers)
            try:
                return response.status, await response.read(limit)
            finally:
                response.close()

    def forget(self, url: str, others: Iterable[str] = ()) -> None:
        """Close the idle connections to a removed worker's host and port and drop its slots, unless one of the
        `others` (the workers still in the pool) is served there too; one still in use is closed when released.
        (They stayed open for as long as the gateway ran: a descriptor or more for every address discovery saw.)"""
        key = _split(url)[1:3]
        if any(_split(other)[1:3] == key for other in others):
            return
        self._slots.pop(key, None)
        for conn in self._idle.pop(key, ()):
            if conn.transport is not None:
                conn.transport.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
        for conn in list(self._in_use):
            if conn.transport is not None:
                conn.transport.abort()

